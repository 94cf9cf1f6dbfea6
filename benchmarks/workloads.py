"""Workload sizes, synthetic batches and the layout-level theory.

Everything here is framework-neutral: the Keras models
(`keras_models.py`) and the native PyTorch models (`torch_models.py`) are
built from the same `Config`, trained on the same batches, and judged
against the same theoretical minima.
"""

import dataclasses
import math
import re

import numpy as np

WORKLOADS = ("mlp", "transformer", "llama")
MODES = ("single", "dp", "tp", "2d", "fsdp")

# Parameters that the Megatron plan shards over the tensor-parallel axis:
# the kernels and biases of the column-parallel layers, the kernels of the
# row-parallel ones (as `ColwiseParallel` and `RowwiseParallel` do).
TENSOR_PARALLEL_SHARDED = (
    r"b\d+_(q|k|v|up|gate)/(kernel|bias)|b\d+_(o|down)/kernel"
)

# DDP's default bucket size: gradients up to this many bytes are reduced
# with one collective.
BUCKET_BYTES = 25 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes shared by every workload.

    Attributes:
        hidden: model width.
        layers: number of blocks.
        batch: global batch size (samples per step, all processes).
        seq: sequence length (transformer and llama).
        heads: attention heads (transformer and llama).
        vocab: vocabulary size (llama) and number of classes.
        ffn_multiple: width of the MLP's inner layer, in units of `hidden`.
        optimizer: `"sgd"` (momentum 0.9) or `"adamw"`.
        learning_rate: optimizer learning rate.
    """

    hidden: int = 128
    layers: int = 2
    batch: int = 16
    seq: int = 32
    heads: int = 4
    vocab: int = 256
    ffn_multiple: int = 4
    optimizer: str = "sgd"
    learning_rate: float = 0.01

    @property
    def ffn(self):
        """Width of the inner MLP layer."""
        return self.hidden * self.ffn_multiple

    @property
    def head_dim(self):
        """Width of one attention head."""
        return self.hidden // self.heads


def make_batch(workload, config, seed=0):
    """Returns one global batch `(x, y)` as numpy arrays.

    Every process builds the same batch; data-parallel modes then keep
    their own slice of it.

    Args:
        workload: one of `WORKLOADS`.
        config: a `Config`.
        seed: random seed for the batch.
    """
    rng = np.random.default_rng(seed)
    b, s, h, v = config.batch, config.seq, config.hidden, config.vocab
    if workload == "mlp":
        x = rng.standard_normal((b, h), dtype=np.float32)
        y = rng.integers(0, v, size=(b,)).astype("int64")
    elif workload == "transformer":
        x = rng.standard_normal((b, s, h), dtype=np.float32)
        y = rng.integers(0, v, size=(b, s)).astype("int64")
    elif workload == "llama":
        x = rng.integers(0, v, size=(b, s)).astype("int32")
        y = rng.integers(0, v, size=(b, s)).astype("int64")
    else:
        raise ValueError(f"Unknown workload {workload!r}.")
    return x, y


def tensor_parallel_blocks(workload, config):
    """Number of Megatron blocks (colwise layers, then rowwise layers).

    Each one needs one all-reduce in forward (of the rowwise layers'
    partial sums) and one in backward (of the gradient of the colwise
    layers' shared input), except that the MLP's first block reads the
    data, whose gradient nobody needs.
    """
    if workload == "mlp":
        return config.layers
    return 2 * config.layers  # attention block + MLP block per layer


def gradient_buckets(grad_bytes):
    """Collectives needed to reduce `grad_bytes` of gradients, bucketed."""
    return max(1, math.ceil(grad_bytes / BUCKET_BYTES))


def mesh_shape(mode, world):
    """`(data-parallel size, tensor-parallel size)` of a mode's mesh."""
    if mode == "single":
        return (1, 1)
    if mode in ("dp", "fsdp"):
        return (world, 1)
    if mode == "tp":
        return (1, world)
    if mode == "2d":
        # One process runs it on a (1, 1) mesh: size-1 axes split nothing.
        if world > 1 and world % 2:
            raise ValueError(f"Mode {mode!r} needs an even number of ranks.")
        return (min(world, 2), world // min(world, 2))
    raise ValueError(f"Unknown mode {mode!r}.")


def minimum_collectives(workload, config, mode, grad_bytes, world):
    """The fewest collectives one training step needs for a layout.

    Args:
        workload: one of `WORKLOADS`.
        config: a `Config`.
        mode: one of `MODES`.
        grad_bytes: bytes of gradients on one process that need a
            data-parallel reduction.
        world: number of processes.

    Returns:
        A dict with the `forward` count (everything outside backward:
        forward, loss logging, optimizer), the `total`, and a `note`
        saying what they consist of.
    """
    data, model = mesh_shape(mode, world)
    forward, total, notes = 0, 0, []
    if model > 1:
        blocks = tensor_parallel_blocks(workload, config)
        backward = blocks - 1 if workload == "mlp" else blocks
        forward += blocks
        total += blocks + backward
        notes.append(f"TP: {blocks} fwd + {backward} bwd all-reduce")
    if data > 1 and mode == "fsdp":
        units = config.layers + 1  # one per block, one for the rest
        forward += units + 1
        total += 3 * units - 1 + 1
        notes.append(
            f"FSDP: {units} units x (all-gather fwd, all-gather bwd, "
            "reduce-scatter), the root not re-gathered"
        )
        notes.append("1 global loss")
    elif data > 1:
        # The global loss needs no collective of its own: it can ride in
        # the last gradient bucket, read after backward.
        buckets = gradient_buckets(grad_bytes)
        total += buckets
        notes.append(
            f"DP: {buckets} bucketed gradient all-reduce, the global loss "
            "in the last"
        )
    if not notes:
        notes.append("no communication")
    return {"forward": forward, "total": total, "note": "; ".join(notes)}


def memory_limit_bytes(mode, world, full_sizes, slots):
    """The per-rank bytes a mode needs at least, by the mode's definition.

    Parameters, gradients and `slots` optimizer states per parameter, each
    as large as its parameter: `single` and `dp` replicate everything;
    `tp` and `2d` divide the parameters of the Megatron plan
    (`TENSOR_PARALLEL_SHARDED`) by the tensor-parallel size and replicate
    the rest; `fsdp` divides everything by the number of processes.
    Computed from the full sizes alone, not from any layout that a run
    produced.

    Args:
        mode: one of `MODES`.
        world: number of processes.
        full_sizes: `{parameter path: bytes of its full value}`.
        slots: optimizer state tensors per parameter.
    """
    data, model = mesh_shape(mode, world)
    per_copy = 0.0
    for path, size in full_sizes.items():
        if mode == "fsdp":
            per_copy += size / (data * model)
        elif re.search(TENSOR_PARALLEL_SHARDED, path):
            per_copy += size / model
        else:
            per_copy += size
    return int(per_copy * (2 + slots))
