"""The step mode's handlers for in-place writes, extreme reductions,
Python values, local layouts and class-split cross-entropy, on tensors
split over 2 processes.

Inside `replicate_created_tensors` on a ("batch",) mesh of every process,
each check runs an op on DTensors split over the processes and records
the whole result and its placements; `step_handlers_test.py` compares them
with the same op on the full tensors in plain torch.
"""

import torch
import torch.nn.functional as F
import worker_utils
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor
from worker_utils import record

import keras
from keras.src.backend.torch import created_tensors
from keras.src.backend.torch import torch_runtime


def full_values():
    """The full tensors every check starts from (the same on every rank)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(4, 3, 10, generator=generator),
        "rows": torch.arange(32, dtype=torch.float32).reshape(4, 8),
        "lengths": torch.tensor([5, 3, 7, 6]),
    }


def record_whole(key, value):
    record(f"{key}/placements", [str(p) for p in value.placements])
    record(f"{key}/values", value.full_tensor().tolist())


def split_inputs(mesh, full):
    """The DTensors the checks take, laid out outside the step's mode
    (inside it, tensors made from Python values are replicated)."""
    rows, lengths = full["rows"], full["lengths"]
    return {
        "split_rows": distribute_tensor(rows, mesh, [Shard(0)]),
        "split_columns": distribute_tensor(rows, mesh, [Shard(1)]),
        "zeros": [
            distribute_tensor(torch.zeros(4, 8), mesh, [Replicate()])
            for _ in range(3)
        ],
        "row_target": distribute_tensor(rows.clone(), mesh, [Shard(0)]),
        "values": distribute_tensor(
            torch.tensor([10.0, 20.0, 30.0, 40.0]), mesh, [Shard(0)]
        ),
        "index": (torch.arange(4), torch.tensor([5, 1, -1, 0])),
        "logits": distribute_tensor(full["logits"], mesh, [Shard(2)]),
        "lengths": distribute_tensor(lengths, mesh, [Shard(0)]),
    }


def in_place_writes(split):
    target = split["zeros"][0]
    target.copy_(split["split_columns"])
    record_whole("copy", target)
    target = split["zeros"][1]
    target[:, 2:4] = split["split_rows"][:, :2]
    record_whole("set_item", target)
    target = split["row_target"]
    target.index_put_(split["index"], split["values"])
    record_whole("index_put", target)
    record("index_put/local_rows", target.to_local().shape[0])
    target.index_put_(split["index"], split["values"], accumulate=True)
    record_whole("index_put_accumulate", target)
    cache_writes(split)


def cache_writes(split):
    """Keras's `slice_update` into a replicated cache, as keras-hub seeds
    its KV cache (a clone, then a slice assignment of a column-split
    value), then as it writes each token (a clone, then `index_put_` of
    the flattened column-split value at replicated indices): the clone
    takes the value's split, and neither write issues a collective."""
    group = split["split_columns"].device_mesh.get_group(0)
    before = torch_runtime.sequence_number(group)
    cache = torch.clone(split["zeros"][2])
    cache[0:4, 0:8] = split["split_columns"]
    record(
        "seeded_cache/collectives",
        torch_runtime.sequence_number(group) - before,
    )
    record_whole("seeded_cache", cache)
    before = torch_runtime.sequence_number(group)
    cache = cache.clone()
    rows, columns = torch.meshgrid(
        torch.arange(2) + 1, torch.arange(8), indexing="ij"
    )
    update = 100 + split["split_columns"][:2]
    cache.index_put_((rows.flatten(), columns.flatten()), update.flatten())
    record(
        "token_write/collectives", torch_runtime.sequence_number(group) - before
    )
    record_whole("token_write", cache)


def extreme_reductions(split):
    record_whole("argmax", torch.argmax(split["logits"], dim=-1))
    record_whole("min", torch.min(split["lengths"]))
    record_whole("amax", torch.amax(split["logits"], dim=-1))


def python_values(split):
    lengths = split["lengths"]
    record("int_of_min", int(torch.min(lengths)))
    record("item_of_sum", lengths.sum().item())
    record("bool_of_any", bool(torch.any(lengths > 6)))
    record("tolist", lengths.tolist())


def class_split_losses(logits, targets, group):
    """`cross_entropy` of `logits` split along their classes: each
    reduction, an ignored target, the logits' gradient, and the
    collectives issued (forward, backward); with class weights, torch's
    own path."""
    for reduction in ("none", "sum", "mean"):
        before = torch_runtime.sequence_number(group)
        loss = F.cross_entropy(
            logits, targets, reduction=reduction, ignore_index=2
        )
        record(
            f"ce/{reduction}/forward_collectives",
            torch_runtime.sequence_number(group) - before,
        )
        record_whole(f"ce/{reduction}", loss)
        before = torch_runtime.sequence_number(group)
        (gradient,) = torch.autograd.grad(loss.sum(), logits)
        record(
            f"ce/{reduction}/backward_collectives",
            torch_runtime.sequence_number(group) - before,
        )
        record_whole(f"ce/{reduction}/gradient", gradient)
    weights = torch.linspace(0.5, 1.5, 10)
    record_whole(
        "ce/weighted",
        F.cross_entropy(logits, targets, weight=weights, reduction="none"),
    )


def partial_values(mesh):
    """A partial mean and a partial sum (a MoE router's auxiliary loss and
    the training loss, which Keras sums with `ops.sum` of their stack),
    made outside the step's mode: means 2 and 4, sums 10 and 20."""
    rank = torch.distributed.get_rank()
    mean = DTensor.from_local(
        torch.tensor(2.0 + 2 * rank), mesh, [Partial("avg")]
    )
    total = DTensor.from_local(
        torch.tensor(10.0 * (rank + 1)), mesh, [Partial()]
    )
    return mean, total


def as_partial_sum(value):
    """DTensor's own move of a local tensor from `value`'s placements to a
    partial sum (what its dispatch asks; `DTensor.redistribute` keeps
    partial targets to itself)."""
    from torch.distributed.tensor import _redistribute

    spec = value._spec
    target = type(spec)(spec.mesh, (Partial(),), tensor_meta=spec.tensor_meta)
    return _redistribute.redistribute_local_tensor(
        value._local_tensor, spec, target
    )


def local_sum(local):
    """The sum of every process's `local` value."""
    local = local.clone()
    torch.distributed.all_reduce(local)
    return local


def head_split_attention(queries, keys, group):
    """Attention scores of queries split by heads and replicated keys (a
    KV cache in `generate()`): the scores, their placements and the
    collectives issued."""
    before = torch_runtime.sequence_number(group)
    scores = torch.einsum("btkgh,bskh->bkgts", queries, keys)
    return scores, torch_runtime.sequence_number(group) - before


def row_split_projection(x, kernel, group):
    """Keras-hub Llama's output projection under its own layout map: a
    replicated input (batch 2, 3 positions, 4 heads, 2) contracted with a
    kernel (4 heads, 2, 6) split along its heads. The output, the
    gradients of both and the collectives issued forward."""
    before = torch_runtime.sequence_number(group)
    out = torch.einsum("btnh,nhd->btd", x, kernel)
    collectives = torch_runtime.sequence_number(group) - before
    (out * torch.arange(6.0)).sum().backward()
    return out, collectives


def row_split_inputs(mesh=None):
    """`row_split_projection`'s inputs: plain, or the input replicated and
    the kernel split along its heads over the processes of `mesh`."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 4, 2, generator=generator)
    kernel = torch.randn(4, 2, 6, generator=generator)
    if mesh is not None:
        x = distribute_tensor(x, mesh, [Replicate()])
        kernel = distribute_tensor(kernel, mesh, [Shard(0)])
    return x.requires_grad_(), kernel.requires_grad_()


def attention_inputs():
    """Queries (batch 2, 1 position, 4 heads, group 1, 8) and keys (batch
    2, 6 positions, 4 heads, 8)."""
    generator = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, 1, 4, 1, 8, generator=generator),
        torch.randn(2, 6, 4, 8, generator=generator),
    )


def class_split_inputs():
    """Logits (batch 4, classes 10, positions 3) and their targets."""
    generator = torch.Generator().manual_seed(2)
    logits = 4 * torch.randn(4, 10, 3, generator=generator)
    targets = torch.randint(0, 10, (4, 3), generator=generator)
    targets[1, 2] = 2
    return logits, targets


def rotary_gradients(x, kernel, rotation, queries):
    """The gradients of Gemma's key path with one key/value head: the
    projection's `einsum`, the rotary embedding (`split`, `cat`), Gemma's
    interleaving (`stack`, `reshape`) and the attention scores' `einsum`.
    Backward views the `cat` of size-1-head gradients."""
    key = torch.einsum("btd,ndh->btnh", x, kernel)
    first, second = torch.split(key, 4, dim=-1)
    key = key * rotation + torch.cat([-second, first], dim=-1) * rotation
    key = torch.stack(torch.split(key, 4, dim=-1), dim=-1).reshape(key.shape)
    scores = torch.einsum("btkgh,bskh->bkgts", queries, key)
    return torch.autograd.grad(scores.sum(), (x, kernel))


def rotary_inputs(mesh=None):
    """`rotary_gradients`' inputs: plain, or with the batch split over the
    processes of `mesh`."""
    generator = torch.Generator().manual_seed(1)
    x, kernel, rotation, queries = (
        torch.randn(shape, generator=generator)
        for shape in ((4, 8, 32), (1, 32, 8), (1, 8, 1, 8), (4, 8, 1, 4, 8))
    )
    if mesh is not None:
        split, replicated = [Shard(0)], [Replicate()]
        x = distribute_tensor(x, mesh, split)
        kernel = distribute_tensor(kernel, mesh, replicated)
        rotation = distribute_tensor(rotation, mesh, replicated)
        queries = distribute_tensor(queries, mesh, split)
    return x.requires_grad_(), kernel.requires_grad_(), rotation, queries


def main():
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    keras_mesh = keras.distribution.DeviceMesh(
        (len(devices),), ("batch",), devices
    )
    mesh = keras_mesh.backend_mesh
    split = split_inputs(mesh, full_values())
    # DTensor's error outside a step (the torch gap `local_layouts` fills).
    worker_utils.record_error(
        "rotary/outside_error", lambda: rotary_gradients(*rotary_inputs(mesh))
    )
    rotary = rotary_inputs(mesh)
    x, kernel = row_split_inputs(mesh)
    logits, targets = class_split_inputs()
    logits = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    targets = distribute_tensor(targets, mesh, [Replicate()])
    queries, keys = attention_inputs()
    queries = distribute_tensor(queries, mesh, [Shard(2)])
    keys = distribute_tensor(keys, mesh, [Replicate()])
    # DTensor's own rule, outside a step, gathers the queries.
    record(
        "einsum/outside_collectives",
        head_split_attention(queries, keys, mesh.get_group(0))[1],
    )
    mean, total = partial_values(mesh)
    # Outside a step torch refuses to take a partial mean to a partial
    # sum, as DTensor's `stack` asked in Keras's sum of the two losses.
    worker_utils.record_error(
        "partials/outside_error", lambda: as_partial_sum(mean)
    )
    # DTensor's own cross-entropy, outside a step, gathers the logits.
    before = torch_runtime.sequence_number(mesh.get_group(0))
    F.cross_entropy(logits, targets, reduction="none")
    record(
        "ce/outside_collectives",
        torch_runtime.sequence_number(mesh.get_group(0)) - before,
    )
    with created_tensors.replicate_created_tensors(keras_mesh):
        in_place_writes(split)
        extreme_reductions(split)
        python_values(split)
        class_split_losses(logits, targets, mesh.get_group(0))
        scores, collectives = head_split_attention(
            queries, keys, mesh.get_group(0)
        )
        record_whole("einsum", scores)
        record("einsum/collectives", collectives)
        out, collectives = row_split_projection(x, kernel, mesh.get_group(0))
        record("row_split/placements", [str(p) for p in out.placements])
        record("row_split/collectives", collectives)
        record_whole("row_split/out", out.redistribute(mesh, [Replicate()]))
        record_whole("row_split/x_gradient", x.grad)
        record_whole("row_split/kernel_gradient", kernel.grad)
        local = as_partial_sum(mean)
        record("partials/as_sum", float(local))
        record("partials/as_sum_total", float(local_sum(local)))
        record_whole("partials", torch.stack([mean, total]).sum())
        x_gradient, kernel_gradient = rotary_gradients(*rotary)
    record_whole("rotary/x_gradient", x_gradient)
    record_whole("rotary/kernel_gradient", kernel_gradient)
    plain = rotary_gradients(*rotary_inputs())
    record("rotary/plain/x_gradient", plain[0].tolist())
    record("rotary/plain/kernel_gradient", plain[1].tolist())
    x, kernel = row_split_inputs()
    out, _ = row_split_projection(x, kernel, mesh.get_group(0))
    record("row_split/plain/out", out.tolist())
    record("row_split/plain/x_gradient", x.grad.tolist())
    record("row_split/plain/kernel_gradient", kernel.grad.tolist())
    plain_queries, plain_keys = attention_inputs()
    record(
        "einsum/plain",
        torch.einsum("btkgh,bskh->bkgts", plain_queries, plain_keys).tolist(),
    )
    logits, targets = class_split_inputs()
    logits.requires_grad_()
    for reduction in ("none", "sum", "mean"):
        loss = F.cross_entropy(
            logits, targets, reduction=reduction, ignore_index=2
        )
        (gradient,) = torch.autograd.grad(loss.sum(), logits)
        record(f"ce/plain/{reduction}", loss.tolist())
        record(f"ce/plain/{reduction}/gradient", gradient.tolist())
    weights = torch.linspace(0.5, 1.5, 10)
    record(
        "ce/plain/weighted",
        F.cross_entropy(
            logits, targets, weight=weights, reduction="none"
        ).tolist(),
    )
    worker_utils.report()


if __name__ == "__main__":
    main()
