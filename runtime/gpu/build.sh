#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU checklist (checklist.sh) carries to the
# device machine, into gpu-carry/ at the repository root (git-ignored; carry it with the device
# tool): schedrun built with `--features cuda`, the CUDA test executable, and each checklist
# schedule compiled here to a plan with its PTX (`schedc compile --emit ptx`, LLVM 19), so the
# device machine needs neither Rust nor LLVM. Fails if the whole exceeds the carry limit (64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
out="$root/gpu-carry"
rm -rf "$out"
mkdir -p "$out/bin" "$out/plans"

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

# Plans and PTX of the checklist's schedules (PTX only where LLVM 19 is installed).
bash .ci/llvm-deps >/dev/null 2>&1 || true
features=""
[ -x /usr/lib/llvm-19/bin/llvm-config ] && features="--features llvm"
cargo build --release -p schedc $features --bin schedc
emit=plan
[ -n "$features" ] && emit=ptx
target/release/schedc compile schedules/tiny_cpu.sched --emit "$emit" -o "$out/plans/tiny_cpu.plan.json"
target/release/schedc compile schedules/tiny_cpu_schedules.sched --schedule tiny_two_ranks \
    --emit "$emit" -o "$out/plans/tiny_two_ranks.plan.json"

# The test executable finds schedules through the manifest path it was built at.
echo "$root" > "$out/BUILD_ROOT"
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || true
size=$(du -sb "$out" | cut -f1)
echo "gpu-carry: $((size / 1024 / 1024)) MiB"
ls -la "$out/bin" "$out/plans"
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "error: gpu-carry is over 60 MiB; the device tool carries 64 MiB with the tree" >&2
    exit 1
fi
