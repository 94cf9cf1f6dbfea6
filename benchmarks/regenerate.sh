#!/usr/bin/env bash
# Runs again the benchmark configurations whose latest results are kept in
# benchmarks/results/, with the arguments their files record, and writes
# over those files (same tags). Run it from anywhere; it works in the
# repository root.
#
#   benchmarks/regenerate.sh          the CPU configurations (gloo)
#   benchmarks/regenerate.sh gpu      the GPU configurations (one CUDA GPU,
#                                     NCCL; keras-hub installed)
#   benchmarks/regenerate.sh all      both
#
# The tags, and so the file names, are those of the runs the files hold
# (some name the commit first measured); each file's header records the
# command, the machine, its load and the commit actually measured.
# The run.py part of the CPU set took about 11 minutes of wall time on 2
# cores in the recorded runs (the 4-process runs time-share the cores).
# run.py writes <tag>.json and <tag>.md, and <tag>.png where matplotlib
# is installed; peak_memory.py and keras_hub_step.py write .json and .md;
# remat.py writes .json only.
#
# Environment: TORCHRUN (default: torchrun) is the launcher, PYTHON
# (default: python) the interpreter of the scripts that launch their own.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export KERAS_BACKEND=torch
TORCHRUN=${TORCHRUN:-torchrun}
PYTHON=${PYTHON:-python}
OUT=benchmarks/results
FAILED=()

# Runs one configuration: $1 is the tag, the rest the command.
run() {
    local tag=$1
    shift
    echo "=== $tag: $*" >&2
    if ! "$@"; then
        FAILED+=("$tag")
    fi
}

# $1 processes, $2 tag, the rest run.py's arguments.
bench() {
    local nproc=$1 tag=$2
    shift 2
    run "$tag" "$TORCHRUN" --nproc_per_node="$nproc" benchmarks/run.py \
        "$@" --out "$OUT" --tag "$tag"
}

cpu() {
    local dp=(--workload mlp,transformer,llama --modes single,dp --steps 100
        --no-overhead)
    local tp2d=(--workload mlp,transformer,llama --modes single,tp,2d
        --steps 50 --no-overhead)
    # Every workload and mode, with the overhead table at 2 processes.
    bench 2 n2_all_modes_0a03cc5 --steps 20
    bench 4 n4_all_modes_0a03cc5 --steps 20 --no-overhead
    # DataParallel at 1, 2 and 4 processes.
    bench 1 n1_dp_5274e39_run2 "${dp[@]}"
    bench 2 n2_dp_8182f34 "${dp[@]}"
    bench 4 n4_dp_8182f34 "${dp[@]}"
    # Tensor parallel and 2-D at 2 and 4 processes.
    bench 2 n2_tp2d_5274e39 "${tp2d[@]}"
    bench 4 n4_tp2d_5274e39 "${tp2d[@]}"
    # jit_compile=True: the compiled step and its first step.
    bench 2 n2_jit_mlp_8182f34_run2 --workload mlp --modes single,dp \
        --steps 10 --no-overhead --jit
    # Peak memory of one training step, Keras against its native twin.
    run n2_peak_dp_fsdp "$TORCHRUN" --nproc_per_node=2 \
        benchmarks/peak_memory.py --modes dp,fsdp --repeats 9 --out "$OUT" \
        --tag n2_peak_dp_fsdp
    # Activation recomputation (remat_layers), at two sizes.
    run n2_remat_blocks "$TORCHRUN" --nproc_per_node=2 benchmarks/remat.py \
        --modes single,dp,tp,fsdp --steps 40 --out "$OUT" \
        --tag n2_remat_blocks
    run n2_remat_hidden512 "$TORCHRUN" --nproc_per_node=2 \
        benchmarks/remat.py --modes single,dp,tp,fsdp --hidden 512 \
        --seq 128 --batch 16 --steps 10 --out "$OUT" \
        --tag n2_remat_hidden512
    # keras-hub's Gemma and Llama (full: and the Qwen models) under their
    # own maps and the automatic plan (mid preset), beside the native
    # Llama twin under parallelize_module, in the same launch.
    local hub=(benchmarks/keras_hub_step.py --preset mid
        --models gemma,llama,native_llama --modes dp,mp --steps 8 --warmup 3
        --out "$OUT")
    run n2_keras_hub_mid_lora_5da98b9 "$TORCHRUN" --nproc_per_node=2 \
        "${hub[@]}" --lora 4 --repeats 3 --tag n2_keras_hub_mid_lora_5da98b9
    run n2_keras_hub_mid_full_5da98b9 "$TORCHRUN" --nproc_per_node=2 \
        "${hub[@]}" --models gemma,llama,qwen,qwen_moe,qwen3_moe,native_llama \
        --modes dp,mp,auto --repeats 3 --tag n2_keras_hub_mid_full_5da98b9
    run n2_keras_hub_mid_lora_jit_9708d71 "$TORCHRUN" --nproc_per_node=2 \
        benchmarks/keras_hub_step.py --preset mid --models gemma --modes mp \
        --lora 4 --steps 8 --warmup 3 --jit-compile --out "$OUT" \
        --tag n2_keras_hub_mid_lora_jit_9708d71
    # Loading and saving a 1 GiB model by part, on 2 and 4 processes (each
    # script starts its own launches; the .md files are written from the
    # tables they print).
    run load_memory "$PYTHON" benchmarks/load_memory.py --save --out "$OUT"
    run load_memory_gemma "$PYTHON" benchmarks/load_memory.py --model gemma \
        --paths slices --out "$OUT"
    run load_memory_bfloat16 "$PYTHON" benchmarks/load_memory.py \
        --dtype bfloat16 --save --paths slices --out "$OUT"
    run replicated_reads "$PYTHON" benchmarks/replicated_reads.py --out "$OUT"
    # keras-hub's Gemma generate() per token, none against (1, 2), without
    # and with LoRA factors of rank 4, and one all-reduce's latency.
    run n2_keras_hub_generate_7020e75 "$TORCHRUN" --nproc_per_node=2 \
        benchmarks/keras_hub_generate.py --new-tokens 16 --lora 0,4 \
        --out "$OUT" --tag n2_keras_hub_generate_7020e75
}

gpu() {
    local big=(--modes single,dp,tp --hidden 1024 --layers 4 --batch 32
        --seq 256 --heads 16 --vocab 8192 --steps 10 --warmup 3 --no-overhead)
    bench 1 gpu_h100_n1_sgd_9cf1748 "${big[@]}"
    bench 1 gpu_h100_n1_adamw_9cf1748 "${big[@]}" --optimizer adamw
    run gpu_h100_keras_hub_tiny_9cf1748 "$TORCHRUN" --nproc_per_node=1 \
        benchmarks/keras_hub_step.py --preset tiny --out "$OUT" \
        --tag gpu_h100_keras_hub_tiny_9cf1748
    run gpu_h100_keras_hub_h1024_9cf1748_run1 "$TORCHRUN" --nproc_per_node=1 \
        benchmarks/keras_hub_step.py --preset gemma-h1024 \
        --precision mixed_bfloat16 --modes none,dp,mp --warmup 3 --steps 10 \
        --out "$OUT" --tag gpu_h100_keras_hub_h1024_9cf1748_run1
}

case "${1:-cpu}" in
cpu) cpu ;;
gpu) gpu ;;
all)
    cpu
    gpu
    ;;
*)
    echo "usage: $0 [cpu|gpu|all]" >&2
    exit 2
    ;;
esac

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed: ${FAILED[*]}" >&2
    exit 1
fi
