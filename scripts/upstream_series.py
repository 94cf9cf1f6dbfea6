"""The in-tree change as a patch series against keras-nightly's source.

`upstream/series` lists the patches of `upstream/` in the order they apply
(the order of `UPSTREAMING.md`): first the new modules, then the changes to
upstream files. The base is the source tree of the keras-nightly wheel named
in `upstream/BASE` (the wheel ships no tests; the series adds this
project's).

The new-module patches are generated from this checkout's `keras/` tree:
each adds its modules (and their tests) with the names this project takes
from keras 3.15.1 changed to the base's names (`RENAMES`). The patches to
upstream files are written by hand against the base and kept as they are.

Usage:
    python scripts/upstream_series.py check
        Checks that every new-module patch adds exactly the files of its
        entry in `MODULE_PATCHES`, with this checkout's content renamed.
    python scripts/upstream_series.py refresh BASE_TREE
        Regenerates the new-module patches on a git repository holding the
        base (its first commit), then re-applies the hand-written patches
        on top and rewrites every patch of the series.
    python scripts/upstream_series.py render PATH
        Prints one module of this checkout as the series adds it.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPSTREAM = os.path.join(REPO, "upstream")
SERIES_FILE = os.path.join(UPSTREAM, "series")

# Names this project's modules use (keras 3.15.1's) and what the base calls
# them. Each entry is a regular expression and its replacement.
RENAMES = (
    (r"keras\.src\.backend\.torch\.core\b", "keras.src.backend.torch.ops.core"),
    (r"keras\.src\.backend\.jax\.core\b", "keras.src.backend.jax.ops.core"),
    (r"\bTorchTrainer\b", "Trainer"),
    (r"\b_should_torch_compile\b", "_use_torch_compile"),
    # In-tree, the layout helpers are exported as `keras.distribution.*`.
    (r"^(\s*)import keras_dtensor$", r"\1import keras"),
    (r"\bkeras_dtensor\.(?=[a-z_]+ is )", "keras.distribution."),
)

T = "keras/src/backend/torch/"
D = "keras/src/distribution/"
S = "keras/src/saving/"

# The new-module patches, in the order they apply: file name, subject, and
# the modules they add (each with its `_test.py` where it has one).
MODULE_PATCHES = (
    (
        "0001-distribution-layout-validation.patch",
        "Add the shared layout validator",
        [D + "layout_validation.py"],
    ),
    (
        "0002-torch-process-group.patch",
        "torch: the distributed process group, timeout and shared seed; "
        "the one door to torch's internals",
        [
            T + "process_group.py",
            T + "gloo_groups.py",
            T + "torch_internals.py",
            T + "torch_runtime.py",
        ],
    ),
    (
        "0003-torch-dtensor-layouts.patch",
        "torch: Keras layouts as DTensor placements",
        [T + "dtensor_layouts.py"],
    ),
    (
        "0004-torch-sharding-rules.patch",
        "torch: sharding rules DTensor lacks or gets wrong",
        [
            T + "sharding_rules.py",
            T + "attention_rules.py",
            T + "replicated_fallback.py",
            T + "strided_shard_sizes.py",
            T + "torch_probes.py",
            T + "unit_axis_redistribution.py",
            T + "torch_workarounds.py",
            T + "view_rules.py",
        ],
    ),
    (
        "0005-torch-created-tensors.patch",
        "torch: tensors created in a distributed step are replicated",
        [
            T + "created_tensors.py",
            T + "argument_layouts.py",
            T + "attention_layouts.py",
            T + "creation_handlers.py",
            T + "extreme_reductions.py",
            T + "in_place_writes.py",
            T + "local_layouts.py",
            T + "local_rows.py",
            T + "python_values.py",
            T + "sharded_lookups.py",
            T + "split_class_losses.py",
        ],
    ),
    (
        "0006-torch-batches-and-collectives.patch",
        "torch: input batches as DTensors, and collectives for Keras code",
        [T + "batch_distribution.py", T + "collectives.py"],
    ),
    (
        "0007-torch-sharded-initialization.patch",
        "torch: sharded variables are initialized shard by shard",
        [T + "sharded_initialization.py"],
    ),
    (
        "0008-torch-gradient-buckets.patch",
        "torch: bucketed asynchronous gradient reduction",
        [
            T + "reducer.py",
            T + "gradient_bucket.py",
            T + "gather_bucket.py",
            T + "bucket_assignment.py",
            T + "bucket_riders.py",
            T + "local_gradients.py",
            T + "parameter_gradients.py",
        ],
    ),
    (
        "0009-torch-gathered-units.patch",
        "torch: fully sharded variables gathered by unit",
        [
            T + "gathered_units.py",
            T + "unit_gathering.py",
            T + "reshard_after_forward.py",
        ],
    ),
    (
        "0010-torch-batch-local.patch",
        "torch: layers proven local to a batch shard run on local tensors",
        [
            T + "batch_local.py",
            T + "inference_local_calls.py",
            T + "training_local_calls.py",
            T + "gradient_comparisons.py",
            T + "shard_local_checks.py",
            T + "local_call_checks.py",
            T + "local_call_state.py",
            T + "local_calls.py",
            T + "local_replays.py",
            T + "local_variables.py",
            T + "local_views.py",
        ],
    ),
    (
        "0011-torch-distribution-lib.patch",
        "torch: the distribution library on DTensor",
        [T + "distribution_lib.py"],
    ),
    (
        "0012-torch-distributed-trainer.patch",
        "torch: the trainer's steps under a distribution",
        [
            T + "distributed_trainer.py",
            T + "train_step_copies.py",
            T + "compiled_step_backend.py",
            T + "compile_cache_keys.py",
            T + "compiled_graph_outputs.py",
        ],
    ),
    (
        "0013-distribution-layout-helpers.patch",
        "Add layout helpers: tensor parallel, fully sharded, composition",
        [
            D + "layout_composition.py",
            D + "tensor_parallel.py",
            D + "fully_sharded.py",
            D + "layer_calls.py",
            D + "automatic_plans.py",
        ],
    ),
    (
        "0014-distribution-remat-layers.patch",
        "Add remat_layers: recompute the layers matching a path pattern",
        [D + "remat.py"],
    ),
    (
        "0015-saving-distributed.patch",
        "Saving under a distribution, and sharded checkpoints on torch",
        [T + "process_sync.py", S + "distributed_saving.py"],
    ),
    (
        "0016-torch-distributed-checkpoint.patch",
        "torch: sharded checkpoints on torch.distributed.checkpoint",
        [T + "distributed_checkpoint.py"],
    ),
    (
        "0037-torch-replicated-updates.patch",
        "torch: optimizer steps on replicated variables run on local tensors",
        [T + "replicated_updates.py"],
    ),
    (
        "0039-torch-batch-reductions.patch",
        "torch: loss reductions over a split batch run on local tensors",
        [T + "batch_reductions.py"],
    ),
    (
        "0045-saving-sliced-loading.patch",
        "Keras files under a distribution: each process reads and writes "
        "its part",
        [
            S + "dataset_views.py",
            S + "zip_members.py",
            T + "shard_reads.py",
            T + "shard_writes.py",
            T + "deferred_initialization.py",
        ],
    ),
)


def module_files(modules):
    """The repository paths a module patch adds: modules and their tests."""
    paths = []
    for module in modules:
        paths.append(module)
        test = module[: -len(".py")] + "_test.py"
        if os.path.exists(os.path.join(REPO, test)):
            paths.append(test)
    return paths


def render(path):
    """The text of this checkout's `path` as the series adds it."""
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    for pattern, replacement in RENAMES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    return text


def read_series():
    """The patch file names of `upstream/series`, in order."""
    with open(SERIES_FILE) as f:
        return [
            line.strip()
            for line in f
            if line.strip() and not line.startswith("#")
        ]


def added_files(patch_text):
    """Maps each file a patch writes to its new content (the `+` side).

    Only whole-file patches are read: a new file, or a file rewritten as a
    whole (`git format-patch -B`), whose every line is on the `+` side.
    """
    files = {}
    current = None
    in_header = False
    for line in patch_text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1].strip()
            files[current] = []
            in_header = True
        elif line.startswith("@@"):
            in_header = False
        elif current is not None and not in_header and line[:1] == "+":
            files[current].append(line[1:])
    return {path: "".join(lines) for path, lines in files.items()}


def check():
    """Returns the problems of the new-module patches (empty when none)."""
    problems = []
    series = read_series()
    for name, _, modules in MODULE_PATCHES:
        if name not in series:
            problems.append(f"{name}: missing from upstream/series")
            continue
        with open(os.path.join(UPSTREAM, name)) as f:
            files = added_files(f.read())
        expected = module_files(modules)
        if sorted(files) != sorted(expected):
            problems.append(
                f"{name}: adds {sorted(files)}, expected {sorted(expected)}"
            )
            continue
        for path in expected:
            if files[path] != render(path):
                problems.append(
                    f"{name}: {path} differs from this checkout's; run "
                    "`python scripts/upstream_series.py refresh BASE_TREE`"
                )
    return problems


def git(tree, *args, **kwargs):
    """Runs git in `tree` and returns its output."""
    return subprocess.run(
        ["git", "-C", tree, *args],
        check=True,
        capture_output=True,
        text=True,
        **kwargs,
    ).stdout


# The date every generated patch carries, so that a refresh of unchanged
# modules rewrites no patch.
PATCH_DATE = "2026-11-24T00:00:00+00:00"


def commit(tree, subject):
    """Commits everything in `tree` with `subject` and returns the hash."""
    git(tree, "add", "-A")
    git(
        tree,
        "-c",
        "user.name=keras-dtensor",
        "-c",
        "user.email=keras-dtensor@users.noreply.github.com",
        "commit",
        "-q",
        f"--date={PATCH_DATE}",
        "-m",
        subject,
    )
    return git(tree, "rev-parse", "HEAD").strip()


def write_patch(tree, revision, name):
    """Writes the commit `revision` of `tree` as `upstream/<name>`."""
    text = git(
        tree,
        "format-patch",
        "-1",
        "-B",
        "--no-signature",
        "--zero-commit",
        "--stdout",
        revision,
    )
    with open(os.path.join(UPSTREAM, name), "w") as f:
        f.write(text)


def refresh(base_tree):
    """Regenerates the series on a copy of `base_tree`'s first commit."""
    modules = {
        name: (subject, paths) for name, subject, paths in MODULE_PATCHES
    }
    with tempfile.TemporaryDirectory() as work:
        tree = os.path.join(work, "tree")
        root = git(base_tree, "rev-list", "--max-parents=0", "HEAD").strip()
        subprocess.run(
            ["git", "clone", "-q", base_tree, tree],
            check=True,
            capture_output=True,
        )
        git(tree, "checkout", "-q", root)
        for name in read_series():
            if name in modules:
                subject, files = modules[name]
                for path in module_files(files):
                    target = os.path.join(tree, path)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(target, "w") as f:
                        f.write(render(path))
                revision = commit(tree, subject)
            else:
                git(tree, "am", "-q", os.path.join(UPSTREAM, name))
                revision = "HEAD"
            write_patch(tree, revision, name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check")
    refresh_parser = commands.add_parser("refresh")
    refresh_parser.add_argument("base_tree")
    render_parser = commands.add_parser("render")
    render_parser.add_argument("path")
    args = parser.parse_args(argv)
    if args.command == "check":
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if args.command == "refresh":
        refresh(os.path.abspath(args.base_tree))
        return 0
    sys.stdout.write(render(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
