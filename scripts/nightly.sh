#!/usr/bin/env bash
# Runs keras-dtensor's tests against keras-nightly (requirements-nightly.txt).
#
# Usage: scripts/nightly.sh [PYTEST_ARGS ...]
#
# It creates (or reuses) a virtualenv OUTSIDE the checkout with the pins of
# requirements-nightly.txt (keras-nightly, which installs the `keras`
# package, torch and the test requirements) and keras-hub-nightly without
# its dependencies (requirements-keras-hub-nightly.txt), installs
# this checkout into it with `pip install -e . --no-deps` (pyproject says
# keras<3.16), and runs pytest. Without arguments it runs the whole suite:
# the unit tests (keras keras_dtensor) in one pytest run, then each file of
# integration_tests/ in a pytest run of its own, one after the other (they
# launch gloo processes). With arguments, one pytest run of them, e.g.
#   scripts/nightly.sh integration_tests/training_parity_test.py
# It prints one line per test file: PASS or FAIL with the counts.
#
# The version guard (keras_dtensor/_versions.py: SUPPORTED_KERAS, and the
# keras-nightly versions the suite passed on, TESTED_KERAS_NIGHTLY) accepts
# the pinned nightly once it is listed there: then this checkout is tested
# as it is. A nightly it does not list yet (a newer pin, to be tested) is
# tested from a copy in $NIGHTLY_TREE whose TESTED_KERAS_NIGHTLY names it
# (never this checkout); the script says so.
#
# Environment:
#   NIGHTLY_VENV     the virtualenv (default: ${TMPDIR:-/tmp}/keras-nightly-venv);
#                    reused when it holds the pinned keras-nightly.
#   NIGHTLY_TREE     the patched copy (default: ${TMPDIR:-/tmp}/keras-nightly-tree).
#   NIGHTLY_REF      copy this git ref (e.g. HEAD) instead of the working
#                    tree with its uncommitted changes.
#   NIGHTLY_LOGS     logs (default: ${TMPDIR:-/tmp}/keras-nightly-logs).
#   NIGHTLY_TIMEOUT  seconds per pytest run (default 3600).
#   PYTHON           the interpreter that creates the venv (python3).
# Exits non-zero when a test failed or a run did not finish.

set -u -o pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE=${TMPDIR:-/tmp}
VENV=${NIGHTLY_VENV:-$BASE/keras-nightly-venv}
TREE=${NIGHTLY_TREE:-$BASE/keras-nightly-tree}
LOGS=${NIGHTLY_LOGS:-$BASE/keras-nightly-logs}
TIMEOUT=${NIGHTLY_TIMEOUT:-3600}
PYTHON=${PYTHON:-python3}
REQUIREMENTS=$REPO/requirements-nightly.txt
KERAS_HUB_REQUIREMENTS=$REPO/requirements-keras-hub-nightly.txt
export PIP_DISABLE_PIP_VERSION_CHECK=1
export KERAS_BACKEND=torch OMP_NUM_THREADS=1
mkdir -p "$LOGS"

# The pinned keras-nightly version of requirements-nightly.txt.
pinned_version() {
    sed -n 's/^keras-nightly==\([^ ]*\).*/\1/p' "$REQUIREMENTS" | head -n 1
}

# The version of keras (or of $1: torch) installed in the venv, read from
# its version.py so that no mount is involved; nothing when missing.
installed_version() {
    "$VENV/bin/python" -S - "$VENV" "${1:-keras/src}" <<'EOF' 2>/dev/null
import glob
import re
import sys

venv, package = sys.argv[1:]
pattern = f"{venv}/lib/python*/site-packages/{package}/version.py"
for path in glob.glob(pattern):
    match = re.search(r"__version__ = [\"']([^\"']+)", open(path).read())
    if match:
        print(match.group(1))
EOF
}

# The pinned keras-hub-nightly version of requirements-keras-hub-nightly.txt.
pinned_keras_hub() {
    sed -n 's/^keras-hub-nightly==\([^ ]*\).*/\1/p' \
        "$KERAS_HUB_REQUIREMENTS" | head -n 1
}

# Creates the venv, or reuses it when it holds the pinned nightly and
# keras-hub.
make_venv() {
    if [ "$(installed_version)" = "$(pinned_version)" ] &&
        [ "$(installed_version keras_hub/src)" = "$(pinned_keras_hub)" ]; then
        return 0
    fi
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || return 1
    # keras and keras-nightly both install `keras/`: keep only the nightly.
    "$VENV/bin/pip" uninstall -q -y keras >/dev/null 2>&1
    "$VENV/bin/pip" install -q -r "$REQUIREMENTS" || return 1
    # keras-hub and keras-hub-nightly both install `keras_hub/`; their own
    # requirements pull TensorFlow and keras.
    "$VENV/bin/pip" uninstall -q -y keras-hub keras-hub-nightly \
        >/dev/null 2>&1
    "$VENV/bin/pip" install -q --no-deps -r "$KERAS_HUB_REQUIREMENTS" ||
        return 1
    [ "$(installed_version)" = "$(pinned_version)" ]
}

# Whether the guard of checkout $1 accepts keras version $2.
guard_accepts() {
    (cd "$1" && "$VENV/bin/python" -S - "$2" <<'EOF')
import sys

sys.path.insert(0, ".")
from keras_dtensor import _versions  # noqa: E402

sys.exit(not _versions.keras_version_supported(sys.argv[1]))
EOF
}

# Copies the checkout (or $NIGHTLY_REF) to $TREE and adds keras version $1
# to the guard's TESTED_KERAS_NIGHTLY there.
patched_tree() {
    local version=$1
    rm -rf "$TREE" && mkdir -p "$TREE" || return 1
    if [ -n "${NIGHTLY_REF:-}" ]; then
        git -C "$REPO" archive "$NIGHTLY_REF" | tar -x -C "$TREE" || return 1
    else
        (cd "$REPO" && git ls-files -z -co --exclude-standard |
            tar --null --ignore-failed-read -T - -cf - 2>/dev/null) |
            tar -x -C "$TREE" || return 1
    fi
    sed -i "s/^TESTED_KERAS_NIGHTLY = (/TESTED_KERAS_NIGHTLY = (\"$version\", /" \
        "$TREE/keras_dtensor/_versions.py"
    guard_accepts "$TREE" "$version"
}

# Installs checkout $1 editable into the venv unless it is there already.
install_checkout() {
    local where
    where=$(cd / && "$VENV/bin/python" -c "import keras_dtensor, os
print(os.path.dirname(os.path.dirname(keras_dtensor.__file__)))" \
        2>/dev/null | tail -n 1)
    if [ "$where" != "$1" ]; then
        "$VENV/bin/pip" install -q --no-deps -e "$1" || return 1
    fi
}

# Prints "PASS|FAIL <file>: counts" per test file of pytest log $1 (-rA).
per_file_summary() {
    "$VENV/bin/python" -S - "$1" <<'EOF'
import collections
import re
import sys

counts = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1], errors="replace"):
    match = re.match(r"(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S+?)(::|\s|$)", line)
    if match:
        counts[match.group(2)][match.group(1).lower()] += 1
        continue
    match = re.match(r"SKIPPED \[(\d+)\] (\S+?):\d+", line)
    if match:
        counts[match.group(2)]["skipped"] += int(match.group(1))
for path in sorted(counts):
    c = counts[path]
    status = "FAIL" if c["failed"] or c["error"] else "PASS"
    text = ", ".join(f"{n} {k}" for k, n in sorted(c.items()))
    print(f"{status} {path}: {text}")
EOF
}

# Runs pytest with the given arguments from checkout $1, logging to $2.
run_pytest() {
    local tree=$1 log=$2
    shift 2
    (cd "$tree" && timeout "$TIMEOUT" "$VENV/bin/python" -m pytest -q -rA \
        -p no:randomly -W ignore --continue-on-collection-errors "$@") \
        >"$log" 2>&1
    local status=$?
    per_file_summary "$log"
    echo "   pytest: $(tail -n 1 "$log" | tr -d '=') (exit $status; log $log)"
    return $status
}

main() {
    local version tree=$REPO failed=0
    echo "== venv $VENV" >&2
    make_venv >"$LOGS/install.log" 2>&1 || {
        echo "FAIL install, see $LOGS/install.log"
        return 2
    }
    version=$(installed_version)
    echo "== keras $version, torch $(installed_version torch)" >&2
    if ! guard_accepts "$REPO" "$version"; then
        patched_tree "$version" || {
            echo "FAIL copying and patching $TREE"
            return 2
        }
        tree=$TREE
        echo "== NOTE: the guard does not list keras $version; testing" \
            "a copy in $tree whose TESTED_KERAS_NIGHTLY does (this" \
            "checkout is unchanged)" >&2
    fi
    install_checkout "$tree" >>"$LOGS/install.log" 2>&1 || {
        echo "FAIL pip install -e $tree, see $LOGS/install.log"
        return 2
    }
    if [ $# -gt 0 ]; then
        echo "== pytest $*" >&2
        run_pytest "$tree" "$LOGS/pytest.log" "$@" || failed=1
        return $failed
    fi
    echo "== unit tests" >&2
    run_pytest "$tree" "$LOGS/unit.log" keras keras_dtensor || failed=1
    local test_file name
    for test_file in "$tree"/integration_tests/*_test.py; do
        name=$(basename "$test_file" .py)
        echo "== integration_tests/$name.py" >&2
        run_pytest "$tree" "$LOGS/$name.log" \
            "integration_tests/$name.py" || failed=1
    done
    return $failed
}

main "$@"
