#!/usr/bin/env bash
# Applies the patch series of upstream/ to a clean copy of its base and runs
# the tests of the patched keras, with no keras-dtensor installed.
#
# Usage: scripts/upstream_patches.sh [PYTEST_ARGS ...]
#
# 1. The base (upstream/BASE: a keras-nightly wheel, pinned by version and
#    SHA-256) is downloaded once, checked, and unpacked into a fresh git
#    repository: $UPSTREAM_WORK/tree.
# 2. Each patch of upstream/series is checked with `git apply --check`,
#    then applied with `git am` (one commit per patch). The script stops at
#    the first patch that does not apply.
# 3. A virtualenv ($UPSTREAM_VENV) gets torch, the test requirements and the
#    base's own dependencies, but neither keras nor keras-dtensor: the
#    patched tree is the only keras on the path, and no mount is armed.
# 4. pytest runs, in the patched tree, every `*_test.py` the series added:
#    the torch backend's distribution tests and this project's unit tests,
#    at their in-tree paths (or PYTEST_ARGS instead).
# 5. Without PYTEST_ARGS, the multi-process parity tests of this checkout
#    (integration_tests/training_parity_test.py and the test of the
#    layout helpers' example, examples/layout_helpers.py as
#    docs/layout_helpers.md shows it) then run with the patched tree as
#    their keras: gloo processes that train as one process does, with no
#    mount. The example's `import keras_dtensor as kd` reaches
#    `keras.distribution` there.
#
# Environment:
#   UPSTREAM_WORK     work folder (default: ${TMPDIR:-/tmp}/keras-upstream)
#   UPSTREAM_VENV     the virtualenv (default: ${TMPDIR:-/tmp}/keras-upstream-venv)
#   UPSTREAM_TIMEOUT  seconds for the pytest run (default 1800)
#   PYTHON            the interpreter that creates the venv (python3)
# Exits non-zero when a patch does not apply or a test fails.

set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE=${TMPDIR:-/tmp}
WORK=${UPSTREAM_WORK:-$BASE/keras-upstream}
VENV=${UPSTREAM_VENV:-$BASE/keras-upstream-venv}
TIMEOUT=${UPSTREAM_TIMEOUT:-1800}
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() {
    echo "upstream_patches.sh: $*" >&2
}

# A field of upstream/BASE (`name: value` lines).
base_field() {
    sed -n "s/^$1: *//p" "$REPO/upstream/BASE" | head -n 1
}

REQUIREMENT=$(base_field requirement)
SHA256=$(base_field sha256)
WHEEL_DIR=$WORK/wheel

# Downloads the base wheel once and checks its SHA-256.
fetch_base() {
    mkdir -p "$WHEEL_DIR"
    local wheel
    wheel=$(ls "$WHEEL_DIR"/*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$wheel" ]; then
        say "downloading $REQUIREMENT"
        "$PYTHON" -m pip download -q --no-deps --pre -d "$WHEEL_DIR" \
            "$REQUIREMENT"
        wheel=$(ls "$WHEEL_DIR"/*.whl | head -n 1)
    fi
    if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$SHA256" ]; then
        say "$wheel does not have the SHA-256 of upstream/BASE ($SHA256)"
        return 1
    fi
    echo "$wheel"
}

# Unpacks the wheel's source into a fresh git repository.
make_tree() {
    local wheel=$1 tree=$WORK/tree
    rm -rf "$tree"
    mkdir -p "$tree"
    "$PYTHON" - "$wheel" "$tree" <<'EOF'
import sys
import zipfile

wheel, tree = sys.argv[1:]
with zipfile.ZipFile(wheel) as archive:
    names = [n for n in archive.namelist() if n.startswith("keras/")]
    archive.extractall(tree, names)
EOF
    git -C "$tree" init -q
    git -C "$tree" add -A
    git -C "$tree" -c user.name=base -c user.email=base@localhost \
        commit -q -m "base: $REQUIREMENT"
}

# Checks, then applies, each patch of the series in order.
apply_series() {
    local tree=$WORK/tree name count=0
    while read -r name; do
        case "$name" in "" | "#"*) continue ;; esac
        if ! git -C "$tree" apply --check "$REPO/upstream/$name"; then
            say "FAIL: $name does not apply"
            return 1
        fi
        git -C "$tree" -c user.name=keras-dtensor \
            -c user.email=keras-dtensor@localhost am -q "$REPO/upstream/$name"
        count=$((count + 1))
    done <"$REPO/upstream/series"
    say "applied $count patches to $REQUIREMENT"
}

# Creates the venv: torch and the test requirements of the project, and the
# base's own dependencies (its wheel's Requires-Dist), without keras.
make_venv() {
    local wheel=$1
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    local deps
    deps=$("$PYTHON" - "$wheel" <<'EOF'
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as archive:
    name = next(n for n in archive.namelist() if n.endswith("/METADATA"))
    for line in archive.read(name).decode().splitlines():
        if line.startswith("Requires-Dist:") and ";" not in line:
            print(line.split(":", 1)[1].strip())
EOF
)
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install -q torch==2.13.0 pytest jax==0.10.2 $deps
    "$VENV/bin/pip" uninstall -q -y keras keras-nightly keras-dtensor \
        >/dev/null 2>&1 || true
    if ! (cd / && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(
            any(u.find_spec(n) for n in ('keras', 'keras_dtensor')))"); then
        say "$VENV still has keras or keras_dtensor installed"
        return 1
    fi
}

# Runs pytest in the patched tree on the tests the series added.
run_tests() {
    local tree=$WORK/tree
    local tests=("$@")
    if [ ${#tests[@]} -eq 0 ]; then
        mapfile -t tests < <(git -C "$tree" diff --name-only --diff-filter=A \
            "$(git -C "$tree" rev-list --max-parents=0 HEAD)" HEAD \
            -- '*_test.py')
    fi
    say "running ${#tests[@]} test files in $tree"
    (cd "$tree" && PYTHONPATH="$tree" KERAS_BACKEND=torch OMP_NUM_THREADS=1 \
        timeout "$TIMEOUT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
        -p no:randomly -o addopts="" -W ignore "${tests[@]}")
}

# Runs this checkout's multi-process parity tests on the patched keras.
# The layout helpers' example imports them as `keras_dtensor`; in-tree
# they are `keras.distribution.*` (the last patch), so a one-line module of
# that name re-exports `keras.distribution` (it arms no mount).
run_parity_tests() {
    local names=$WORK/in_tree_names
    mkdir -p "$names"
    printf '%s\n' \
        '"""keras-dtensor'"'"'s public names, in-tree: keras.distribution."""' \
        'from keras.distribution import *  # noqa: F403' \
        >"$names/keras_dtensor.py"
    say "running the parity tests with $WORK/tree as keras"
    # The workers' single-process references train without a distribution,
    # where the patched keras builds DDP (as upstream does), and torch
    # 2.13.0 crashes constructing DDP over gloo under the harness's
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: these run with it off.
    (cd "$REPO" && PYTHONPATH="$WORK/tree:$names" KERAS_BACKEND=torch \
        KERAS_DTENSOR_TEST_DISTRIBUTED_DEBUG=OFF \
        OMP_NUM_THREADS=1 timeout "$TIMEOUT" "$VENV/bin/python" -m pytest \
        -q -p no:cacheprovider -p no:randomly -W ignore \
        integration_tests/training_parity_test.py \
        "integration_tests/layout_helpers_test.py::test_docs_example_runs_as_written")
}

wheel=$(fetch_base)
make_tree "$wheel"
apply_series
make_venv "$wheel"
run_tests "$@"
if [ $# -eq 0 ]; then
    run_parity_tests
fi
