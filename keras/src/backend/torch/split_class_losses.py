"""Cross-entropy of logits split along their classes, never gathered.

Keras's `sparse_categorical_crossentropy` from logits calls torch's
`cross_entropy` with the classes moved to dimension 1. Under a layout
that splits the classes (keras-hub's tied embeddings split along the
vocabulary give logits split along it), DTensor computes `log_softmax`
only on whole rows: it all-gathers the logits, the step's largest
activation, and every process then computes the softmax over the whole
vocabulary.

`HANDLERS` computes it as Megatron's vocabulary-parallel cross-entropy
does, with DTensor operators on the split logits: the largest logit, the
sum of exponentials and the target's logit are each reduced across the
split (three all-reduces of one value per example and position), and
the backward pass computes each process's part of the gradient locally
(softmax minus the one-hot target, on its own classes). The values are
those of the gathered computation up to the order of the sum over
classes, as in a row-parallel layer.

Handled: class indices as targets (a DTensor on the logits' mesh, as a
step makes them), no class weights, no label smoothing, every
reduction, `ignore_index`. The logits must be split along dimension 1
with `Shard` (not a strided split) on some mesh axes, and hold no
partial sum; anything else goes to torch as it is.

Collectives: the three all-reduces, inside the step, on every process
alike; none in backward.
"""

import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

_SIGNATURE = inspect.signature(F.cross_entropy)


def _cross_entropy(mode, func, args, kwargs):
    """`F.cross_entropy` of class-split logits, without gathering them."""
    call = _SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    call = call.arguments
    if not _splits_classes(call):
        return func(*args, **kwargs)
    logits, target = call["input"], call["target"]
    with torch.no_grad():
        # Any shift gives the same loss; the largest logit keeps `exp`
        # finite, as in `log_softmax`.
        peak = _whole(logits.amax(dim=1, keepdim=True))
    shifted = logits - peak
    sum_exp = _whole(shifted.exp().sum(dim=1))
    valid = target != call["ignore_index"]
    picked = _whole(torch.where(_one_hot(logits, target), shifted, 0).sum(1))
    losses = torch.where(valid, sum_exp.log() - picked, 0)
    return _reduced(losses, valid, call)


def _splits_classes(call):
    """Whether the handler computes this call (see the module docstring)."""
    logits, target = call["input"], call["target"]
    if not isinstance(logits, DTensor) or logits.ndim < 2:
        return False
    if not isinstance(target, DTensor) or target.device_mesh != (
        logits.device_mesh
    ):
        return False
    if call["weight"] is not None or call["label_smoothing"] != 0.0:
        return False
    if call["size_average"] is not None or call["reduce"] is not None:
        return False
    if target.is_floating_point() or target.ndim != logits.ndim - 1:
        return False
    placements = logits.placements
    return any(p == Shard(1) for p in placements) and all(
        type(p) in (Shard, Replicate) for p in placements
    )


def _whole(value):
    """`value` with its partial sums (or extremes) reduced."""
    placements = [
        Replicate() if p.is_partial() else p for p in value.placements
    ]
    return value.redistribute(value.device_mesh, placements)


def _one_hot(logits, target):
    """Where `logits` (N, C, ...) holds each target's class: a boolean
    DTensor split as the logits are, made from a class index split along
    the same mesh axes (each process compares its own classes only)."""
    classes = torch.arange(logits.shape[1], device=target.device)
    split = [
        Shard(0) if p == Shard(1) else Replicate() for p in logits.placements
    ]
    classes = DTensor.from_local(
        classes, logits.device_mesh, [Replicate()] * len(split)
    ).redistribute(logits.device_mesh, split)
    classes = classes.reshape(1, -1, *(1,) * (logits.ndim - 2))
    return classes == target.unsqueeze(1)


def _reduced(losses, valid, call):
    """The per-example `losses` reduced as `reduction` asks."""
    reduction = call["reduction"]
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    # torch's mean counts only the targets that are not ignored.
    return losses.sum() / valid.sum()


# Torch function -> handler(mode, func, args, kwargs), for
# `created_tensors`'s table.
HANDLERS = {F.cross_entropy: _cross_entropy}
