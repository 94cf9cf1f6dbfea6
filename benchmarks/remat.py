"""Measures activation recomputation (`remat_layers`) per rank.

Run under torchrun, from the repository root:

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 benchmarks/remat.py

A stack of transformer blocks (each block one Keras layer, `b{i}`, with
pre-norm attention written with `keras.ops` and a GELU MLP) is trained in
each mode (`dp`: DataParallel, `tp`: tensor parallel on a (1, N) mesh by
`tensor_parallel_layouts`, `fsdp`: fully sharded by
`fully_sharded_layouts`; `single`: no distribution, each process on its
own, Keras's remat as upstream runs it) twice: as it is, and with every
block recomputed in backward (`kd.remat_layers(model, r"b\\d+")`). For
each, per rank:

- peak activation memory of one training step (the third): on CPU, torch's
  `MemTracker` peak, less the parameters, gradients (those waiting in the
  distribution's gradient buckets included), optimizer state and buffers
  live at that peak (what is left is the activations and the
  temporaries of forward and backward); on GPU,
  `torch.cuda.max_memory_allocated` during the step less the memory
  allocated before it (parameters, optimizer state);
- on CPU with glibc, the bytes in use by `malloc` (`mallinfo2`) when
  forward is done (as the loss is computed), above the step's start:
  what forward keeps for backward, counted by the allocator rather than
  by `MemTracker`'s categories (which count the gathered values of fully
  sharded local calls as parameters still alive after they were
  freed);
- the median step time (`train_on_batch`), both variants interleaved.

Both variants start from the same weights; their first losses are
compared. Results: a markdown table on stdout (rank 0) and
`--out/<tag>.json`.
"""

import argparse
import contextlib
import ctypes
import gc
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import measure  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.distributed._tools.mem_tracker import _MemRefType  # noqa: E402

import keras  # noqa: E402
import keras_dtensor as kd  # noqa: E402
from keras import ops  # noqa: E402
from keras.src.backend.torch import gradient_bucket  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("dp", "tp", "fsdp")
ALL_MODES = ("single",) + MODES
PATTERN = r"b\d+"
PLAN = {r"b\d+/(q|k|v|up)": "column", r"b\d+/(o|down)": "row"}
# Memory categories of `MemTracker` that are model state, not activations.
STATE = ("PARAM", "GRAD", "OPT", "BUFFER")


class Block(keras.layers.Layer):
    """Pre-norm transformer block: `x + attention(ln(x))`, `x + mlp(ln(x))`."""

    def __init__(self, hidden, heads, ffn, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.heads = hidden, heads
        dense = keras.layers.Dense
        self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln1")
        self.q, self.k, self.v, self.o = (
            dense(hidden, name=name) for name in ("q", "k", "v", "o")
        )
        self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln2")
        self.up = dense(ffn, activation="gelu", name="up")
        self.down = dense(hidden, name="down")

    def split(self, x):
        """`(batch, seq, hidden)` -> `(batch, heads, seq, head_dim)`."""
        seq = x.shape[1]
        x = ops.reshape(x, (-1, seq, self.heads, self.hidden // self.heads))
        return ops.transpose(x, (0, 2, 1, 3))

    def call(self, x):
        seq = x.shape[1]
        y = self.ln1(x)
        q, k, v = (
            self.split(self.q(y)),
            self.split(self.k(y)),
            self.split(self.v(y)),
        )
        scale = 1.0 / (self.hidden // self.heads) ** 0.5
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * scale
        out = ops.matmul(ops.softmax(scores, axis=-1), v)
        out = ops.reshape(
            ops.transpose(out, (0, 2, 1, 3)), (-1, seq, self.hidden)
        )
        x = x + self.o(out)
        return x + self.down(self.up(self.ln2(x)))


def build_model(args):
    """The block stack with a per-token classifier."""
    inputs = keras.Input((args.seq, args.hidden), name="features")
    x = inputs
    for i in range(args.layers):
        x = Block(args.hidden, args.heads, 4 * args.hidden, name=f"b{i}")(x)
    outputs = keras.layers.Dense(args.vocab, name="head")(x)
    return keras.Model(inputs, outputs, name="blocks")


def compile_model(model):
    """Compiles with SGD (momentum 0.9) and a token cross-entropy."""
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def make_model(mode, args, use_remat):
    """Builds the model under `mode`'s distribution, weights from a seed."""
    keras.utils.set_random_seed(args.seed)
    devices = keras.distribution.list_devices()
    world = len(devices)
    if mode == "single":
        model = build_model(args)
    elif mode == "dp":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
        model = build_model(args)
    else:
        shape, axes = ((1, world), ("batch", "model"))
        if mode == "fsdp":
            shape, axes = (world,), ("batch",)
        mesh = keras.distribution.DeviceMesh(shape, axes, devices)
        with keras.StatelessScope():
            model = build_model(args)
            if mode == "tp":
                styles = {"column": kd.column_parallel, "row": kd.row_parallel}
                plan = {k: styles[s]("model") for k, s in PLAN.items()}
                layout_map = kd.tensor_parallel_layouts(model, mesh, plan)
            else:
                layout_map = kd.fully_sharded_layouts(
                    model, mesh, "batch", min_size=1024
                )
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(
                    layout_map=layout_map, batch_dim_name="batch"
                )
            )
    compile_model(model)
    if use_remat:
        kd.remat_layers(model, PATTERN)
    return model


def make_batch(args):
    """A global batch, the same on every process."""
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(args.batch, args.seq, args.hidden)).astype("float32")
    y = rng.integers(0, args.vocab, size=(args.batch, args.seq))
    return x, y.astype("int32")


def activation_bytes(step, model):
    """Peak bytes of one step that are not model state, on this rank."""
    if torch.cuda.is_available():
        return measure.cuda_step_peak_bytes(step)
    # Garbage of earlier steps (reference cycles) would count as this
    # step's peak whenever the collector has not run yet.
    gc.collect()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, _bucket_gradients_counted(tracker):
        step()
    peak = {}
    for categories in tracker.get_tracker_snapshot("peak").values():
        for category, nbytes in categories.items():
            name = str(category).rsplit(".", 1)[-1]
            peak[name] = peak.get(name, 0) + nbytes
    return peak["Total"] - sum(peak.get(name, 0) for name in STATE)


@contextlib.contextmanager
def _bucket_gradients_counted(tracker):
    """Counts the gradients that the gradient buckets hold as gradients.

    A local call's gradients wait in their bucket, then in its flattened
    buffer, before they reach `.grad`; `MemTracker` would otherwise count
    them as temporaries (DDP's own buckets hold gradients the same way).
    """

    def label(tensor):
        tracker._update_and_maybe_create_winfos(tensor, _MemRefType.GRAD)

    add, launch = gradient_bucket.Bucket.add, gradient_bucket.Bucket.launch

    def counted_add(bucket, parameter, local):
        add(bucket, parameter, local)
        label(bucket.entries[bucket.index[id(parameter)]][1])

    def counted_launch(bucket):
        launch(bucket)
        label(bucket.flat)

    gradient_bucket.Bucket.add = counted_add
    gradient_bucket.Bucket.launch = counted_launch
    try:
        yield
    finally:
        gradient_bucket.Bucket.add = add
        gradient_bucket.Bucket.launch = launch


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _bytes_in_use_reader():
    """A function returning glibc's bytes in use, or None without glibc."""
    if torch.cuda.is_available():
        return None
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use():
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def bytes_after_forward(step, model):
    """Bytes in use by `malloc` when `step`'s forward is done, above its
    start (None without glibc)."""
    in_use = _bytes_in_use_reader()
    if in_use is None:
        return None
    # The step's `zero_grad` drops the previous gradients: drop them first.
    for variable in model.trainable_variables:
        variable.value.grad = None
    gc.collect()
    start = in_use()
    seen = []
    upstream = model.compute_loss

    def compute_loss(*args, **kwargs):
        seen.append(in_use())
        return upstream(*args, **kwargs)

    model.compute_loss = compute_loss
    try:
        step()
    finally:
        del model.compute_loss
    return seen[0] - start


def measure_mode(mode, args, x, y):
    """Memory and step times of `mode` without and with remat."""
    steps, result = {}, {}
    for use_remat in (False, True):
        name = "remat" if use_remat else "plain"
        model = make_model(mode, args, use_remat)
        scope = keras.distribution.distribution()
        scope = contextlib.nullcontext if scope is None else scope.scope

        def step(model=model, scope=scope):
            with scope():
                return float(model.train_on_batch(x, y))

        result[f"{name}_first_loss"] = step()
        # A steady step: the second call of a layer may make one-time
        # allocations (local layer calls start on the second step).
        step()
        result[f"{name}_activation_bytes"] = int(
            max(measure.slowest_rank([float(activation_bytes(step, model))]))
        )
        kept = bytes_after_forward(step, model)
        result[f"{name}_bytes_after_forward"] = (
            None
            if kept is None
            else int(max(measure.slowest_rank([float(kept)])))
        )
        steps[name] = step
        keras.distribution.set_distribution(None)
    times = measure.time_steps(steps, args.steps)
    for name, values in times.items():
        result[f"{name}_ms"] = measure.median_ms(values)
    result["memory_ratio"] = (
        result["remat_activation_bytes"] / result["plain_activation_bytes"]
    )
    result["time_ratio"] = result["remat_ms"] / result["plain_ms"]
    return result


def table(results):
    """The results as a markdown table."""
    lines = [
        "| mode | activation MiB plain / remat | saved | "
        "in use after forward MiB plain / remat | "
        "ms plain / remat | time ratio | first loss equal |",
        "|---|---|---|---|---|---|---|",
    ]
    mib = 1024.0**2
    for mode, r in results.items():
        if r["plain_bytes_after_forward"] is None:
            kept = "—"
        else:
            kept = (
                f"{r['plain_bytes_after_forward'] / mib:.2f} / "
                f"{r['remat_bytes_after_forward'] / mib:.2f}"
            )
        lines.append(
            f"| {mode} | {r['plain_activation_bytes'] / mib:.2f} / "
            f"{r['remat_activation_bytes'] / mib:.2f} | "
            f"{1 - r['memory_ratio']:.0%} | {kept} | {r['plain_ms']:.1f} / "
            f"{r['remat_ms']:.1f} | {r['time_ratio']:.2f} | "
            f"{r['plain_first_loss'] == r['remat_first_loss']} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"Comma-separated, of {', '.join(ALL_MODES)}.",
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="Timed steps.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--tag", default=None)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    keras.distribution.initialize()
    world = dist.get_world_size() if dist.is_initialized() else 1
    x, y = make_batch(args)
    results = {}
    for mode in args.modes.split(","):
        if mode not in ALL_MODES:
            raise ValueError(f"Unknown mode {mode!r}; one of {ALL_MODES}.")
        results[mode] = measure_mode(mode, args, x, y)
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = table(results)
        print(text)
        tag = args.tag or f"n{world}_remat"
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
            json.dump(
                {
                    "config": vars(args),
                    "world": world,
                    "load_average": list(os.getloadavg()),
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "results": results,
                },
                f,
                indent=2,
            )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
