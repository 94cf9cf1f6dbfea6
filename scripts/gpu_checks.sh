#!/usr/bin/env bash
# The GPU checks, in one call, on a machine with one CUDA GPU and a torch
# of its own (run from the repository root there).
#
# The wheels go with the checkout in .whl (see ../shared/gpu/README.md):
# keras==3.15.1, namex, optree, keras-hub==0.32.0 and this package's wheel
# (`python3 -m pip wheel -q --no-deps . -w .whl`). They are installed over
# the machine's Python without dependencies; torch stays the machine's.
#
# The checks, in order; each runs under its own time limit, cut to what is
# left of GPU_CHECKS_SECONDS (default 420) so that the logs always come
# back:
#   two_ranks   two processes on the one GPU, their CUDA tensors' collectives
#               on gloo (KERAS_DTENSOR_CUDA_BACKEND=gloo; NCCL refuses two
#               ranks on one device), run side by side: keras-hub Gemma and
#               Llama (tiny, float32) trained under DataParallel and
#               ModelParallel (1, 2), full and LoRA, against no
#               distribution; greedy generate() under both; and creating a
#               512 MiB sharded embedding (benchmarks/init_memory.py: the
#               peak per process, the values against one process, the log
#               of the full path that CUDA takes);
#   hub_size    one process, Gemma and Llama at hidden 1024,
#               mixed_bfloat16, full fine-tune: step time and peak memory
#               under DataParallel and ModelParallel against no
#               distribution, and a second run without one (how far bf16
#               runs move by themselves);
#   hub_lora    the same with LoRA rank 4;
#   generate    one process, greedy generate() at hidden 1024 under both;
#   hub_jit     the hidden-1024 step with jit_compile=True (first step: the
#               compile time);
#   bench       benchmarks/run.py on one process at hidden 1024 (not run by
#               default);
#   probe       the GPU probe of ../shared/gpu, when .gpu/gpu_probe.py is
#               there (not run by default).
# Logs and reports go to a tarball in $OUT (or /tmp/out); the tables are
# printed.
#
# Environment: GPU_CHECKS picks the checks; GPU_CHECKS_INSTALL=0 skips the
# install.
set -u
export PYTHONUNBUFFERED=1 KERAS_BACKEND=torch
OUT_DIR=${OUT:-/tmp/out}
LOGS=/tmp/gpu_checks
mkdir -p "$OUT_DIR" "$LOGS"
CHECKS=${GPU_CHECKS:-two_ranks hub_size hub_lora generate hub_jit}
DEADLINE=$((SECONDS + ${GPU_CHECKS_SECONDS:-420} - 20))
RUN=(python3 -m torch.distributed.run --standalone --nproc_per_node=1)
RUN2=(python3 -m torch.distributed.run --standalone --nproc_per_node=2)
H1024=(--preset gemma-h1024 --precision mixed_bfloat16)

if [ "${GPU_CHECKS_INSTALL:-1}" != 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl ||
        exit 1
fi
nvidia-smi -L 2>/dev/null
python3 -c "import torch, keras, keras_hub, keras_dtensor
print('torch', torch.__version__, 'keras', keras.__version__,
      'keras-hub', keras_hub.__version__, 'cuda', torch.cuda.is_available())"

# Runs step $1 with time limit $2 (seconds), cut to what is left before
# the deadline: the rest is the command.
step() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped (no time left)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - start)) s (limit $limit)"
}

show() {
    cat "$LOGS/$1.md" 2>/dev/null
}

for check in $CHECKS; do
    case $check in
    two_ranks)
        export KERAS_DTENSOR_CUDA_BACKEND=gloo
        step gpu2_hub 150 "${RUN2[@]}" benchmarks/keras_hub_step.py \
            --preset tiny --modes dp,mp --out "$LOGS" --tag gpu2_hub &
        step gpu2_hub_lora 150 "${RUN2[@]}" benchmarks/keras_hub_step.py \
            --preset tiny --modes dp,mp --lora 4 --out "$LOGS" \
            --tag gpu2_hub_lora &
        step gpu2_generate 150 "${RUN2[@]}" benchmarks/keras_hub_generate.py \
            --preset tiny --models gemma,llama --modes dp,mp \
            --new-tokens 8 --rounds 1 --out "$LOGS" --tag gpu2_generate &
        step gpu2_init 150 python3 benchmarks/init_memory.py \
            --processes 2 --timeout 140 --out "$LOGS" &
        wait
        unset KERAS_DTENSOR_CUDA_BACKEND
        for name in gpu2_hub gpu2_hub_lora gpu2_generate; do show $name; done
        grep -A12 "^.Embedding" "$LOGS/gpu2_init.log" 2>/dev/null
        ;;
    hub_size)
        step hub_size 130 "${RUN[@]}" benchmarks/keras_hub_step.py \
            "${H1024[@]}" --modes none,dp,mp --warmup 3 --steps 8 \
            --out "$LOGS" --tag hub_size
        show hub_size
        ;;
    hub_lora)
        step hub_lora 110 "${RUN[@]}" benchmarks/keras_hub_step.py \
            "${H1024[@]}" --modes dp,mp --lora 4 --warmup 3 --steps 8 \
            --out "$LOGS" --tag hub_lora
        show hub_lora
        ;;
    generate)
        step generate 100 "${RUN[@]}" benchmarks/keras_hub_generate.py \
            "${H1024[@]}" --models gemma,llama --modes dp,mp \
            --new-tokens 16 --rounds 1 --out "$LOGS" --tag generate
        show generate
        ;;
    hub_jit)
        step hub_jit 200 "${RUN[@]}" benchmarks/keras_hub_step.py \
            "${H1024[@]}" --models gemma,llama --modes mp --jit-compile \
            --warmup 3 --steps 8 --out "$LOGS" --tag hub_jit
        show hub_jit
        ;;
    bench)
        step bench 150 "${RUN[@]}" benchmarks/run.py --modes single,dp,tp \
            --hidden 1024 --layers 4 --batch 32 --seq 256 --heads 16 \
            --vocab 8192 --steps 10 --warmup 3 \
            --no-overhead --out "$LOGS" --tag gpu1
        grep -E "^\| (workload|mlp|transformer|llama)[ (]" "$LOGS/gpu1.md" \
            2>/dev/null | cut -c1-240
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
