#!/usr/bin/env bash
# Runs upstream keras's own distribution tests against this project.
#
# Usage: PEER_KERAS_REPO=PATH scripts/peer_tests.sh [patched|mounted]
#
# The tests are `keras/src/distribution/distribution_lib_test.py` and
# `keras/src/backend/torch/distribution_lib_test.py` of a keras-team/keras
# git repository (PEER_KERAS_REPO) at PEER_KERAS_REF (default 3422977a, the
# newest master with tests at hand; the nightly wheel ships none). They run
# from a scratch folder, against:
#   patched  the patched keras tree of scripts/upstream_patches.sh (run it
#            first), in its virtualenv, no mount: this project in-tree.
#            That tree is newer than the tests: their imports of
#            `keras.src.backend.torch.core` are renamed to `...torch.ops.core`.
#   mounted  the keras installed in this checkout's .venv (3.15.1) with the
#            mount armed.
# TensorFlow is not installed: a stand-in `tensorflow` module lets the first
# file import (its `tf.data` tests are JAX-only and skipped on torch). The
# second file runs without it: keras 3.15.1 takes an importable `tensorflow`
# for the real one in places (`tf.random`).
#
# Environment:
#   PEER_KERAS_REPO  a keras-team/keras git repository (required)
#   PEER_KERAS_REF   the commit to take the tests from (default 3422977a)
#   UPSTREAM_WORK, UPSTREAM_VENV  as in scripts/upstream_patches.sh
# Prints pytest's result per test (-rA); exits with pytest's status.

set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE=${TMPDIR:-/tmp}
WORK=${UPSTREAM_WORK:-$BASE/keras-upstream}
VENV=${UPSTREAM_VENV:-$BASE/keras-upstream-venv}
REF=${PEER_KERAS_REF:-3422977a}
TARGET=${1:-patched}
: "${PEER_KERAS_REPO:?set PEER_KERAS_REPO to a keras-team/keras git repository}"

PEER=$WORK/peer-$TARGET
rm -rf "$PEER"
mkdir -p "$PEER/stub/tensorflow"
echo '"""Stand-in: tensorflow is not installed; tf.* raises."""' \
    >"$PEER/stub/tensorflow/__init__.py"
git -C "$PEER_KERAS_REPO" show \
    "$REF:keras/src/distribution/distribution_lib_test.py" \
    >"$PEER/distribution_lib_test.py"
git -C "$PEER_KERAS_REPO" show \
    "$REF:keras/src/backend/torch/distribution_lib_test.py" \
    >"$PEER/torch_distribution_lib_test.py"

case "$TARGET" in
patched)
    if [ ! -d "$WORK/tree/.git" ]; then
        echo "peer_tests.sh: run scripts/upstream_patches.sh first" >&2
        exit 2
    fi
    sed -i -e 's/keras\.src\.backend\.torch import core$/keras.src.backend.torch.ops import core/' \
        -e 's/keras\.src\.backend\.torch\.core\b/keras.src.backend.torch.ops.core/g' \
        "$PEER"/*_test.py
    PYTHON=$VENV/bin/python
    PATHS=$WORK/tree
    ;;
mounted)
    PYTHON=$REPO/.venv/bin/python
    PATHS=
    ;;
*)
    echo "peer_tests.sh: unknown target $TARGET (patched or mounted)" >&2
    exit 2
    ;;
esac

# Runs pytest on one test file, with extra entries on the path.
run_file() {
    local extra=$1 file=$2
    (cd "$PEER" && PYTHONPATH=$PATHS${PATHS:+:}$extra KERAS_BACKEND=torch \
        OMP_NUM_THREADS=1 timeout 600 "$PYTHON" -m pytest -q \
        -p no:cacheprovider -p no:randomly -W ignore -rA "$file")
}

status=0
run_file "$PEER/stub" distribution_lib_test.py || status=$?
run_file "" torch_distribution_lib_test.py || status=$?
exit $status
