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


def call_on_path(path, mesh, layer, x):
    """`layer(x)` through `path` (`inference_local_calls` or
    `training_local_calls`) in a step on `mesh`; returns the output and
    the number of calls on DTensors."""
    calls = []

    def upstream_call(owner, *args, **kwargs):
        # The layer's `call` alone: `Layer.__call__` would route the call
        # through `batch_local` again.
        return owner.call(*args, **kwargs)

    def on_dtensors():
        calls.append(1)
        return upstream_call(layer, x)

    with created_tensors.replicate_created_tensors(mesh):
        signature = batch_local._signature(((x,), {}, None), [])
        output = path.call_layer(
            layer, upstream_call, (x,), {}, signature, on_dtensors
        )
    return output, len(calls)


class InferenceLocalCallsTest(LocalCallTestCase):
    def call(self, layer, x):
        """`layer(x)` through this path, in a step, without gradients;
        returns the output and the number of calls on DTensors."""
        with torch.no_grad():
            return call_on_path(inference_local_calls, self.mesh, layer, x)

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

    def test_an_assigning_call_keeps_dtensors(self):
        from keras.src.backend.torch.training_local_calls_test import _Counting

        layer = _Counting()
        layer.build((None, 5))
        x = self.batch((4, 5))
        self.call(layer, x)
        _, second_calls = self.call(layer, x)
        self.assertEqual(second_calls, 1)
        self.assertFalse(inference_local_calls.runs_locally(layer))
        # The check's local run assigned nothing: one count per call.
        self.assertEqual(float(layer.count.value.full_tensor()), 2.0)
