"""`_StridedShard` sizes under fake tensors equal the eager ones."""

from torch._subclasses.fake_tensor import FakeTensorMode

from keras.src import testing
from keras.src.backend.torch import strided_shard_sizes
from keras.src.backend.torch.torch_internals import StridedShard


def sizes():
    """Shard sizes of a strided split of 10 indices over 2, 3 and 4."""
    return [
        StridedShard(0, split_factor=split).local_shard_size_and_offset(
            10, chunks, rank
        )[0]
        for split in (2, 4)
        for chunks in (2, 3, 4)
        for rank in range(chunks)
    ]


class StridedShardSizesTest(testing.TestCase):
    def test_sizes_under_fake_tensors_equal_the_eager_ones(self):
        strided_shard_sizes.register()
        eager = sizes()
        with FakeTensorMode():
            faked = sizes()
        # Without `register`, torch 2.13 raises there
        # ("aten._local_scalar_dense.default").
        self.assertEqual(faked, eager)
        self.assertEqual(sum(eager[:2]), 10)
