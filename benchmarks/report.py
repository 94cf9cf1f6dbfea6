"""Markdown tables and a PNG chart of a benchmark run.

The chart needs matplotlib, which CI does not install: without it the
tables are written and the chart is skipped with a message.
"""

import json
import math
import os

from workloads import mesh_shape

# Step-time targets: Keras / native for each mode.
TIME_TARGETS = {"dp": 1.10, "tp": 1.15, "2d": 1.15}
MEMORY_TARGET = 1.05  # per-rank bytes / sharding limit

NATIVE_TOOL = {
    "single": "plain torch",
    "dp": "DDP",
    "tp": "parallelize_module",
    "2d": "parallelize_module + DDP",
    "fsdp": "FSDP2 fully_shard",
}

MESH = {
    "single": lambda n: "1",
    "dp": lambda n: f"batch={n}",
    "tp": lambda n: "batch={} x model={}".format(*mesh_shape("tp", n)),
    "2d": lambda n: "batch={} x model={}".format(*mesh_shape("2d", n)),
    "fsdp": lambda n: f"batch={n} (sharded)",
}


def _ms(value):
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _kib(value):
    return f"{value / 1024:.1f}"


def _verdict(ok):
    return "met" if ok else "**missed**"


def _error_cell(text):
    return "error: " + text.replace("|", "/").replace("\n", " ")


def twin_text(cell):
    """The twin check of a cell: steps compared and the largest relative
    difference of the global losses; a diverging twin is marked."""
    twin = cell.get("twin")
    if not twin:
        return "not run"
    text = f"{twin['steps']} steps, {twin['max_rel_diff']:.1e}"
    return text if twin["ok"] else f"**diverged** ({text})"


def _workload(cell):
    """The workload's name, marked when the cell's twin check failed."""
    twin = cell.get("twin")
    if twin and not twin["ok"]:
        return f"{cell['workload']} (**twin diverged**)"
    return cell["workload"]


def _twin_rtol(cells):
    """The twin check's tolerance, as the cells recorded it."""
    for cell in cells:
        if cell.get("twin"):
            return f"{cell['twin']['rtol']:.0e}"
    return "—"


def single_cells(cells):
    """Each workload's single-process cell (those that ran)."""
    return {
        c["workload"]: c
        for c in cells
        if c["mode"] == "single" and "error" not in c
    }


def local_cells(results):
    """Each workload's local-batch cell (those that ran)."""
    return {
        c["workload"]: c
        for c in results.get("local_cells", ())
        if "error" not in c
    }


def local_table(local_cells):
    """The local-batch cells' table, with its caption, as lines."""
    rows = []
    for c in local_cells:
        if "error" in c:
            rows.append([c["workload"], str(c["local_batch"])])
            rows[-1] += [_error_cell(c["error"]), "", "", ""]
            continue
        ms = c["step_ms"]
        rows.append(
            [
                c["workload"],
                str(c["local_batch"]),
                _ms(ms["keras"]),
                _ms(ms["native"]),
                f"{c['ratio']:.2f}",
                f"{c['python_calls']['keras']} / {c['python_calls']['native']}",
            ]
        )
    caption = (
        "**Local batch** (ms per training step): the single-process Keras "
        "model and its plain torch twin on one process's share of the "
        "batch, in every process at once, with no communication; with "
        'the data-parallel cell\'s native step, it gives the "÷ single" '
        "column that a distribution adding only DDP's time would show."
    )
    header = [
        "workload",
        "batch per process",
        "Keras ms",
        "native ms",
        "Keras/native",
        "Python calls/step Keras / native",
    ]
    return [caption, "", _table(header, rows)]


def floor_ratio(cell, single, local):
    """The "÷ single" a data-parallel cell would show if distributing
    added no time beyond DDP's communication.

    Such a Keras step costs the local-batch cell's Keras step (the
    single-process model on this process's share of the batch, every
    process at once) plus what DDP adds to its native twin (the cell's
    native step minus the local-batch native step).
    """
    keras = local["step_ms"]["keras"]
    added = cell["step_ms"]["native"] - local["step_ms"]["native"]
    return (keras + added) / cell["step_ms"]["native"] / single["ratio"]


def time_row(cell, singles=None, locals_=None):
    """One row of the step-time table.

    Args:
        cell: a cell result.
        singles: dict mapping a workload to its single-process cell, to
            show the distributed ratio relative to the single-process one
            (the target applies to that relative ratio).
        locals_: dict mapping a workload to its local-batch cell, for the
            lowest "÷ single" of its data-parallel cell (`floor_ratio`).
    """
    head = [_workload(cell), cell["mode"], MESH[cell["mode"]](cell["world"])]
    tool = NATIVE_TOOL[cell["mode"]]
    if "error" in cell:
        return head + [tool, _error_cell(cell["error"])] + [""] * 9
    ms = cell["step_ms"]
    single = (singles or {}).get(cell["workload"])
    relative = floor = "—"
    verdict = "—"
    target = TIME_TARGETS.get(cell["mode"])
    local = (locals_ or {}).get(cell["workload"])
    if single is not None:
        relative = f"{cell['ratio'] / single['ratio']:.2f}"
        if local is not None and cell["mode"] == "dp":
            floor = f"{floor_ratio(cell, single, local):.2f}"
        if target:
            verdict = _verdict(cell["ratio"] / single["ratio"] <= target)
    calls = cell["python_calls"]
    return head + [
        tool,
        twin_text(cell),
        _ms(ms["keras"]),
        _ms(ms["native"]),
        f"{cell['ratio']:.2f}",
        relative,
        floor,
        f"≤ {target:.2f}" if target else "—",
        verdict,
        f"{calls['keras']} / {calls['native']}",
        jit_text(cell, single),
    ]


def jit_text(cell, single=None):
    """The `jit_compile=True` column: step time, speed-up over eager, and
    the first step's time (the compile), also over the single-process
    cell's where that was compiled too."""
    ms = cell["step_ms"]
    if "jit_error" in cell:
        return _error_cell(cell["jit_error"])
    if "keras_jit" not in ms:
        return "not run"
    text = f"{_ms(ms['keras_jit'])} ({cell['jit_speedup']:.2f}x)"
    if "jit_compile_s" not in cell:
        return text
    text += f"; first step {cell['jit_compile_s']:.1f} s"
    if single is not None and single is not cell and "jit_compile_s" in single:
        ratio = cell["jit_compile_s"] / single["jit_compile_s"]
        text += f" ({ratio:.2f}x single's)"
    return text


def collective_row(cell):
    """One row of the collectives table."""
    head = [_workload(cell), cell["mode"]]
    if "error" in cell:
        return head + [_error_cell(cell["error"])] + [""] * 4
    counts = cell["collectives"]
    keras, native = counts["keras"], counts["native"]
    minimum = counts["minimum"]

    def fmt(c):
        return f"{c['forward']} / {c['total'] - c['forward']} / {c['total']}"

    ops = ", ".join(f"{k} {v}" for k, v in sorted(keras["ops"].items()))
    return head + [
        fmt(keras),
        fmt(native),
        fmt(minimum),
        _verdict(keras["total"] <= minimum["total"]),
        f"{ops or '—'}; min: {minimum['note']}",
    ]


def memory_row(cell):
    """One row of the memory table."""
    head = [_workload(cell), cell["mode"]]
    if "error" in cell:
        return head + [_error_cell(cell["error"])] + [""] * 7
    keras, native = cell["memory"]["keras"], cell["memory"]["native"]
    return head + [
        f"{_kib(keras['params'])} / {_kib(keras['grads'])} / "
        f"{_kib(keras['optimizer'])}",
        _kib(keras["total"]),
        _kib(keras["limit"]),
        f"{keras['ratio']:.3f}",
        _verdict(keras["ratio"] <= MEMORY_TARGET),
        f"{_kib(native['total'])} (buckets {_kib(native['buffers'])})",
        f"{native['ratio']:.3f}",
    ]


def _with_quartiles(value, quartiles):
    low, high = quartiles
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def overhead_row(row):
    """One row of the mount-overhead table."""
    if "error" in row:
        return [row["workload"], _error_cell(row["error"])] + [""] * 6
    calls = row["python_calls"]
    return [
        row["workload"],
        _ms(row["keras_off_ms"]),
        _ms(row["keras_on_ms"]),
        _with_quartiles(row["ratio"], row["ratio_quartiles"]),
        _with_quartiles(row["native_ratio"], row["native_quartiles"]),
        _with_quartiles(row["corrected_ratio"], row["corrected_quartiles"]),
        f"{calls['off']} / {calls['on']} ({calls['on'] / calls['off']:.4f})",
        "met" if row["within_noise"] else "**missed**",
    ]


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _header(results):
    machine = results["machine"]
    config = ", ".join(f"{k}={v}" for k, v in results["config"].items())
    options = results["options"]
    load = machine.get("load_average", [math.nan] * 3)
    load_end = machine.get("load_average_end", [math.nan] * 3)
    code = results.get("code") or {}
    commit = code.get("commit") or "unknown"
    if code.get("modified"):
        commit += " + uncommitted " + ", ".join(code["modified"])
    return "\n".join(
        [
            f"Command: `{results['command']}`",
            "",
            f"Code: commit {commit}.",
            "",
            f"Machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs"
            f"{', ' + machine['cuda'] if machine.get('cuda') else ''}; "
            f"torch {machine['torch']}, keras {machine['keras']}, "
            f"Python {machine['python']}, backend "
            f"{machine['backend'] or 'none'}, {results['world']} processes. "
            f"Load average {load[0]:.1f} at start, {load_end[0]:.1f} at "
            f"end. Wall time {results.get('wall_s', math.nan):.0f} s.",
            "",
            f"Sizes: {config}. Median of {options['steps']} interleaved "
            f"timed steps after {options['warmup']} warm-up steps; a step's "
            "time is the slowest rank's.",
        ]
    )


def markdown(results):
    """The report of one run as markdown."""
    cells = results["cells"]
    parts = [
        _header(results),
        "",
        "**Step time** (ms per training step). Twin check: from the same "
        "initial weights, on the same global batch, Keras and its native "
        "twin train a few steps and their global losses (all-reduced over "
        "the data-parallel processes on both sides) must agree within "
        f"{_twin_rtol(cells)} relative; a cell where they do not is marked "
        "**twin diverged** in every table.",
        "",
    ]
    parts.append(
        _table(
            [
                "workload",
                "mode",
                "mesh",
                "native",
                "twin check (global losses, max relative difference)",
                "Keras ms",
                "native ms",
                "Keras/native",
                "÷ single-process Keras/native",
                "÷ single if distributing added only DDP's time",
                "target (÷ single)",
                "time",
                "Python calls/step Keras / native",
                "Keras jit_compile ms (speed-up; first step)",
            ],
            [
                time_row(c, single_cells(cells), local_cells(results))
                for c in cells
            ],
        )
    )
    if results.get("local_cells"):
        parts += ["", *local_table(results["local_cells"])]
    parts += [
        "",
        "**Collectives per training step** (outside backward / in "
        "backward / total; outside backward = forward, loss logging and "
        "optimizer)",
        "",
        _table(
            [
                "workload",
                "mode",
                "Keras",
                "native",
                "minimum",
                "collectives",
                "Keras ops; minimum",
            ],
            [collective_row(c) for c in cells],
        ),
        "",
        "**Per-rank memory** (KiB; params / grads / optimizer state; the "
        "limit follows from the mode's definition, not from any run's "
        "layout: params + grads + optimizer slots, replicated for single "
        "and dp, the Megatron plan's parameters / model-axis size for tp "
        "and 2d, everything / N for fsdp; native totals include DDP's "
        "gradient buckets)",
        "",
        _table(
            [
                "workload",
                "mode",
                "Keras p / g / opt",
                "Keras total",
                "limit",
                "Keras/limit",
                "memory",
                "native total (DDP buckets)",
                "native/limit",
            ],
            [memory_row(c) for c in cells],
        ),
    ]
    if results.get("overhead"):
        parts += [
            "",
            "**Overhead of the installed package with no distribution set** "
            "(single process; plain keras = the mount removed before keras "
            "is imported; both processes run side by side, steps "
            "alternating; ratios are with / without, median [quartiles] of "
            "the step pairs; the native torch steps of the same two "
            "processes are the control, and the corrected ratio divides "
            "each Keras pair by its native pair; target: the corrected "
            "quartiles include 1)",
            "",
            _table(
                [
                    "workload",
                    "plain keras ms",
                    "with keras-dtensor ms",
                    "Keras ratio",
                    "native ratio (control)",
                    "corrected ratio",
                    "Python calls per Keras step: plain / with (ratio)",
                    "zero within noise",
                ],
                [overhead_row(r) for r in results["overhead"]],
            ),
        ]
    return "\n".join(parts) + "\n"


def print_progress(cell):
    """One line per finished cell, for the console."""
    if "error" in cell:
        print(f"[bench] {cell['workload']}/{cell['mode']}: {cell['error']}")
        return
    print(
        f"[bench] {cell['workload']}/{cell['mode']}: keras "
        f"{_ms(cell['step_ms']['keras'])} ms, native "
        f"{_ms(cell['step_ms']['native'])} ms, ratio {cell['ratio']:.2f}, "
        f"twin {twin_text(cell)}",
        flush=True,
    )


def write_chart(results, path):
    """Writes a PNG chart; returns False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the chart.")
        return False
    cells = [c for c in results["cells"] if "error" not in c]
    names = list(dict.fromkeys(c["workload"] for c in cells))
    if not names:
        return False
    figure, axes = plt.subplots(
        2, len(names), figsize=(5 * len(names), 7), squeeze=False
    )
    for column, workload in enumerate(names):
        rows = [c for c in cells if c["workload"] == workload]
        modes = [c["mode"] for c in rows]
        positions = range(len(rows))
        top, bottom = axes[0][column], axes[1][column]
        width = 0.38
        top.bar(
            [p - width / 2 for p in positions],
            [c["step_ms"]["keras"] for c in rows],
            width,
            label="Keras",
        )
        top.bar(
            [p + width / 2 for p in positions],
            [c["step_ms"]["native"] for c in rows],
            width,
            label="native torch",
        )
        top.set_xticks(list(positions), modes)
        top.set_title(f"{workload}: step time (ms)")
        top.legend()
        bottom.bar(
            [p - width / 2 for p in positions],
            [c["collectives"]["keras"]["total"] for c in rows],
            width,
            label="Keras",
        )
        bottom.bar(
            [p + width / 2 for p in positions],
            [c["collectives"]["native"]["total"] for c in rows],
            width,
            label="native torch",
        )
        bottom.scatter(
            list(positions),
            [c["collectives"]["minimum"]["total"] for c in rows],
            color="black",
            marker="_",
            s=400,
            label="minimum",
            zorder=3,
        )
        bottom.set_xticks(list(positions), modes)
        bottom.set_title(f"{workload}: collectives per step")
        bottom.legend()
    figure.suptitle(
        f"keras-dtensor vs native PyTorch, {results['world']} processes"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def write_all(results, folder, tag):
    """Writes `<tag>.json`, `<tag>.md` and (if possible) `<tag>.png`.

    Returns:
        The paths written.
    """
    os.makedirs(folder, exist_ok=True)
    paths = []
    json_path = os.path.join(folder, f"{tag}.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    paths.append(json_path)
    md_path = os.path.join(folder, f"{tag}.md")
    with open(md_path, "w") as f:
        f.write(markdown(results))
    paths.append(md_path)
    png_path = os.path.join(folder, f"{tag}.png")
    if write_chart(results, png_path):
        paths.append(png_path)
    return paths
