#!/usr/bin/env bash
# The GPU checklist (runtime/gpu/GPU.md), run on the device machine from the repository root with
# gpu-carry/ carried (runtime/gpu/build.sh makes it). Steps, in order, each logged to $OUT (or
# ./gpu-results): the machine and libraries, the CUDA parity test, the GPT-2-small benchmark
# (schedrun's CUDA backend, then PyTorch eager bf16 on the same GPU), a 2-process run.
# A step that fails is reported and the next still runs; the exit status is the number failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
carry="$PWD/gpu-carry"
results="${OUT:-$PWD/gpu-results}"
mkdir -p "$results"
failed=0
step() { # step NAME SECONDS COMMAND...: runs and logs one step, killed after SECONDS
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit} s): $*" | tee -a "$results/summary.txt"
    local t0=$SECONDS
    if timeout -k 5 "$limit" "$@" >"$results/$name.log" 2>&1; then
        echo "--- $name passed ($((SECONDS - t0)) s)" | tee -a "$results/summary.txt"
    else
        echo "--- $name FAILED ($((SECONDS - t0)) s); tail:" | tee -a "$results/summary.txt"
        failed=$((failed + 1))
    fi
    tail -n 15 "$results/$name.log" | tee -a "$results/summary.txt"
}

[ -x "$carry/bin/schedrun" ] || { echo "no gpu-carry/: run runtime/gpu/build.sh here and carry gpu-carry" >&2; exit 100; }
# The CUDA tests' kernels (each job's PTX, written by build.sh).
export SCHED_PTX_DIR="$carry/ptx"

# cudarc (built for the CUDA 12.4 API) looks for libcublas.so, libnccl.so or the CUDA 12
# sonames; the image's pip wheels hold CUDA 13 (libcublas.so.13, libnccl.so.2, ...). Link the
# unversioned names to them in one folder on LD_LIBRARY_PATH. No NVRTC: the kernels are the PTX
# build.sh wrote, loaded by the driver.
libs="$results/.libs"
mkdir -p "$libs"
site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
for name in cublas cublasLt nccl cudart; do
    found=$(find $site -path '*nvidia*' -name "lib$name.so*" 2>/dev/null | sort | tail -n 1)
    if [ -n "$found" ]; then
        ln -sf "$found" "$libs/lib$name.so"
        echo "lib$name.so -> $found"
    else
        echo "lib$name.so: not found in $site"
    fi
done | tee "$results/libraries.txt"
export LD_LIBRARY_PATH="$libs:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "no GPU here: stopping before the steps that need one (libraries above)" | tee -a "$results/summary.txt"
    exit 101
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$results/gpu.txt"

# The test executable reads schedules from the path it was built at.
built=$(cat "$carry/BUILD_ROOT")
if [ ! -e "$built" ]; then mkdir -p "$(dirname "$built")" && ln -s "$PWD" "$built"; fi

# SCHED_REQUIRE: a parity test that skips for want of a usable GPU fails the step instead. Each
# test in its own process (each_test.sh): a kernel that faults fails only its own test.
SCHED_REQUIRE=gpu step parity "${PARITY_S:-200}" runtime/gpu/each_test.sh "$carry/bin/cuda-tests" --nocapture
SCHED_TRACE_DIR="$results" step gpt2_schedrun "${GPT2_S:-150}" "$carry/bin/cuda-tests" --ignored gpt2_small_step_mfu --nocapture
step gpt2_pytorch "${TORCH_S:-120}" python3 runtime/gpu/torch_gpt2.py --steps 6 --micro-batch 8 --seq 1024
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
    step two_process 120 "$carry/bin/schedrun" "$carry/plans/tiny_two_ranks.plan.json" --backend cuda --nproc-per-node 2 --steps 5
else
    echo "=== two_process: skipped, $gpus GPU (NCCL refuses two ranks on one GPU)" | tee -a "$results/summary.txt"
fi
echo "failed steps: $failed" | tee -a "$results/summary.txt"
exit "$failed"
