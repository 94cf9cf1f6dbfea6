"""keras-hub causal LMs under a distribution against no distribution.

Trains a keras-hub backbone plus its reversed token embedding as the
language-model head (as `GemmaCausalLM` and `LlamaCausalLM` compute their
logits), with `train_on_batch`, exactly as a user would write it: first
without a distribution, then under each mode asked for, from the same
seed on the same batches. For each run it reports:

- the largest relative difference of the per-step losses from the run
  without a distribution, and the largest absolute difference of the
  final weights;
- the median step time (after `--warmup` steps; the device is
  synchronized after each step), the first (compiling) step's time and,
  on CUDA, the peak memory allocated during the timed steps;
- the attention kernels the step ran (the `aten` ops whose name holds
  `scaled_dot_product`, read by `torch.profiler` from the last step,
  which is not timed), that step's host reads of a value ("device
  waits": `.item()` and stream synchronizations, each of which waits for
  the GPU's queued work) and, in the log, its most expensive ops;
- the layers that ran on DTensors, not locally (`batch_local`).

Modes: `none` (no distribution), `dp` (`DataParallel` over every
process), `mp` (`ModelParallel` on a (1, N) ("batch", "model") mesh
laid out by the backbone's own `get_layout_map`), `mp2d` (the same on
a (2, N / 2) mesh) and `auto` (the (1, N) mesh laid out by
`keras_dtensor.auto_tensor_parallel_layouts`). On one process the
meshes are (1,) and (1, 1). Run it under torchrun, e.g. on one GPU:

    KERAS_BACKEND=torch torchrun --nproc_per_node=1 \\
        benchmarks/keras_hub_step.py --preset gemma-h1024 \\
        --precision mixed_bfloat16 --out /tmp/out

Presets: `tiny` (2 layers, hidden 32; float32 parity checks, fast on
CPU), `mid` (4 layers, hidden 256, 4 heads of 64, vocabulary 4096, batch
4 of 128 tokens: the CPU size of the keras-hub speed issue) and
`gemma-h1024` (6 layers, hidden 1024, 8 heads of 128, vocabulary 32000,
batch 16 of 512 tokens: the size of the keras-hub issue's GPU table).
`--lora RANK` trains LoRA adapters of that rank instead of every weight.
`--models` may name `native_llama`: the benchmark's plain-torch Llama at
the preset's sizes, without a distribution and under `parallelize_module`
(its `mp`; it has no other mode, and trains every weight whatever
`--lora` says), the native anchor of the keras-hub cells
(`keras_hub_native`).
The profiled step counts its collectives, by kind. `--sdpa` restricts
`scaled_dot_product_attention` to one kernel family for the whole run.
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_hub  # noqa: E402
import keras_hub_native  # noqa: E402
import measure  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402
from torch.profiler import profile  # noqa: E402

import keras  # noqa: E402
import keras_dtensor  # noqa: E402

SEED = 1337
PRESETS = {
    "tiny": {
        "backbone": {
            "vocabulary_size": 256,
            "num_layers": 2,
            "num_query_heads": 4,
            "num_key_value_heads": 2,
            "hidden_dim": 32,
            "intermediate_dim": 64,
        },
        "gemma": {"head_dim": 8},
        "batch": 4,
        "seq": 16,
    },
    "mid": {
        "backbone": {
            "vocabulary_size": 4096,
            "num_layers": 4,
            "num_query_heads": 4,
            "num_key_value_heads": 4,
            "hidden_dim": 256,
            "intermediate_dim": 1024,
        },
        "gemma": {"head_dim": 64},
        "batch": 4,
        "seq": 128,
    },
    "gemma-h1024": {
        "backbone": {
            "vocabulary_size": 32000,
            "num_layers": 6,
            "num_query_heads": 8,
            "num_key_value_heads": 8,
            "hidden_dim": 1024,
            "intermediate_dim": 4096,
        },
        "gemma": {"head_dim": 128},
        "batch": 16,
        "seq": 512,
    },
}
BACKBONES = {
    "gemma": keras_hub.models.GemmaBackbone,
    "llama": keras_hub.models.LlamaBackbone,
    "qwen": keras_hub.models.QwenBackbone,
    "qwen_moe": keras_hub.models.QwenMoeBackbone,
    "qwen3_moe": keras_hub.models.Qwen3MoeBackbone,
}
# The mixtures of experts: 4 experts, 2 per token, each a quarter of the
# preset's intermediate size (keras-hub computes every expert for every
# token, so their feed-forward costs what the dense models' does), and
# Qwen-MoE's shared expert half of it.
MIXTURES = ("qwen_moe", "qwen3_moe")
# The native anchor's name in `--models` (`keras_hub_native`).
NATIVE = "native_llama"
SDPA_BACKENDS = {
    "math": "MATH",
    "efficient": "EFFICIENT_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}


def parse_args(argv=None):
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--models", default="gemma,llama")
    parser.add_argument("--modes", default="dp,mp")
    parser.add_argument(
        "--precision", default="float32", choices=("float32", "mixed_bfloat16")
    )
    parser.add_argument("--sdpa", default="default")
    parser.add_argument("--steps", type=int, default=3, help="Timed steps.")
    parser.add_argument(
        "--lora", type=int, default=0, help="LoRA rank (0: full fine-tune)."
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Runs of each mode, in turn (step time: their median).",
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="Compile the steps (`model.compile(jit_compile=True)`).",
    )
    parser.add_argument("--out", default=None, help="Folder for the report.")
    parser.add_argument("--tag", default="keras_hub_step")
    return parser.parse_args(argv)


def rank():
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def say(text):
    """Prints a line on process 0."""
    if rank() == 0:
        print(text, flush=True)


def make_batches(preset, count):
    """`count` global batches: token ids, next tokens and padding masks.

    Every batch pads the end of its second sequence, so that the attention
    mask is not all ones.
    """
    config = PRESETS[preset]
    batch, seq = config["batch"], config["seq"]
    vocab = config["backbone"]["vocabulary_size"]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(count):
        tokens = rng.integers(1, vocab, size=(batch, seq + 1), dtype="int32")
        padding_mask = np.ones((batch, seq), dtype="int32")
        padding_mask[1, seq - seq // 4 :] = 0
        x = {"token_ids": tokens[:, :-1], "padding_mask": padding_mask}
        batches.append((x, tokens[:, 1:], padding_mask))
    return batches


def set_distribution(mode, backbone_class):
    """Sets the distribution of `mode` (`none`, `dp` or `mp`)."""
    if mode == "none":
        keras.distribution.set_distribution(None)
        return
    devices = keras.distribution.list_devices()
    if mode == "dp":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
        return
    # `mp`: (1, N); `mp2d`: (2, N / 2), batch and model axes both split.
    batch = 2 if mode == "mp2d" else 1
    mesh = keras.distribution.DeviceMesh(
        (batch, len(devices) // batch), ("batch", "model"), devices
    )
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=backbone_class.get_layout_map(mesh)
        )
    )


def build_model(name, preset, lora_rank=0, compiled=True, jit_compile=False):
    """The backbone, then logits from its reversed token embedding; with
    LoRA adapters of `lora_rank` where it is not 0."""
    config = PRESETS[preset]
    keras.utils.set_random_seed(SEED)
    extra = model_config(name, config)
    backbone = BACKBONES[name](**config["backbone"], **extra)
    if lora_rank:
        backbone.enable_lora(rank=lora_rank)
    logits = backbone.token_embedding(backbone.output, reverse=True)
    model = keras.Model(backbone.input, logits)
    if compiled:
        compile_model(model, jit_compile)
    return model


def model_config(name, config):
    """The arguments `name`'s backbone takes beyond the preset's."""
    extra = {}
    if name in ("gemma", "qwen3_moe"):
        extra.update(config["gemma"])  # The head size.
    if name in MIXTURES:
        intermediate = config["backbone"]["intermediate_dim"]
        extra.update(
            num_experts=4, top_k=2, moe_intermediate_dim=intermediate // 4
        )
    if name == "qwen_moe":
        extra["shared_expert_intermediate_dim"] = intermediate // 2
    return extra


def compile_model(model, jit_compile=False):
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )


def synchronize():
    """Waits for the device's queued work (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# Events of a step that read a value on the host (`.item()`, a stream
# synchronization): on CUDA each waits for the device's queued work.
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize")


def profiled_step(step):
    """One call of `step` under `torch.profiler`.

    Returns the `scaled_dot_product` aten ops it ran, the number of its
    events that wait for the device, its collectives, the profiler's
    table of the ops that took the most time (device time on CUDA), on
    CPU the bytes in use at the step's peak above its start (read from
    the profiler's memory events, see `measure.cpu_peak_bytes`), and the
    Python calls it made (`cProfile`'s count: host overhead that, unlike
    a time, a busy machine does not change).
    """
    activities = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=not cuda) as profiler:
        calls = measure.profile_stats(step).total_calls
    step_peak = None if cuda else measure.cpu_peak_bytes(profiler)
    events = profiler.events()
    kernels = {
        event.name
        for event in events
        if "scaled_dot_product" in event.name and event.name.startswith("aten")
    }
    syncs = sum(event.name in SYNC_EVENTS for event in events)
    collectives = collective_counts(events)
    sort_by = (
        "self_cuda_time_total"
        if torch.cuda.is_available()
        else "self_cpu_time_total"
    )
    top = profiler.key_averages().table(sort_by=sort_by, row_limit=12)
    return sorted(kernels), syncs, collectives, top, step_peak, calls


def collective_counts(events):
    """The collectives a profiled step issued, by kind: the process
    group's `c10d` ops (each functional collective DTensor issues calls
    one of them)."""
    counts = {}
    for event in events:
        if event.name.startswith("c10d::"):
            kind = event.name[len("c10d::") :].rstrip("_")
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def dtensor_layers(model):
    """Names of the layers that ran on DTensors rather than locally.

    A layer whose checked first calls did not prove it local (to each
    batch shard, `batch_local`, or to its shards, with gradients or
    without) runs on DTensors, outside a layer proven local; its
    sublayers are then checked in turn.
    """
    from keras.src.backend.torch import batch_local

    layers = [model] + list(model._flatten_layers(include_self=False))

    # A layer with no plan but None never ran locally; one proven local
    # with gradients or without (`training_local_calls`,
    # `inference_local_calls`) has a plan besides, and its sublayers run
    # inside its local calls.
    def training_plans(layer):
        # A step's plans: not those of calls without gradients.
        return [
            plan
            for key, plan in batch_local.plans_of(layer).items()
            if key[:1] != ("inference",)
        ]

    inside_local = {
        id(sublayer)
        for layer in layers
        if any(plan is not None for plan in training_plans(layer))
        for sublayer in layer._flatten_layers(include_self=False)
    }
    return [
        layer.name
        for layer in layers
        if id(layer) not in inside_local
        and training_plans(layer)
        and all(plan is None for plan in training_plans(layer))
    ]


def run_steps(model, label, args, batches):
    """Trains `model` on `batches`; returns its measurements."""
    losses, times = [], []
    kernels = syncs = peak = collectives = first = None
    for index, (x, y, sample_weight) in enumerate(batches):
        step = functools.partial(
            model.train_on_batch, x, y, sample_weight=sample_weight
        )
        if index == args.warmup and torch.cuda.is_available():
            synchronize()
            torch.cuda.reset_peak_memory_stats()
        if index == len(batches) - 1:
            # The last step runs under the profiler, untimed.
            kernels, syncs, collectives, top, step_peak, calls = profiled_step(
                lambda: losses.append(step())
            )
            say(f"--- {label}: {syncs} device waits; top ops:\n{top}")
            continue
        start = time.perf_counter()
        losses.append(step())
        synchronize()
        seconds = time.perf_counter() - start
        first = seconds if index == 0 else first
        if index >= args.warmup:
            times.append(seconds)
    # This process's parameters and optimizer state (local parts).
    variables = model.weights + model.optimizer.variables
    held = measure.storage_bytes([v.value for v in variables])
    if torch.cuda.is_available():
        synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        # What the process holds across steps, plus the step's own peak.
        peak = held + step_peak
    return {
        "losses": [float(loss) for loss in losses],
        "weights": model.get_weights(),
        "step_ms": 1000.0 * statistics.median(times) if times else None,
        "first_step_s": first,
        "peak_bytes": measure.largest_over_ranks(peak),
        "held_bytes": measure.largest_over_ranks(held),
        "kernels": kernels,
        "device_waits": syncs,
        "python_calls": measure.largest_over_ranks(calls),
        "collectives": collectives,
    }


def train(name, mode, args, batches):
    """Trains one model under `mode`; returns its measurements."""
    if name == NATIVE:
        model = keras_hub_native.build(mode, PRESETS[args.preset], SEED)
        result = run_steps(model, f"{name} {mode}", args, batches)
        result["dtensor_layers"] = []
        return result
    if mode == "auto":
        model = build_auto_model(name, args.preset, args.lora, args.jit_compile)
    else:
        set_distribution(mode, BACKBONES[name])
        model = build_model(
            name, args.preset, args.lora, jit_compile=args.jit_compile
        )
    result = run_steps(model, f"{name} {mode}", args, batches)
    result["dtensor_layers"] = dtensor_layers(model) if mode != "none" else []
    keras.distribution.set_distribution(None)
    model = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def build_auto_model(name, preset, lora_rank, jit_compile=False):
    """`auto`: the model on a (1, N) mesh laid out by keras_dtensor's
    `auto_tensor_parallel_layouts`, created sharded from its abstract
    build."""
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    with keras.StatelessScope():
        model = build_model(name, preset, lora_rank, compiled=False)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=keras_dtensor.auto_tensor_parallel_layouts(
                    model, mesh
                )
            )
        )
    compile_model(model, jit_compile)
    return model


def compare(result, reference):
    """Adds the differences from the run without a distribution."""
    result["loss_rel_diff"] = max(
        abs(a - b) / max(abs(b), 1e-12)
        for a, b in zip(result["losses"], reference["losses"])
    )
    result["weight_abs_diff"] = max(
        float(np.max(np.abs(np.asarray(a, "float64") - b)))
        for a, b in zip(result["weights"], reference["weights"])
    )
    if reference["step_ms"] and result["step_ms"]:
        result["time_ratio"] = result["step_ms"] / reference["step_ms"]
    if reference["peak_bytes"] and result["peak_bytes"]:
        result["memory_ratio"] = result["peak_bytes"] / reference["peak_bytes"]


def sdpa_scope(choice):
    """A scope restricting `scaled_dot_product_attention` to `choice`."""
    if choice == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[choice]))


def run_model(name, args, batches):
    """The run without a distribution, then each mode, `--repeats` times
    in turn; a row per mode (see `merge_runs`)."""
    modes = ["none"] + [
        mode
        for mode in args.modes.split(",")
        if name != NATIVE or mode in keras_hub_native.MODES
    ]
    runs = [[] for _ in modes]
    for _ in range(args.repeats):
        for index, mode in enumerate(modes):
            runs[index].append(try_train(name, mode, args, batches))
    reference = merge_runs(runs[0])
    rows = [{"model": name, "mode": "none", **reference}]
    for mode, results in zip(modes[1:], runs[1:]):
        row = {"model": name, "mode": mode, **merge_runs(results)}
        if "error" not in row:
            compare(row, reference)
        rows.append(row)
    return rows


def try_train(name, mode, args, batches):
    """`train`'s result, or `{"error": ...}` when it raised."""
    try:
        return train(name, mode, args, batches)
    except Exception as error:  # noqa: BLE001 - reported in the table
        keras.distribution.set_distribution(None)
        lines = str(error).strip().splitlines() or [""]
        if rank() == 0:
            traceback.print_exc()
        return {"error": f"{type(error).__name__}: {lines[0][:300]}"}


def merge_runs(results):
    """The repeats of one mode as one row: the last run's measurements,
    with the median of the runs' step times and peaks (every run's under
    `step_ms_runs` and `peak_bytes_runs`; a CPU peak moves with gloo's
    threads' allocations)."""
    for result in results:
        if "error" in result:
            return result
    row = dict(results[-1])
    for key in ("step_ms", "peak_bytes"):
        values = [result[key] for result in results]
        if None not in values:
            row[key] = statistics.median(values)
            row[f"{key}_runs"] = values
    return row


def _cell(value, form):
    return "-" if value is None else format(value, form)


def table(rows):
    """The report's Markdown table."""
    lines = [
        "| model | mode | loss rel. diff | weight abs. diff | step ms "
        "| × none | first step s | peak MiB | × none | held MiB "
        "| Python calls | device waits | collectives | attention kernels |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(
                f"| {row['model']} | {row['mode']} | ✗ {row['error']} "
                "| | | | | | | | | | | |"
            )
            continue
        peak, held = row.get("peak_bytes"), row.get("held_bytes")
        kernels = ", ".join(
            k.replace("aten::", "") for k in row.get("kernels") or []
        )
        lines.append(
            f"| {row['model']} | {row['mode']} "
            f"| {_cell(row.get('loss_rel_diff'), '.1e')} "
            f"| {_cell(row.get('weight_abs_diff'), '.1e')} "
            f"| {_step_cell(row)} "
            f"| {_cell(row.get('time_ratio'), '.2f')} "
            f"| {_cell(row.get('first_step_s'), '.1f')} "
            f"| {_cell(peak / 2**20 if peak else None, '.1f')} "
            f"| {_cell(row.get('memory_ratio'), '.2f')} "
            f"| {_cell(held / 2**20 if held else None, '.1f')} "
            f"| {_cell(row.get('python_calls'), 'd')} "
            f"| {_cell(row.get('device_waits'), 'd')} "
            f"| {_collectives_cell(row.get('collectives'))} "
            f"| {kernels or '-'} |"
        )
    return "\n".join(lines)


def _step_cell(row):
    """The median step time, and the range of the runs' when repeated."""
    runs = row.get("step_ms_runs") or []
    median = _cell(row.get("step_ms"), ".1f")
    if len(runs) < 2:
        return median
    return f"{median} ({min(runs):.1f}–{max(runs):.1f})"


def _collectives_cell(counts):
    if not counts:
        return "0" if counts == {} else "-"
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def header(args):
    """The run's machine, versions and settings."""
    device = (
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    return (
        f"{device}, {world} process(es); torch {torch.__version__}, keras "
        f"{keras.__version__}, keras-hub {keras_hub.__version__}; preset "
        f"{args.preset}, {args.precision}, SDPA {args.sdpa}, "
        f"{f'LoRA rank {args.lora}' if args.lora else 'full fine-tune'}, "
        f"{args.warmup} warm-up + {args.steps} timed steps + 1 profiled"
        f"{f', {args.repeats} runs of each mode in turn' * (args.repeats > 1)}"
        f"{', jit_compile=True' if args.jit_compile else ''}"
    )


def main(argv=None):
    args = parse_args(argv)
    keras.distribution.initialize()
    keras.mixed_precision.set_global_policy(args.precision)
    batches = make_batches(args.preset, args.warmup + args.steps + 1)
    rows = []
    with sdpa_scope(args.sdpa):
        for name in args.models.split(","):
            rows.extend(run_model(name, args, batches))
    text = f"{header(args)}\n\n{table(rows)}\n"
    for row in rows:
        if row.get("dtensor_layers"):
            names = row["dtensor_layers"]
            text += (
                f"\n{row['model']} {row['mode']}: {len(names)} layers ran on "
                f"DTensors: {', '.join(names[:16])}"
                + (" ..." if len(names) > 16 else "")
                + "\n"
            )
    say(text)
    if args.out and rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
            f.write(text)
        for row in rows:
            row.pop("weights", None)
        with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
            json.dump({"header": header(args), "rows": rows}, f, indent=1)
    failed = any("error" in row for row in rows)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
