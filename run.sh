#!/usr/bin/env bash
# Sets up what is missing, then trains the main example or runs the tests.
#
#   ./run.sh example [ARGS...]  train examples/transformer_2d.py with
#                               torchrun on CPU/gloo: 4 processes, or 2 on a
#                               machine with fewer than 4 cores; ARGS go to
#                               the example (e.g. --steps 2)
#   ./run.sh test [ARGS...]     run the whole test suite (python -m pytest
#                               -q ARGS...); exits with pytest's status
#   ./run.sh setup [test]       only set up the environment
#
# Setup: a virtual environment (.venv in the checkout unless
# KERAS_DTENSOR_VENV names another), the pinned runtime (requirements.txt)
# and this package, editable; for `test` also requirements-test.txt and
# keras-hub without its dependencies (requirements-keras-hub.txt). Each step
# leaves a stamp of its files' contents in the environment and is skipped
# while the stamp is unchanged, so a second run starts within seconds.
#
# Environment variables:
#   KERAS_DTENSOR_VENV    the virtual environment to use (default: .venv)
#   KERAS_DTENSOR_PYTHON  the Python that creates it (default: python3)
#   KERAS_DTENSOR_NPROC   number of example processes (default: 4, or 2)
#   KERAS_DTENSOR_SETUP   0: use the environment as it is, install nothing
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${KERAS_DTENSOR_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

# Prints a progress line on stderr.
say() {
    echo "run.sh: $*" >&2
}

# Prints a hash of the checkout's path and the named files' contents.
stamp_of() {
    (cd "$ROOT" && { echo "$ROOT"; cat -- "$@"; }) | cksum
}

# Runs the install command "$@" unless the stamp NAME holds the hash of
# FILES; writes the stamp after a successful install.
install_once() {
    local name="$1" files="$2"
    shift 2
    local stamp_file="$VENV/keras-dtensor-$name.stamp" stamp
    # shellcheck disable=SC2086
    stamp="$(stamp_of $files)"
    if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
        say "$name: up to date in $VENV"
        return
    fi
    say "$name: installing into $VENV"
    (cd "$ROOT" && "$@")
    echo "$stamp" >"$stamp_file"
}

# Creates the virtual environment if it has no Python.
create_venv() {
    if [[ -x "$PY" ]]; then
        return
    fi
    local python="${KERAS_DTENSOR_PYTHON:-python3}"
    say "creating the virtual environment $VENV with $python"
    if ! "$python" -m venv "$VENV"; then
        say "could not create $VENV; on Debian/Ubuntu install python3-venv"
        exit 1
    fi
    "$PY" -m pip install -q --upgrade pip
}

# Installs the pinned runtime and this package (editable).
install_runtime() {
    "$PY" -m pip install -q -r requirements.txt
    "$PY" -m pip install -q -e .
}

# Installs the test dependencies, and keras-hub without its own.
install_test() {
    "$PY" -m pip install -q -r requirements-test.txt
    "$PY" -m pip install -q --no-deps -r requirements-keras-hub.txt
}

# Sets up the environment for $1 (example or test).
setup() {
    if [[ "${KERAS_DTENSOR_SETUP:-1}" == 0 ]]; then
        if [[ ! -x "$PY" ]]; then
            say "KERAS_DTENSOR_SETUP=0, but $VENV has no bin/python"
            exit 1
        fi
        say "KERAS_DTENSOR_SETUP=0: using $VENV as it is"
        return
    fi
    create_venv
    install_once runtime "requirements.txt pyproject.toml" install_runtime
    if [[ "$1" == test ]]; then
        install_once test \
            "requirements-test.txt requirements-keras-hub.txt" install_test
    fi
}

# Prints the number of example processes: 4, or 2 below 4 cores.
example_processes() {
    if [[ -n "${KERAS_DTENSOR_NPROC:-}" ]]; then
        echo "$KERAS_DTENSOR_NPROC"
        return
    fi
    # GNU nproc honours OMP_NUM_THREADS; count the usable cores instead.
    local cores
    cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
    if ((cores >= 4)); then echo 4; else echo 2; fi
}

# Trains examples/transformer_2d.py on gloo processes.
run_example() {
    local nproc
    nproc="$(example_processes)"
    say "training examples/transformer_2d.py on $nproc gloo processes"
    cd "$ROOT"
    KERAS_BACKEND=torch exec "$PY" -m torch.distributed.run \
        --standalone --nproc_per_node="$nproc" \
        examples/transformer_2d.py "$@"
}

# Runs the whole test suite with pytest's exit status.
run_tests() {
    cd "$ROOT"
    exec "$PY" -m pytest -q "$@"
}

main() {
    local command="${1:-}"
    shift || true
    case "$command" in
    example)
        setup example
        run_example "$@"
        ;;
    test)
        setup test
        run_tests "$@"
        ;;
    setup)
        setup "${1:-example}"
        ;;
    *)
        sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
        exit 2
        ;;
    esac
}

main "$@"
