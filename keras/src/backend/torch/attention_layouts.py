"""Attention inputs laid out so that attention on local shards is exact.

A later keras's torch `dot_product_attention` (keras-nightly; keras
3.15.1 computes attention on the DTensors) computes DTensor inputs on
their local shards and wraps the result in the query's placements. That
is exact only where query, key, value and mask are split alike along
batch or heads. The layouts of a distribution need not be (a query
partial over an axis that split its contracting dimension, keys split on
another): `lay_out_attention_inputs` redistributes them so that they
are, and `keras_dtensor._nightly_edits` calls it before upstream's
function.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard


def attention_placements(query, mask_shape):
    """The placements that make attention on local shards exact.

    Per mesh axis: where `query` (batch, seq, heads, head_dim) is split
    along its batch or heads dimension, query, key and value are split
    there alike, and a mask of `mask_shape` (broadcast from the right to
    (batch, heads, seq, seq)) along the same dimension where it is not of
    size 1; anything else (a sequence split, a partial sum) is
    replicated.

    Returns:
        A tuple of the query, key and value placements and the mask's.
    """
    qkv, masks = [], []
    for placement in query.placements:
        if type(placement) is not Shard or placement.dim not in (0, 2):
            qkv.append(Replicate())
            masks.append(Replicate())
            continue
        qkv.append(Shard(placement.dim))
        mask_dim = None
        if mask_shape is not None:
            mask_dim = (0 if placement.dim == 0 else 1) - 4 + len(mask_shape)
        if mask_dim is None or mask_dim < 0 or mask_shape[mask_dim] == 1:
            masks.append(Replicate())
        else:
            masks.append(Shard(mask_dim))
    return tuple(qkv), tuple(masks)


def lay_out_attention_inputs(query, key, value, masks):
    """Query, key, value and masks (mask or bias, or None) laid out by
    `attention_placements`, key and value repeated to the query's heads
    (grouped-query attention) where the heads are split."""

    mesh = query.device_mesh
    shapes = [None if m is None else tuple(m.shape) for m in masks]
    mask_shape = next((shape for shape in shapes if shape is not None), None)
    qkv, mask_placements = attention_placements(query, mask_shape)
    heads_split = any(getattr(p, "dim", None) == 2 for p in qkv)
    if heads_split and key.shape[2] != query.shape[2]:
        groups = query.shape[2] // key.shape[2]
        key = torch.repeat_interleave(key, groups, dim=2)
        value = torch.repeat_interleave(value, groups, dim=2)
    query, key, value = (t.redistribute(mesh, qkv) for t in (query, key, value))
    laid_out = []
    for mask in masks:
        if mask is not None and not isinstance(mask, DTensor):
            mask = DTensor.from_local(
                torch.as_tensor(mask), mesh, [Replicate()] * mesh.ndim
            )
        if mask is not None:
            mask = mask.redistribute(mesh, mask_placements)
        laid_out.append(mask)
    return query, key, value, laid_out
