"""Tests of Keras layouts as DTensor placements (no process group)."""

import numpy as np
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src import testing
from keras.src.backend.torch import dtensor_layouts
from keras.src.backend.torch.torch_internals import DTensorSpec
from keras.src.backend.torch.torch_internals import StridedShard
from keras.src.distribution import distribution_lib as distribution_api


def mesh_of(shape, axis_names):
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    return distribution_api.DeviceMesh(shape, axis_names, devices)


def layout_of(axes, mesh):
    return dtensor_layouts.DTensorLayout(None, None, tuple(axes), mesh)


class PlacementsTest(testing.TestCase):
    def test_one_axis(self):
        mesh = mesh_of((2, 4), ("batch", "model"))
        placements = dtensor_layouts.axes_to_placements((None, "model"), mesh)
        self.assertEqual(placements, (Replicate(), Shard(1)))
        placements = dtensor_layouts.axes_to_placements(
            ("batch", "model"), mesh
        )
        self.assertEqual(placements, (Shard(0), Shard(1)))
        placements = dtensor_layouts.axes_to_placements((None, None), mesh)
        self.assertEqual(placements, (Replicate(), Replicate()))

    def test_dimension_over_two_axes_in_mesh_order(self):
        mesh = mesh_of((2, 4), ("batch", "model"))
        placements = dtensor_layouts.axes_to_placements(
            (("batch", "model"), None), mesh
        )
        self.assertEqual(placements, (Shard(0), Shard(0)))

    def test_dimension_over_two_axes_against_mesh_order(self):
        mesh = mesh_of((2, 4), ("batch", "model"))
        placements = dtensor_layouts.axes_to_placements(
            (None, ("model", "batch")), mesh
        )
        # `model` is the major axis: `batch` splits within each model chunk.
        self.assertEqual(
            placements, (StridedShard(1, split_factor=4), Shard(1))
        )

    def test_three_axes(self):
        mesh = mesh_of((2, 3, 2), ("a", "b", "c"))
        placements = dtensor_layouts.axes_to_placements(
            (("c", "a", "b"),), mesh
        )
        self.assertEqual(
            placements,
            (
                StridedShard(0, split_factor=2),
                StridedShard(0, split_factor=2),
                Shard(0),
            ),
        )

    def test_unknown_axis(self):
        mesh = mesh_of((2,), ("model",))
        with self.assertRaisesRegex(ValueError, "'data' is not a mesh axis"):
            dtensor_layouts.axes_to_placements(("data", None), mesh)

    def test_axis_used_twice(self):
        mesh = mesh_of((2, 2), ("batch", "model"))
        with self.assertRaisesRegex(ValueError, "'model' shards both"):
            dtensor_layouts.axes_to_placements(("model", "model"), mesh)
        with self.assertRaisesRegex(ValueError, "'batch' shards both"):
            dtensor_layouts.axes_to_placements(
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
            dtensor_layouts.validate_layout(
                (4, 4), layout_of(("model",), mesh), path="dense/kernel"
            )
        message = str(context.exception)
        for part in (
            "'dense/kernel'",
            "(4, 4)",
            "('model',)",
            "DeviceMesh({'model': 2})",
        ):
            self.assertIn(part, message)
        self.assertIn("rank 2", message)

    def test_indivisible_names_the_axis(self):
        mesh = mesh_of((2, 3), ("batch", "model"))
        with self.assertRaises(ValueError) as context:
            dtensor_layouts.validate_layout(
                (4, 8), layout_of((None, "model"), mesh), path="d/kernel"
            )
        message = str(context.exception)
        for part in ("'d/kernel'", "(4, 8)", "dimension 1", "'model'", "3"):
            self.assertIn(part, message)

    def test_indivisible_over_two_axes(self):
        mesh = mesh_of((2, 3), ("batch", "model"))
        layout = layout_of((("batch", "model"), None), mesh)
        dtensor_layouts.validate_layout((12, 1), layout, path="ok")
        with self.assertRaisesRegex(ValueError, "'batch' x 'model'"):
            dtensor_layouts.validate_layout((8, 1), layout, path="bad")

    def test_uneven_allowed_for_data(self):
        mesh = mesh_of((2,), ("batch",))
        layout = layout_of(("batch", None), mesh)
        dtensor_layouts.validate_layout((5, 3), layout, require_divisible=False)
        with self.assertRaisesRegex(ValueError, "not divisible"):
            dtensor_layouts.validate_layout((5, 3), layout)


class AdditivePartialDimsTest(testing.TestCase):
    def test_sum_and_average_dims(self):
        mesh = mesh_of((1, 1), ("batch", "model"))
        cases = {
            (Partial("avg"), Replicate()): ((0,), (0,)),
            (Partial("sum"), Partial("avg")): ((0, 1), (1,)),
            (Replicate(), Partial()): ((1,), ()),
            (Replicate(), Replicate()): None,
            (Partial("max"), Replicate()): None,
            (Shard(0), Partial()): None,
        }
        for placements, expected in cases.items():
            spec = DTensorSpec(mesh.backend_mesh, placements)
            self.assertEqual(
                dtensor_layouts.additive_partial_dims(spec),
                expected,
                placements,
            )


class _MeshShape:
    """The parts of a torch mesh `replicated_on_unit_axes` reads."""

    def __init__(self, shape):
        self.shape = shape

    def size(self):
        return int(np.prod(self.shape))


class ReplicatedOnUnitAxesTest(testing.TestCase):
    def test_a_split_over_one_process_is_replicated(self):
        layout = dtensor_layouts.DTensorLayout(
            _MeshShape((1, 2)), (Shard(0), Shard(1)), (None, None), None
        )
        relaid = dtensor_layouts.replicated_on_unit_axes(layout)
        self.assertEqual(relaid.placements, (Replicate(), Shard(1)))
        self.assertIs(relaid.mesh, layout.mesh)

    def test_layouts_without_such_a_split_are_kept(self):
        for shape, placements in (
            ((2, 2), (Shard(0), Shard(1))),
            ((1, 2), (Replicate(), Shard(0))),
            # One process in all: nothing moves whatever the placements.
            ((1,), (Shard(0),)),
        ):
            layout = dtensor_layouts.DTensorLayout(
                _MeshShape(shape), placements, None, None
            )
            self.assertIs(
                dtensor_layouts.replicated_on_unit_axes(layout), layout
            )
