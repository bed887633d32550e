#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU checklist (checklist.sh) carries to the
# device machine, into gpu-carry/ at the repository root (git-ignored; carry it with the device
# tool): schedrun built with `--features cuda`, the CUDA test executable, each checklist schedule
# compiled here to a plan with its PTX (`schedc compile --emit ptx`), and the PTX of every job the
# CUDA tests run (ptx/), so the device machine needs neither Rust nor LLVM: the CUDA backend loads
# its kernels from that PTX. Needs LLVM 19 (`.ci/llvm-deps` installs it; fails without it). Fails if
# the whole exceeds the carry limit (64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
out="$root/gpu-carry"
rm -rf "$out"
mkdir -p "$out/bin" "$out/plans" "$out/ptx"

# LLVM 19 writes the PTX: without it the CUDA backend has no kernels to load.
bash .ci/llvm-deps >/dev/null 2>&1 || true
if [ ! -x /usr/lib/llvm-19/bin/llvm-config ]; then
    echo "error: LLVM 19 is not installed (bash .ci/llvm-deps): the CUDA backend's kernels are PTX written with it" >&2
    exit 1
fi

cargo build --release -p schedrun --features cuda --bin schedrun
cp target/release/schedrun "$out/bin/"
# The CUDA test executable (its path has a hash: ask cargo for it).
exe=$(cargo test --release -p schedrun --features cuda --test cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
cp "$exe" "$out/bin/cuda-tests"
strip "$out/bin/"*

# Plans and their PTX (sm_80 and sm_90 beside each plan) of the checklist's schedules.
cargo build --release -p schedc --features llvm --bin schedc
target/release/schedc compile schedules/tiny_cpu.sched --emit ptx -o "$out/plans/tiny_cpu.plan.json"
target/release/schedc compile schedules/tiny_cpu_schedules.sched --schedule tiny_two_ranks \
    --emit ptx -o "$out/plans/tiny_two_ranks.plan.json"
# The PTX of every job of the CUDA tests (runtime/tests/cuda.rs builds its plans itself; it reads
# their kernels from $SCHED_PTX_DIR).
SCHED_PTX_DIR="$out/ptx" cargo test -p schedrun --features llvm --test cuda -- \
    --ignored write_the_gpu_tests_ptx --exact --nocapture
for p in "$out"/plans/*.plan.json; do
    for sm in 80 90; do
        [ -s "${p%.plan.json}.sm_$sm.ptx" ] || { echo "error: no sm_$sm PTX beside $p" >&2; exit 1; }
    done
done

# The test executable finds schedules through the manifest path it was built at.
echo "$root" > "$out/BUILD_ROOT"
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || true
size=$(du -sb "$out" | cut -f1)
echo "gpu-carry: $((size / 1024 / 1024)) MiB"
ls -la "$out/bin" "$out/plans" "$out/ptx"
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "error: gpu-carry is over 60 MiB; the device tool carries 64 MiB with the tree" >&2
    exit 1
fi
