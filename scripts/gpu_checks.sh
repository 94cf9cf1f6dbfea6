#!/usr/bin/env bash
# The GPU checks, in one call, on a machine with one CUDA GPU and a torch
# of its own (run from the repository root there).
#
# The wheels go with the checkout in .whl (see ../shared/gpu/README.md):
# keras==3.15.1, namex, optree, keras-hub==0.32.0 and this package's wheel
# (`python3 -m pip wheel -q --no-deps . -w .whl`). They are installed over
# the machine's Python without dependencies; torch stays the machine's.
#
# In order of priority, each under its own time limit:
#   1. keras-hub Gemma and Llama, tiny, float32, with the default attention
#      kernels: no distribution, DataParallel and ModelParallel (1, 1) with
#      their own layout maps (benchmarks/keras_hub_step.py);
#   2. the same models at hidden 1024 (the keras-hub issue's size),
#      mixed_bfloat16: step time and peak memory against no distribution,
#      and a second run without one (how far bf16 runs move by themselves);
#   3. benchmarks/run.py on one process at hidden 1024 (single, dp, tp;
#      SGD with momentum);
#   4. the same with AdamW (bench_adamw; not run by default);
#   5. the GPU probe of ../shared/gpu, when .gpu/gpu_probe.py is there.
# Logs and reports go to a tarball in $OUT (or /tmp/out); the tables are
# printed.
#
# Environment: GPU_CHECKS (default "hub_tiny hub_size bench probe") picks
# the steps; GPU_CHECKS_INSTALL=0 skips the install.
set -u
export PYTHONUNBUFFERED=1 KERAS_BACKEND=torch
OUT_DIR=${OUT:-/tmp/out}
LOGS=/tmp/gpu_checks
mkdir -p "$OUT_DIR" "$LOGS"
CHECKS=${GPU_CHECKS:-hub_tiny hub_size bench probe}
RUN=(python3 -m torch.distributed.run --nproc_per_node=1)

if [ "${GPU_CHECKS_INSTALL:-1}" != 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl ||
        exit 1
fi
nvidia-smi -L 2>/dev/null
python3 -c "import torch, keras, keras_hub, keras_dtensor
print('torch', torch.__version__, 'keras', keras.__version__,
      'keras-hub', keras_hub.__version__, 'cuda', torch.cuda.is_available())"

# Runs step $1 with time limit $2 (seconds): the rest is the command.
step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - start)) s"
}

for check in $CHECKS; do
    case $check in
    hub_tiny)
        step hub_tiny 100 "${RUN[@]}" benchmarks/keras_hub_step.py \
            --preset tiny --out "$LOGS" --tag hub_tiny
        cat "$LOGS/hub_tiny.md" 2>/dev/null
        ;;
    hub_size)
        step hub_size 130 "${RUN[@]}" benchmarks/keras_hub_step.py \
            --preset gemma-h1024 --precision mixed_bfloat16 --modes none,dp,mp \
            --warmup 3 --steps 10 --out "$LOGS" --tag hub_size
        cat "$LOGS/hub_size.md" 2>/dev/null
        ;;
    bench)
        step bench 150 "${RUN[@]}" benchmarks/run.py --modes single,dp,tp \
            --hidden 1024 --layers 4 --batch 32 --seq 256 --heads 16 \
            --vocab 8192 --steps 10 --warmup 3 \
            --no-overhead --out "$LOGS" --tag gpu1
        grep -E "^\| (workload|mlp|transformer|llama)[ (]" "$LOGS/gpu1.md" \
            2>/dev/null | cut -c1-240
        ;;
    bench_adamw)
        step bench_adamw 120 "${RUN[@]}" benchmarks/run.py \
            --modes single,dp,tp --hidden 1024 --layers 4 --batch 32 \
            --seq 256 --heads 16 --vocab 8192 --optimizer adamw --steps 10 \
            --warmup 3 --no-overhead --out "$LOGS" --tag gpu1_adamw
        grep -E "^\| (workload|mlp|transformer|llama)[ (]" \
            "$LOGS/gpu1_adamw.md" 2>/dev/null | head -10 | cut -c1-240
        ;;
    probe)
        if [ -f .gpu/gpu_probe.py ]; then
            step probe 90 "${RUN[@]}" .gpu/gpu_probe.py
            grep -E "^(PASS|FAIL|SUMMARY)" "$LOGS/probe.log" | cut -c1-300
        fi
        ;;
    esac
done
for log in "$LOGS"/*.log; do
    if grep -qE "Error|Traceback" "$log"; then
        echo "=== errors in $(basename "$log")"
        grep -E "^[A-Za-z.]*(Error|Exception)\b" "$log" | sort | uniq -c |
            head -8 | cut -c1-400
    fi
done
tar czf "$OUT_DIR/gpu_checks.tgz" -C "$LOGS" .
