"""`attention_layouts`: the placements that make attention on local
shards exact. Its use by keras-nightly's `dot_product_attention` is
`keras_dtensor/mount_test.py`'s."""

from keras.src.backend.torch import attention_layouts


def test_attention_placements_fit_local_shards():
    """Query, key and value keep batch and heads splits (the mask too,
    where it is not broadcast there); anything else is replicated."""
    import types

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import Partial

    from keras.src.backend.torch.torch_internals import StridedShard

    def placements(query_placements, mask_shape):
        query = types.SimpleNamespace(placements=query_placements)
        return attention_layouts.attention_placements(query, mask_shape)

    R = Replicate()
    assert placements((Shard(2), Partial()), (4, 1, 8, 8)) == (
        (Shard(2), R),
        (R, R),
    )
    assert placements((Shard(0), Shard(2)), (4, 4, 8, 8)) == (
        (Shard(0), Shard(2)),
        (Shard(0), Shard(1)),
    )
    # A sequence split, and a strided one, are replicated.
    assert placements((Shard(1),), (4, 1, 8, 8)) == ((R,), (R,))
    strided = StridedShard(2, split_factor=2)
    assert placements((strided,), None) == ((R,), (R,))
    # Masks broadcast from the right: (heads, seq, seq), and no mask.
    assert placements((Shard(0),), (4, 8, 8)) == ((Shard(0),), (R,))
    assert placements((Shard(2),), (4, 8, 8)) == ((Shard(2),), (Shard(0),))
    assert placements((Shard(2),), None) == ((Shard(2),), (R,))
