"""Tests of `inference_local_calls` on a one-process mesh (the
multi-process case: `integration_tests/keras_hub_workflow_test.py`)."""

import torch
from torch.distributed.tensor import DTensor

from keras.src import layers
from keras.src.backend.torch import batch_local
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import inference_local_calls
from keras.src.backend.torch import local_calls
from keras.src.backend.torch.batch_local_test import LocalCallTestCase


class _DependsOnDTensors(layers.Layer):
    """Computes otherwise on local tensors than on DTensors."""

    def call(self, x):
        return x * (2.0 if isinstance(x, DTensor) else 3.0)


class InferenceLocalCallsTest(LocalCallTestCase):
    def call(self, layer, x):
        """`layer(x)` through this path, in a step, without gradients;
        returns the output and the number of calls on DTensors."""
        calls = []

        def upstream_call(owner, *args, **kwargs):
            # The layer's `call` alone: `Layer.__call__` would route the
            # call through `batch_local` again.
            return owner.call(*args, **kwargs)

        def on_dtensors():
            calls.append(1)
            return upstream_call(layer, x)

        with torch.no_grad():
            with created_tensors.replicate_created_tensors(self.mesh):
                signature = batch_local._signature(((x,), {}, None), [])
                output = inference_local_calls.call_layer(
                    layer, upstream_call, (x,), {}, signature, on_dtensors
                )
        return output, len(calls)

    def test_a_call_reproduced_on_local_tensors_runs_locally(self):
        dense = layers.Dense(3)
        dense.build((None, 5))
        x = self.batch((4, 5))
        first, first_calls = self.call(dense, x)
        second, second_calls = self.call(dense, x)
        self.assertEqual((first_calls, second_calls), (1, 0))
        self.assertTrue(inference_local_calls.runs_locally(dense))
        self.assertIsInstance(second, DTensor)
        self.assertTrue(local_calls.computed_locally(second))
        self.assertEqual(second.placements, first.placements)
        self.assertTrue(torch.equal(second.full_tensor(), first.full_tensor()))

    def test_a_call_computing_otherwise_locally_keeps_dtensors(self):
        layer = _DependsOnDTensors()
        x = self.batch((4, 5))
        first, _ = self.call(layer, x)
        second, second_calls = self.call(layer, x)
        self.assertEqual(second_calls, 1)
        self.assertFalse(inference_local_calls.runs_locally(layer))
        self.assertTrue(torch.equal(second.full_tensor(), 2 * x.full_tensor()))

    def test_applies_only_without_gradients(self):
        x = self.batch((4, 5))
        mesh = x.device_mesh
        self.assertFalse(inference_local_calls.applies([x], mesh))
        with torch.no_grad():
            self.assertTrue(inference_local_calls.applies([x], mesh))
            self.assertFalse(inference_local_calls.applies([], mesh))
