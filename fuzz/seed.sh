#!/bin/sh
# Seeds the fuzz corpora (gitignored) with every example schedule and test input.
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
