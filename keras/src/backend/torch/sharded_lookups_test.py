"""Tests of `sharded_lookups`."""

import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras.src import testing
from keras.src.backend.torch import sharded_lookups


class LookupGradientTest(testing.TestCase):
    """Where a reduced lookup's gradient goes back to the lookup."""

    def test_gradient_placements(self):
        from keras.src.backend.torch.torch_internals import MaskPartial

        masked = MaskPartial(offset_shape=torch.Size([256, 32]), offset_dim=0)
        place = sharded_lookups._lookup_gradient_placement
        cases = [
            # A masked lookup takes its whole gradient, partial sum or not;
            # DTensor would ask torch 2.11 for a partial-to-masked move.
            (Partial(), masked, Replicate()),
            (Replicate(), masked, Replicate()),
            (Shard(0), masked, Replicate()),
            # So does a partial lookup (this module's masked lookup).
            (Partial(), Partial(), Replicate()),
            (Replicate(), Partial(), Replicate()),
            # Elsewhere, as DTensor's backward redistribution.
            (Shard(1), Shard(0), Shard(0)),
            (Partial(), Replicate(), Replicate()),
        ]
        for current, target, expected in cases:
            self.assertEqual(place(current, target), expected)
