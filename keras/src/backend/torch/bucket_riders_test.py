"""Tests of partial values riding along with gradients in a bucket."""

import os
from unittest import mock

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Partial

from keras.src import testing
from keras.src.backend.torch import bucket_riders
from keras.src.backend.torch import reducer
from keras.src.backend.torch import reducer_test


class BucketRidersTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = reducer_test.one_process_mesh()
        self.shapes = [(8, 16), (16, 16), (16, 4)]
        reducer_test.pretend_mesh_dims_of_size_two(self)

    def partial_scalar(self, value, reduce_op="avg", dtype=torch.float32):
        return DTensor.from_local(
            torch.tensor(value, dtype=dtype),
            self.mesh,
            [Partial(reduce_op)],
            run_check=False,
        )

    def parameters(self):
        return reducer_test.replicated_parameters(self.mesh, self.shapes)

    def backward(self, parameters):
        reducer_test.mlp_loss(parameters, self.mesh).backward()

    def test_a_partial_value_rides_the_last_bucket(self):
        parameters = self.parameters()
        loss = self.partial_scalar(3.0)
        with reducer_test.counting_all_reduce() as all_reduce:
            with bucket_riders.reduced_with_gradients(loss) as rider:
                self.backward(parameters)
        # One collective: the gradients' bucket, one element longer.
        self.assertEqual(all_reduce.call_count, 1)
        flat = all_reduce.call_args.args[0]
        self.assertEqual(flat.numel(), sum(np.prod(s) for s in self.shapes) + 1)
        value = rider.value()
        self.assertIsInstance(value, DTensor)
        self.assertEqual(tuple(value.placements), (Replicate(),))
        self.assertEqual(value.shape, ())
        # The sum over the (pretended) 2 processes, averaged: over this one
        # process the all-reduce leaves 3.0, divided by 2.
        self.assertEqual(value.to_local().item(), 1.5)
        expected = reducer_test.reference_gradients(self.mesh, self.shapes)
        for parameter, want in zip(parameters, expected):
            self.assertAllClose(
                parameter.grad.full_tensor().numpy(), want, atol=1e-6
            )
        self.assertEqual(reducer.current().riders, [])

    def test_a_partial_sum_rides_undivided(self):
        loss = self.partial_scalar(3.0, reduce_op="sum")
        with bucket_riders.reduced_with_gradients(loss) as rider:
            self.backward(self.parameters())
        self.assertEqual(rider.value().to_local().item(), 3.0)

    def test_values_that_cannot_ride_are_left_as_they_are(self):
        replicated = distribute_tensor(
            torch.tensor(2.0), self.mesh, [Replicate()]
        )
        cases = {
            "replicated": replicated,
            "plain": torch.tensor(2.0),
            "other dtype": self.partial_scalar(2.0, dtype=torch.float64),
            "max": self.partial_scalar(2.0, reduce_op="max"),
        }
        for name, value in cases.items():
            with self.subTest(name):
                parameters = self.parameters()
                with reducer_test.counting_all_reduce() as all_reduce:
                    with bucket_riders.reduced_with_gradients(value) as rider:
                        self.backward(parameters)
                self.assertIs(rider.value(), value)
                flat = all_reduce.call_args.args[0]
                self.assertEqual(
                    flat.numel(), sum(np.prod(s) for s in self.shapes)
                )

    def test_no_open_bucket_at_the_end_leaves_the_value_alone(self):
        loss = self.partial_scalar(3.0)
        with mock.patch.dict(os.environ, {reducer.BUCKET_CAP_ENV_VAR: "0"}):
            with bucket_riders.reduced_with_gradients(loss) as rider:
                self.backward(self.parameters())
        self.assertIs(rider.value(), loss)

    def test_a_value_given_without_backward_does_not_ride_later(self):
        loss = self.partial_scalar(3.0)
        with bucket_riders.reduced_with_gradients(loss) as rider:
            self.assertEqual(reducer.current().riders, [rider])
        self.assertEqual(reducer.current().riders, [])
        parameters = self.parameters()
        with reducer_test.counting_all_reduce() as all_reduce:
            self.backward(parameters)
        flat = all_reduce.call_args.args[0]
        self.assertEqual(flat.numel(), sum(np.prod(s) for s in self.shapes))
        self.assertIs(rider.value(), loss)

    def test_riders_keys_and_divisors(self):
        rider = bucket_riders.rider_of(self.partial_scalar(3.0))
        self.assertEqual(
            rider.key, (id(self.mesh), ((0,), "sum"), rider.local.dtype)
        )
        self.assertEqual(rider.divisor, 2)
        summed = bucket_riders.rider_of(self.partial_scalar(3.0, "sum"))
        self.assertEqual(summed.key, rider.key)
        self.assertEqual(summed.divisor, 1)
        plain = bucket_riders.rider_of(torch.tensor(1.0))
        self.assertIsNone(plain.key)
        self.assertIsNone(plain.local)
