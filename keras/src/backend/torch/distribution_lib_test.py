"""Single-process tests of the torch `distribution_lib`.

Meshes of any shape can be converted to placements in one process; only
building a torch mesh needs the processes to exist, so values on real
multi-process meshes are tested in `integration_tests/foundation_test.py`.
"""

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src import optimizers
from keras.src import testing
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch.core import convert_to_numpy
from keras.src.distribution import distribution_lib as distribution_api
from keras.src.utils import rng_utils


def mesh_of(shape, axis_names):
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    return distribution_api.DeviceMesh(shape, axis_names, devices)


class DevicesTest(testing.TestCase):
    def test_list_devices_one_per_process(self):
        self.assertEqual(distribution_lib.list_devices("cpu"), ["cpu:0"])
        self.assertEqual(distribution_lib.list_devices("CPU"), ["cpu:0"])
        self.assertEqual(distribution_lib.get_device_count("cpu"), 1)
        self.assertEqual(distribution_lib.num_processes(), 1)
        self.assertEqual(distribution_lib.process_id(), 0)

    def test_keras_api_uses_torch_backend(self):
        self.assertIs(backend.distribution_lib, distribution_lib)
        self.assertEqual(
            distribution_api.list_devices("cpu"),
            distribution_lib.list_devices("cpu"),
        )

    def test_unknown_device_type(self):
        with self.assertRaisesRegex(ValueError, "tpu"):
            distribution_lib.list_devices("tpu")

    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs no CUDA")
    def test_unavailable_device_type_is_an_error(self):
        for call in (
            distribution_lib.list_devices,
            distribution_lib.get_device_count,
        ):
            with self.assertRaisesRegex(
                ValueError, "'gpu' is not available.*Available.*'cpu'"
            ):
                call("gpu")

    def test_to_backend_device(self):
        self.assertEqual(
            distribution_lib._to_backend_device("cpu:3"), torch.device("cpu")
        )
        with self.assertRaisesRegex(ValueError, "Device not found"):
            distribution_lib._to_backend_device("abc:1")


class LayoutMapTest(testing.TestCase):
    def test_exact_key_then_regex(self):
        mesh = mesh_of((2,), ("model",))
        layout_map = distribution_api.LayoutMap(mesh)
        layout_map["dense/kernel"] = (None, "model")
        layout_map[".*kernel"] = ("model", None)
        self.assertEqual(layout_map["dense/kernel"].axes, (None, "model"))
        self.assertEqual(layout_map["other/kernel"].axes, ("model", None))
        self.assertIsNone(layout_map["other/bias"])

    def test_torch_style_separators(self):
        mesh = mesh_of((2,), ("model",))
        layout_map = distribution_api.LayoutMap(mesh)
        layout_map["encoder.dense.kernel"] = (None, "model")
        self.assertEqual(
            layout_map["encoder/dense/kernel"].axes, (None, "model")
        )

    def test_several_matches_is_an_error(self):
        mesh = mesh_of((2,), ("model",))
        layout_map = distribution_api.LayoutMap(mesh)
        layout_map["dense.*"] = (None, "model")
        layout_map[".*kernel"] = ("model", None)
        with self.assertRaisesRegex(ValueError, "matches multiple"):
            layout_map["dense/kernel"]


class SingleProcessDistributionTest(testing.TestCase):
    """On a one-device mesh every value is a DTensor with one shard."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("model",), ["cpu:0"])

    def tearDown(self):
        distribution_api.set_distribution(None)
        super().tearDown()

    def test_backend_mesh_is_cached(self):
        other = distribution_api.DeviceMesh((1,), ("model",), ["cpu:0"])
        self.assertIs(self.mesh.backend_mesh, other.backend_mesh)
        self.assertEqual(self.mesh.backend_mesh.mesh_dim_names, ("model",))

    def test_mesh_must_cover_every_process(self):
        mesh = distribution_api.DeviceMesh((1,), ("model",), ["cpu:5"])
        with self.assertRaisesRegex(ValueError, "one device per process"):
            mesh.backend_mesh

    def test_variables_are_dtensor_parameters(self):
        layout_map = distribution_api.LayoutMap(self.mesh)
        layout_map[".*dense/kernel"] = (None, "model")
        distribution_api.set_distribution(
            distribution_api.ModelParallel(layout_map=layout_map)
        )
        model = models.Sequential(
            [layers.Input((3,)), layers.Dense(2, name="dense")]
        )
        for variable in model.weights:
            self.assertIsInstance(variable.value, DTensor)
            self.assertIsInstance(variable.value, torch.nn.Parameter)
        self.assertEqual(
            tuple(model.layers[0].kernel.value.placements), (Shard(1),)
        )
        self.assertIn("placements=(Shard(dim=1),)", repr(model.weights[0]))
        optimizer = optimizers.Adam()
        optimizer.build(model.trainable_variables)
        self.assertEqual(
            tuple(optimizer.variables[2].value.placements), (Shard(1),)
        )

    def test_explicit_layout_wins(self):
        layout = distribution_api.TensorLayout(("model", None), self.mesh)
        variable = backend.Variable(np.ones((2, 2)), layout=layout)
        self.assertIsInstance(variable.value, DTensor)
        self.assertEqual(variable._layout, layout)

    def test_assign_and_numpy(self):
        distribution_api.set_distribution(
            distribution_api.DataParallel(devices=["cpu:0"])
        )
        variable = backend.Variable(np.zeros((2, 3)), dtype="float32")
        parameter = variable.value
        variable.assign(np.ones((2, 3)))
        self.assertIsInstance(variable.value, DTensor)
        self.assertAllClose(variable.numpy(), np.ones((2, 3)))
        # A replicated parameter takes plain values in place, cast to its
        # dtype, whatever their type.
        variable.assign(torch.full((2, 3), 2.0, dtype=torch.float64))
        self.assertIs(variable.value, parameter)
        self.assertEqual(variable.value.dtype, torch.float32)
        self.assertEqual(tuple(variable.value.placements), (Replicate(),))
        self.assertAllClose(variable.numpy(), np.full((2, 3), 2.0))
        variable.assign(np.ones((2, 3)))
        self.assertAllClose(
            convert_to_numpy([variable.value, variable.value]),
            np.ones((2, 2, 3)),
        )

    def test_global_batch_takes_keras_and_backend_layouts(self):
        from keras.src.backend.torch import batch_distribution
        from keras.src.backend.torch import dtensor_layouts

        layout = distribution_api.TensorLayout(("model", None), self.mesh)
        batch = torch.arange(8.0).reshape(4, 2)
        for given in (layout, dtensor_layouts.backend_layout(layout)):
            value = batch_distribution.distribute_global_batch(batch, given)
            self.assertIsInstance(value, DTensor)
            self.assertEqual(tuple(value.shape), (4, 2))
            self.assertAllClose(value.full_tensor(), batch)

    def test_distribute_data_keeps_the_batch_structure(self):
        from keras.src import tree

        distribution = distribution_api.DataParallel(devices=["cpu:0"])
        x = np.arange(8.0, dtype="float32").reshape(4, 2)
        y = torch.arange(4)
        batches = (
            # A step's batch: a list of one `(x, y, sample_weight)`.
            [(x, y, None)],
            ({"a": x, "b": [y, 3.0]}, (y,)),
        )
        for data in batches:
            result = distribution_lib.distribute_data(data, distribution)
            self.assertEqual(
                tree.map_structure(type, result),
                tree.map_structure(
                    lambda v: DTensor if hasattr(v, "shape") else type(v),
                    data,
                ),
            )
            for value, given in zip(tree.flatten(result), tree.flatten(data)):
                if isinstance(value, DTensor):
                    self.assertEqual(tuple(value.placements), (Shard(0),))
                    np.testing.assert_array_equal(
                        value.full_tensor().numpy(), np.asarray(given)
                    )
                else:
                    self.assertIs(value, given)

    def test_distribute_tensor_skips_symbolic_and_none(self):
        layout = distribution_api.TensorLayout((None,), self.mesh)
        symbolic = backend.KerasTensor((2,))
        result = distribution_lib.distribute_tensor((symbolic, None), layout)
        self.assertIs(result[0], symbolic)
        self.assertIsNone(result[1])
        self.assertIs(
            distribution_lib.distribute_tensor(symbolic, None), symbolic
        )

    def test_functional_model_with_tuple_output_layout(self):
        class Pair(layers.Layer):
            def call(self, x):
                return x, x * 2.0

        layout_map = distribution_api.LayoutMap(self.mesh)
        layout_map["pair/output"] = ("model", None)
        distribution_api.set_distribution(
            distribution_api.ModelParallel(layout_map=layout_map)
        )
        inputs = layers.Input((4,))
        first, second = Pair(name="pair")(inputs)
        model = models.Model(inputs, first + second)
        self.assertEqual(model.output_shape, (None, 4))

    def test_output_layout_rank_mismatch_is_clear(self):
        layout = distribution_api.TensorLayout(("model",), self.mesh)
        with self.assertRaisesRegex(ValueError, "has rank 2"):
            distribution_lib.distribute_tensor(torch.ones(2, 2), layout)

    def test_distribute_tensor_takes_numpy_arrays(self):
        layout = distribution_api.TensorLayout((None, "model"), self.mesh)
        value = np.arange(6, dtype="float32").reshape(2, 3)
        result = distribution_lib.distribute_tensor(value, layout)
        self.assertIsInstance(result, DTensor)
        self.assertEqual(tuple(result.shape), (2, 3))
        self.assertAllClose(result.full_tensor().numpy(), value)

    def test_master_forms_of_layouts_and_inputs(self):
        """Upstream master's torch module accepts these; so does this one."""
        self.assertIsNone(distribution_lib._to_backend_layout(None))
        layout = distribution_api.TensorLayout(("model", None), self.mesh)
        variable = backend.Variable(np.ones((2, 2)), dtype="float32")
        result = distribution_lib.distribute_tensor(variable, layout)
        self.assertIsInstance(result, DTensor)
        self.assertEqual(tuple(result.placements), (Shard(0),))
        self.assertAllClose(
            result.full_tensor().detach().numpy(), np.ones((2, 2))
        )
        part = np.arange(4, dtype="float32").reshape(2, 2)
        plain = distribution_lib.distribute_data_input(part, None)
        self.assertIsInstance(plain, torch.Tensor)
        self.assertNotIsInstance(plain, DTensor)
        self.assertAllClose(plain.numpy(), part)
        batch = distribution_lib.distribute_data_input(part, layout)
        self.assertIsInstance(batch, DTensor)
        self.assertIs(
            distribution_lib.distribute_data_input(batch, layout), batch
        )

    def test_model_built_before_the_distribution_is_named(self):
        model = models.Sequential(
            [layers.Input((3,)), layers.Dense(2, name="early")]
        )
        distribution_api.set_distribution(
            distribution_api.DataParallel(devices=["cpu:0"])
        )
        for call in (
            lambda: model.predict(np.ones((2, 3)), verbose=0),
            lambda: model(np.ones((2, 3))),
        ):
            with self.assertRaisesRegex(
                ValueError,
                r"'sequential.*/early/kernel' with shape \(3, 2\).*created "
                r"before the distribution DataParallel.*Build the model",
            ):
                call()

    def test_size_one_axes_split_nothing(self):
        """A model on a (1, 1) mesh with sharded layouts trains as one
        without a distribution: size-1 axes hold whole dimensions."""
        x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
        y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")

        def train():
            rng_utils.set_random_seed(3)
            model = models.Sequential(
                [
                    layers.Input((4,)),
                    layers.Dense(4, activation="relu", name="a"),
                    layers.Dense(1, activation="sigmoid", name="b"),
                ]
            )
            model.compile(
                "sgd",
                "binary_crossentropy",
                metrics=["binary_accuracy", "true_positives"],
            )
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
            return history.history, model.evaluate(x, y, verbose=0)

        expected = train()
        mesh = distribution_api.DeviceMesh(
            (1, 1), ("batch", "model"), ["cpu:0"]
        )
        layout_map = distribution_api.LayoutMap(mesh)
        layout_map[".*a/kernel"] = (None, "model")
        layout_map[".*b/kernel"] = ("model", None)
        layout_map[".*b/output"] = ("batch", "model")
        distribution_api.set_distribution(
            distribution_api.ModelParallel(layout_map=layout_map)
        )
        history, evaluation = train()
        self.assertEqual(history.keys(), expected[0].keys())
        for key in history:
            self.assertAllClose(history[key], expected[0][key], rtol=1e-6)
        self.assertAllClose(evaluation, expected[1], rtol=1e-6)

    def test_constants_a_build_makes_are_replicated(self):
        """`Normalization(mean=..., variance=...)` makes its statistics
        when it is built; under a distribution they are replicated
        DTensors, which its distributed inputs meet as one."""
        x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")

        def build_and_predict():
            rng_utils.set_random_seed(3)
            inputs = layers.Input((3,))
            normalize = layers.Normalization(
                mean=[0.5, -1.0, 2.0], variance=[4.0, 1.0, 0.25]
            )
            outputs = layers.Dense(2, name="dense")(normalize(inputs))
            model = models.Model(inputs, outputs)
            return normalize, model, model.predict(x, verbose=0)

        plain_normalize, _, expected = build_and_predict()
        self.assertNotIsInstance(plain_normalize.mean, DTensor)
        mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        layout_map = distribution_api.LayoutMap(mesh)
        layout_map[".*dense/kernel"] = (None, "batch")
        distribution_api.set_distribution(
            distribution_api.ModelParallel(layout_map=layout_map)
        )
        normalize, model, predicted = build_and_predict()
        for statistic in (normalize.mean, normalize.variance):
            self.assertIsInstance(statistic, DTensor)
            self.assertEqual(tuple(statistic.placements), (Replicate(),))
        # Variables made in a build are made as outside it.
        kernel = model.get_layer("dense").kernel.value
        self.assertIsInstance(kernel, torch.nn.Parameter)
        self.assertEqual(tuple(kernel.placements), (Shard(1),))
        self.assertAllClose(predicted, expected, atol=1e-6)

    def test_collectives_single_process(self):
        value = np.array([1.0, 2.0], dtype="float32")
        self.assertAllClose(distribution_lib.all_reduce(value), value)
        self.assertAllClose(distribution_lib.all_gather(value), value)
        with self.assertRaisesRegex(ValueError, "Unsupported reduction"):
            distribution_lib.all_reduce(np.ones(2), op="prod")
