"""Single-process tests of the torch `distribution_lib`.

Meshes of any shape can be converted to placements in one process; only
building a torch mesh needs the processes to exist, so values on real
multi-process meshes are tested in `integration_tests/foundation_test.py`.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src import optimizers
from keras.src import testing
from keras.src.backend.torch import distribution_lib
from keras.src.distribution import distribution_lib as distribution_api
from keras.src.utils import rng_utils


def mesh_of(shape, axis_names):
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    return distribution_api.DeviceMesh(shape, axis_names, devices)


def layout_of(axes, mesh):
    return distribution_lib.DTensorLayout(None, None, tuple(axes), mesh)


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

    def test_local_rank_without_a_device_is_named(self):
        with mock.patch.object(torch.cuda, "device_count", return_value=1):
            with mock.patch.dict("os.environ", {"LOCAL_RANK": "1"}):
                with self.assertRaisesRegex(
                    ValueError,
                    r"LOCAL_RANK=1 \(rank 1\) has no CUDA device: 1 "
                    r"device\(s\) are visible.*--nproc_per_node=1",
                ):
                    distribution_lib._local_cuda_device(1)
            with mock.patch.dict("os.environ", {"LOCAL_RANK": "0"}):
                self.assertEqual(distribution_lib._local_cuda_device(1), 0)

    def test_to_backend_device(self):
        self.assertEqual(
            distribution_lib._to_backend_device("cpu:3"), torch.device("cpu")
        )
        with self.assertRaisesRegex(ValueError, "Device not found"):
            distribution_lib._to_backend_device("abc:1")


class PlacementsTest(testing.TestCase):
    def test_one_axis(self):
        mesh = mesh_of((2, 4), ("batch", "model"))
        placements = distribution_lib._axes_to_placements((None, "model"), mesh)
        self.assertEqual(placements, (Replicate(), Shard(1)))
        placements = distribution_lib._axes_to_placements(
            ("batch", "model"), mesh
        )
        self.assertEqual(placements, (Shard(0), Shard(1)))
        placements = distribution_lib._axes_to_placements((None, None), mesh)
        self.assertEqual(placements, (Replicate(), Replicate()))

    def test_dimension_over_two_axes_in_mesh_order(self):
        mesh = mesh_of((2, 4), ("batch", "model"))
        placements = distribution_lib._axes_to_placements(
            (("batch", "model"), None), mesh
        )
        self.assertEqual(placements, (Shard(0), Shard(0)))

    def test_dimension_over_two_axes_against_mesh_order(self):
        mesh = mesh_of((2, 4), ("batch", "model"))
        placements = distribution_lib._axes_to_placements(
            (None, ("model", "batch")), mesh
        )
        # `model` is the major axis: `batch` splits within each model chunk.
        self.assertEqual(
            placements, (_StridedShard(1, split_factor=4), Shard(1))
        )

    def test_three_axes(self):
        mesh = mesh_of((2, 3, 2), ("a", "b", "c"))
        placements = distribution_lib._axes_to_placements(
            (("c", "a", "b"),), mesh
        )
        self.assertEqual(
            placements,
            (
                _StridedShard(0, split_factor=2),
                _StridedShard(0, split_factor=2),
                Shard(0),
            ),
        )

    def test_unknown_axis(self):
        mesh = mesh_of((2,), ("model",))
        with self.assertRaisesRegex(ValueError, "'data' is not a mesh axis"):
            distribution_lib._axes_to_placements(("data", None), mesh)

    def test_axis_used_twice(self):
        mesh = mesh_of((2, 2), ("batch", "model"))
        with self.assertRaisesRegex(ValueError, "'model' shards both"):
            distribution_lib._axes_to_placements(("model", "model"), mesh)
        with self.assertRaisesRegex(ValueError, "'batch' shards both"):
            distribution_lib._axes_to_placements(
                (("batch", "model"), "batch"), mesh
            )

    def test_tensor_layout_accepts_multi_axis_entries(self):
        mesh = mesh_of((2, 2), ("batch", "model"))
        layout = distribution_api.TensorLayout((("batch", "model"), None), mesh)
        self.assertEqual(layout.axes, (("batch", "model"), None))
        with self.assertRaisesRegex(ValueError, "Invalid axis names"):
            distribution_api.TensorLayout((("batch", "nope"), None), mesh)


class ValidateLayoutTest(testing.TestCase):
    def test_rank_mismatch_names_everything(self):
        mesh = mesh_of((2,), ("model",))
        with self.assertRaises(ValueError) as context:
            distribution_lib.validate_layout(
                (4, 4), layout_of(("model",), mesh), path="dense/kernel"
            )
        message = str(context.exception)
        for part in ("'dense/kernel'", "(4, 4)", "('model',)", "shape=(2,)"):
            self.assertIn(part, message)
        self.assertIn("rank 2", message)

    def test_indivisible_names_the_axis(self):
        mesh = mesh_of((2, 3), ("batch", "model"))
        with self.assertRaises(ValueError) as context:
            distribution_lib.validate_layout(
                (4, 8), layout_of((None, "model"), mesh), path="d/kernel"
            )
        message = str(context.exception)
        for part in ("'d/kernel'", "(4, 8)", "dimension 1", "'model'", "3"):
            self.assertIn(part, message)

    def test_indivisible_over_two_axes(self):
        mesh = mesh_of((2, 3), ("batch", "model"))
        layout = layout_of((("batch", "model"), None), mesh)
        distribution_lib.validate_layout((12, 1), layout, path="ok")
        with self.assertRaisesRegex(ValueError, "'batch' x 'model'"):
            distribution_lib.validate_layout((8, 1), layout, path="bad")

    def test_uneven_allowed_for_data(self):
        mesh = mesh_of((2,), ("batch",))
        layout = layout_of(("batch", None), mesh)
        distribution_lib.validate_layout(
            (5, 3), layout, require_divisible=False
        )
        with self.assertRaisesRegex(ValueError, "not divisible"):
            distribution_lib.validate_layout((5, 3), layout)


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
        # As on JAX, a mesh axis of size 1 splits nothing.
        self.assertEqual(
            tuple(model.layers[0].kernel.value.placements), (Replicate(),)
        )
        self.assertIn("placements=(Replicate(),)", repr(model.weights[0]))
        optimizer = optimizers.Adam()
        optimizer.build(model.trainable_variables)
        self.assertEqual(
            tuple(optimizer.variables[2].value.placements), (Replicate(),)
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
        variable.assign(np.ones((2, 3)))
        self.assertIsInstance(variable.value, DTensor)
        self.assertAllClose(variable.numpy(), np.ones((2, 3)))
        self.assertAllClose(
            backend.convert_to_numpy([variable.value, variable.value]),
            np.ones((2, 2, 3)),
        )

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
        without a distribution: size-1 axes are replicated."""
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

    def test_collectives_single_process(self):
        value = np.array([1.0, 2.0], dtype="float32")
        self.assertAllClose(distribution_lib.all_reduce(value), value)
        self.assertAllClose(distribution_lib.all_gather(value), value)
        with self.assertRaisesRegex(ValueError, "Unsupported reduction"):
            distribution_lib.all_reduce(np.ones(2), op="prod")


class ReplicateCreatedTensorsTest(testing.TestCase):
    """Tensors made from Python values inside a step are replicated."""

    def setUp(self):
        super().setUp()
        self.mesh = distribution_api.DeviceMesh((1,), ("batch",), ["cpu:0"])
        self.backend_mesh = self.mesh.backend_mesh

    def test_factories_make_replicated_dtensors(self):
        with distribution_lib.replicate_created_tensors(self.mesh):
            positions = torch.arange(6)
            constants = torch.as_tensor(np.ones((2, 3), dtype="float32"))
            scalar = torch.tensor(2.0)
            broadcast = torch.broadcast_to(scalar, (2, 3))
            meta = torch.ones(3, device="meta")
        for value in (positions, constants, scalar, broadcast):
            self.assertIsInstance(value, DTensor)
            self.assertEqual(tuple(value.placements), (Replicate(),))
        self.assertAllClose(positions.to_local().numpy(), np.arange(6))
        # A scalar counts too, so what is derived from it alone (as
        # metrics broadcast a missing sample weight) is replicated.
        self.assertAllClose(broadcast.to_local().numpy(), np.full((2, 3), 2))
        # Meta tensors (shape inference) hold no values and stay plain.
        self.assertNotIsInstance(meta, DTensor)

    def test_tensors_from_tensors_stay_plain(self):
        plain = torch.ones(3)
        with distribution_lib.replicate_created_tensors(self.mesh):
            copied = torch.as_tensor(plain)
            doubled = plain * 2
        self.assertNotIsInstance(copied, DTensor)
        self.assertNotIsInstance(doubled, DTensor)

    def test_outside_the_context_nothing_changes(self):
        self.assertNotIsInstance(torch.arange(6), DTensor)

    def test_random_draws_use_the_given_generator(self):
        probabilities = torch.full((4, 6), 0.5)
        expected = torch.bernoulli(
            probabilities, generator=torch.Generator().manual_seed(5)
        )
        with distribution_lib.replicate_created_tensors(self.mesh):
            drawn = torch.bernoulli(
                torch.full((4, 6), 0.5),
                generator=torch.Generator().manual_seed(5),
            )
        self.assertIsInstance(drawn, DTensor)
        self.assertAllClose(drawn.to_local().numpy(), expected.numpy())

    def test_dropout_mask_equals_the_plain_one(self):
        x = torch.ones(8, 5)
        torch.manual_seed(3)
        expected = torch.nn.functional.dropout(x, p=0.4, training=True)
        inputs = DTensor.from_local(
            x, self.backend_mesh, [Shard(0)], run_check=False
        )
        torch.manual_seed(3)
        with distribution_lib.replicate_created_tensors(self.mesh):
            dropped = torch.nn.functional.dropout(inputs, p=0.4, training=True)
            kept = torch.nn.functional.dropout(inputs, p=0.4, training=False)
        self.assertAllClose(dropped.full_tensor().numpy(), expected.numpy())
        self.assertIs(kept, inputs)


@pytest.mark.parametrize(
    "addresses,num_processes",
    [("10.0.0.1:1234,10.0.0.2:2345,10.0.0.3:1", 2)],
)
def test_job_addresses_must_match_num_processes(addresses, num_processes):
    with pytest.raises(ValueError, match="has 3 jobs"):
        distribution_lib._init_process_group(addresses, num_processes, 0)
