"""Tests of `local_replays` on a one-process mesh (the multi-process case,
keras-hub's attention and decoder blocks generating on local shards:
`integration_tests/keras_hub_workflow_test.py`)."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial

from keras.src import layers
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import inference_local_calls
from keras.src.backend.torch import local_replays
from keras.src.backend.torch.batch_local_test import LocalCallTestCase


class _PartialSums(layers.Layer):
    """Returns its input as a partial sum (on DTensors), as a
    row-parallel layer's output is before its layer end."""

    def call(self, x):
        if not isinstance(x, DTensor):
            return x
        return DTensor.from_local(
            x.to_local(), x.device_mesh, [Partial()], run_check=False
        )


class _Block(layers.Layer):
    """A sublayer whose output is reduced where it ends, then a reshape
    by a size held as an attribute."""

    def __init__(self):
        super().__init__()
        self.inner = _PartialSums()
        self.rows = 4

    def call(self, x):
        return self.inner(x).reshape(self.rows, -1) + 1.0


class RecordTest(LocalCallTestCase):
    def test_a_reshape_noted_once_with_another_shape_is_translated(self):
        record = local_replays.Record()
        record.note_shape(((2, 6), (4, 3, 2)), (2, 3, 2))
        record.note_shape(((2, 6), (4, 3, 2)), (2, 3, 2))
        # Local already: nothing to translate.
        record.note_shape(((4, 6), (24,)), (24,))
        # Noted with two results: never translated.
        record.note_shape(((3, 4), (6, 4)), (3, 4))
        record.note_shape(((3, 4), (6, 4)), (6, 2))
        self.assertEqual(
            record.translations(), {((2, 6), (4, 3, 2)): (2, 3, 2)}
        )

    def test_a_first_call_notes_the_reshapes_of_its_dtensors(self):
        x = self.batch((4, 6))
        with created_tensors.replicate_created_tensors(self.mesh):
            with local_replays.recording() as record:
                x.reshape(4, 2, 3)
                torch.reshape(x, (24,))
                x.view(torch.int32)
            # Outside a recording, nothing is noted.
            x.reshape(6, 4)
        self.assertEqual(
            record.shapes,
            {((4, 6), (4, 2, 3)): (4, 2, 3), ((4, 6), (24,)): (24,)},
        )

    def test_a_replay_asks_for_the_noted_local_shapes(self):
        record = local_replays.Record()
        record.note_shape(((2, 6), (4, 3, 2)), (2, 3, 2))
        x = torch.arange(12.0).reshape(2, 6)
        replay = local_replays.Replay(local_replays.ReplayPlan(record))
        with local_replays.replaying(replay):
            shapes = [
                tuple(torch.reshape(x, (4, 3, 2)).shape),
                tuple(x.reshape((4, 3, 2)).shape),
                tuple(x.view(4, 3, 2).shape),
                tuple(x.reshape(3, 4).shape),
            ]
        self.assertEqual(shapes, [(2, 3, 2)] * 3 + [(3, 4)])
        with self.assertRaises(RuntimeError):
            x.reshape(4, 3, 2)

    def test_a_cut_noted_once_is_replayed(self):
        record = local_replays.Record()
        key = (torch.add, ((2, 3), (4, 3)))
        cut = local_replays.Cut(((0, 2, 2),))
        record.note_cut(key, 1, cut)
        record.note_cut(key, 1, cut)
        other = (torch.add, ((1, 3), (2, 3)))
        record.note_cut(other, 1, local_replays.Cut(((0, 0, 1),)))
        record.note_cut(other, 1, local_replays.Cut(((0, 1, 1),)))
        replay = local_replays.Replay(local_replays.ReplayPlan(record))
        self.assertEqual(replay.plan.cuts, {key: {1: cut}})
        shard = torch.zeros(2, 3)
        whole = torch.arange(12.0).reshape(4, 3)
        with local_replays.replaying(replay):
            # The replicated operand's rows 2 and 3, as DTensor cut it.
            total = torch.add(shard, whole)
            # Another call, or other shapes: as they are.
            product = torch.mul(torch.ones(4, 3), whole)
        self.assertTrue(torch.equal(total, whole[2:]))
        self.assertTrue(torch.equal(product, whole))
        with self.assertRaises(RuntimeError):
            torch.add(shard, whole)

    def test_a_share_divides_the_operand_and_keeps_its_gradient(self):
        # A replicated bias added to a partial sum over 2 processes: each
        # adds half, as DTensor partitions it; its gradient is the whole.
        record = local_replays.Record()
        key = (torch.add, ((2, 3), (3,)))
        record.note_cut(key, 1, local_replays.Cut((), share=2))
        replay = local_replays.Replay(local_replays.ReplayPlan(record))
        bias = torch.tensor([2.0, 4.0, 6.0], requires_grad=True)
        with local_replays.replaying(replay):
            total = torch.add(torch.zeros(2, 3), bias)
        self.assertTrue(torch.equal(total, torch.tensor([[1.0, 2, 3]] * 2)))
        total.sum().backward()
        self.assertTrue(torch.equal(bias.grad, torch.full((3,), 2.0)))

    def test_paused_recordings_note_nothing(self):
        with local_replays.recording() as record:
            with local_replays.paused():
                local_replays.layer_end(torch.ones(2), lambda value: value)
            local_replays.layer_end(torch.ones(2), lambda value: value)
        self.assertEqual(record.ends, 1)


class LayerEndReplayTest(LocalCallTestCase):
    def call(self, layer, x):
        with torch.no_grad():
            return self.call_in_step(layer, x)

    def test_a_block_that_reduces_and_reshapes_runs_locally(self):
        block = _Block()
        x = self.batch((2, 6))
        # Checked as batch-local (it is not: its sublayer's output is a
        # partial sum), then as an inference call on local shards.
        first = self.call(block, x)
        self.call(block, x)
        self.assertTrue(inference_local_calls.runs_locally(block))
        second = self.call(block, x)
        self.assertIsInstance(second, DTensor)
        self.assertEqual(second.placements, first.placements)
        self.assertTrue(torch.equal(second.full_tensor(), first.full_tensor()))
        self.assertTrue(
            torch.equal(first.full_tensor(), x.full_tensor().reshape(4, 3) + 1)
        )

    def test_reductions_are_replayed_at_their_layer_ends(self):
        mesh = self.mesh.backend_mesh
        group = mesh.get_group(0)
        record = local_replays.Record()
        record.note_end(())
        record.note_end(((1, mesh, (0,)),))
        record.note_end(())
        replay = local_replays.Replay(local_replays.ReplayPlan(record))
        counts = []
        with local_replays.replaying(replay):
            for _ in range(3):
                outputs = (torch.ones(2), torch.full((3,), 2.0))
                replayed = local_replays.layer_end(outputs, None)
                ends = local_replays.collectives_at_layer_ends()
                counts.append(ends.get(group, 0))
        # One all-reduce, of the second output, at the second layer end.
        self.assertEqual(counts[1] - counts[0], 1)
        self.assertEqual(counts[2], counts[1])
        self.assertEqual(replay.ends, 3)
        self.assertTrue(torch.equal(replayed[1], torch.full((3,), 2.0)))

    def test_a_replayed_reduction_passes_its_gradient_on(self):
        # As DTensor's `Partial` to `Replicate`: each partial sum's
        # gradient is the sum's (Megatron's `g`).
        mesh = self.mesh.backend_mesh
        record = local_replays.Record()
        record.note_end(((0, mesh, (0,)),))
        replay = local_replays.Replay(local_replays.ReplayPlan(record))
        partial = torch.arange(3.0, requires_grad=True)
        with local_replays.replaying(replay):
            (reduced,) = local_replays.layer_end((partial * 2.0,), None)
        self.assertIsNotNone(reduced.grad_fn)
        cotangent = torch.tensor([1.0, -2.0, 3.0])
        (reduced * cotangent).sum().backward()
        self.assertTrue(torch.equal(partial.grad, 2.0 * cotangent))
