#!/bin/sh
# Seeds the fuzz corpora (gitignored): every example schedule and test input for `check` and
# `fmt`; for `plan`, the plan file of every schedule of the small examples (compiled here with
# schedc) and the stored plan reproducers.
# Usage: fuzz/seed.sh   (from anywhere)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
for target in check fmt; do
    mkdir -p "$here/corpus/$target"
    find "$repo/schedules" "$repo/tests/inputs" -name '*.sched' -type f | while read -r f; do
        # Flatten the path into a unique file name: schedules/models/llama.sched -> schedules_models_llama.sched
        name=$(printf '%s' "${f#"$repo"/}" | tr '/' '_')
        cp "$f" "$here/corpus/$target/$name"
    done
done
echo "seeded $(ls "$here/corpus/check" | wc -l) files into $here/corpus/{check,fmt}"

# Plans: the small examples only (the LLaMA ones are megabytes of JSON, slow to fuzz).
plans="$here/corpus/plan"
mkdir -p "$plans"
cargo build -q --manifest-path "$repo/Cargo.toml" -p schedc --bin schedc
schedc="${CARGO_TARGET_DIR:-$repo/target}/debug/schedc"
for f in tiny_cpu tiny_cpu_schedules gpt2_ddp; do
    "$schedc" check "$repo/schedules/$f.sched" | cut -d: -f1 | while read -r s; do
        "$schedc" compile "$repo/schedules/$f.sched" --schedule "$s" -o "$plans/${f}_$s.plan.json" 2>/dev/null ||
            { echo "seed.sh: schedule $s of $f.sched does not compile" >&2; exit 1; }
    done
done
cp "$repo"/tests/inputs/fuzz_plan/* "$plans/"
echo "seeded $(ls "$plans" | wc -l) files into $plans"
