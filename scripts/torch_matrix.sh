#!/usr/bin/env bash
# Tests keras-dtensor against the oldest and the newest supported torch.
#
# Usage: scripts/torch_matrix.sh [TORCH_VERSION ...]
#
# Without arguments it tests the floor of pyproject's torch range (its
# newest patch release) and the newest torch the package index serves. For
# each version it creates (or reuses) a virtualenv with that torch, the
# keras of pyproject's range, pytest, h5py and numpy, installs this
# repository editable, and runs:
#   - the unit tests: python -m pytest -q keras keras_dtensor
#   - a multi-process smoke test: benchmarks/run.py on 2 gloo processes,
#     workloads mlp, transformer and llama in modes dp and tp (tensor
#     parallel, with head-sharded attention), which must run every cell
#     and train Keras and its native PyTorch twin to the same losses.
# and prints one PASS/FAIL line per version. Exits non-zero on any FAIL.
#
# Environment:
#   TORCH_MATRIX_DIR  where virtualenvs and logs go (default: $TMPDIR or
#                     /tmp); a venv is reused when it holds that torch.
#   PYTHON            the interpreter that creates the venvs (python3).
#
# pip constraints set in the environment or in pip's config are lifted for
# these installs (each venv pins one exact torch). Linux wheels from PyPI
# are CUDA builds: the first run downloads several GB per version.

set -u -o pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${TORCH_MATRIX_DIR:-${TMPDIR:-/tmp}}
LOGS=$DIR/torch-matrix-logs
PYTHON=${PYTHON:-python3}
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
export KERAS_BACKEND=torch OMP_NUM_THREADS=1
mkdir -p "$LOGS"

# The quoted requirement of a dependency in pyproject, e.g. torch>=2.11,<2.16.
requirement() {
    grep -o "\"$1[<>=!~][^\"]*\"" "$REPO/pyproject.toml" | head -n 1 |
        tr -d '"'
}

# Every torch release the index serves, newest first.
torch_releases() {
    "$PYTHON" -m pip index versions torch 2>/dev/null |
        sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' |
        grep -E '^[0-9]+\.[0-9]+\.[0-9]+$'
}

# The newest release in the floor's minor series, and the newest overall.
default_versions() {
    local floor releases
    floor=$(requirement torch | sed -n 's/^torch>=\([0-9.]*\).*/\1/p')
    releases=$(torch_releases)
    if [ -z "$floor" ] || [ -z "$releases" ]; then
        echo "cannot find the torch floor or the index's releases" >&2
        return 1
    fi
    echo "$releases" | grep -E "^${floor//./\\.}(\.|$)" | head -n 1
    echo "$releases" | head -n 1
}

# Creates or reuses the venv of torch $1, with this checkout installed
# editable; prints its path.
make_venv() {
    local version=$1 venv=$DIR/venv-torch-$1
    if ! "$venv/bin/python" -c "import torch, sys; sys.exit(
            not torch.__version__.startswith('$version'))" 2>/dev/null; then
        "$PYTHON" -m venv "$venv" &&
            "$venv/bin/pip" install -q --constraint /dev/null \
                "torch==$version" "$(requirement keras)" pytest h5py numpy \
                >&2 || return 1
    fi
    if [ "$(cd / && "$venv/bin/python" -c "import keras_dtensor, os
print(os.path.dirname(os.path.dirname(keras_dtensor.__file__)))" \
        2>/dev/null)" != "$REPO" ]; then
        "$venv/bin/pip" install -q --constraint /dev/null --no-deps \
            -e "$REPO" >&2 || return 1
    fi
    echo "$venv"
}

# Runs the unit tests; prints pytest's summary ("241 passed, 2 skipped").
unit_tests() {
    local python=$1 log=$2
    (cd "$REPO" && timeout 1800 "$python" -m pytest -q -p no:randomly \
        -W ignore keras keras_dtensor) >"$log" 2>&1
    local status=$?
    grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$log" |
        tail -n 1 | tr -d '='
    return $status
}

# Runs the benchmark smoke on 2 processes; prints "N/N cells ...".
smoke_test() {
    local venv=$1 out=$2
    rm -rf "$out"
    (cd "$REPO" && timeout 900 "$venv/bin/python" -m torch.distributed.run \
        --nproc_per_node=2 --nnodes=1 --master_addr=127.0.0.1 \
        --master_port=$((20000 + RANDOM % 20000)) benchmarks/run.py \
        --workload=mlp,transformer,llama --modes=dp,tp --hidden=32 \
        --layers=1 --batch=8 --seq=8 --heads=4 --vocab=16 --steps=2 \
        --warmup=1 --no-overhead --single-timeout=300 --out="$out" \
        --tag=smoke) >"$out.log" 2>&1 || return 1
    "$venv/bin/python" - "$out/smoke.json" <<'EOF'
import json
import sys

cells = json.load(open(sys.argv[1]))["cells"]
bad = [
    f"{c['workload']}/{c['mode']}: {c.get('error') or c['twin']}"
    for c in cells
    if "error" in c or not c["twin"]["ok"] or c["twin"]["max_rel_diff"] >= 1e-4
]
worst = max((c["twin"]["max_rel_diff"] for c in cells if "twin" in c), default=0)
print(
    f"{len(cells) - len(bad)}/{len(cells)} cells ran with Keras = native "
    f"twin (max relative loss difference {worst:.1e})"
    + "".join(f"; FAILED {b}" for b in bad)
)
sys.exit(1 if bad or len(cells) != 6 else 0)
EOF
}

main() {
    local versions=("$@") failed=0 summary=()
    if [ ${#versions[@]} -eq 0 ]; then
        mapfile -t versions < <(default_versions)
        [ ${#versions[@]} -eq 2 ] || exit 2
    fi
    for version in "${versions[@]}"; do
        local venv unit smoke status=PASS
        echo "== torch $version: venv" >&2
        if ! venv=$(make_venv "$version" 2>"$LOGS/install-$version.log"); then
            summary+=("torch $version: FAIL (install, see $LOGS/install-$version.log)")
            failed=1
            continue
        fi
        echo "== torch $version: unit tests" >&2
        unit=$(unit_tests "$venv/bin/python" "$LOGS/unit-$version.log") ||
            status=FAIL
        echo "== torch $version: multi-process smoke" >&2
        smoke=$(smoke_test "$venv" "$LOGS/smoke-$version") || status=FAIL
        [ -n "$smoke" ] || smoke="did not finish, see $LOGS/smoke-$version.log"
        [ "$status" = PASS ] || failed=1
        summary+=("torch $version: $status (unit: ${unit:-no summary}; smoke: $smoke)")
    done
    printf '%s\n' "${summary[@]}"
    return $failed
}

main "$@"
