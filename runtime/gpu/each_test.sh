#!/usr/bin/env bash
# each_test.sh TESTS_EXE [ARGS...]: runs every (non-ignored) test of a Rust test executable in its
# own process, ARGS passed to each, so that a CUDA error that poisons one process's context (an
# illegal address in a kernel never run on a GPU before) fails only the test that caused it.
# Prints each test's verdict and, last, the failed ones; exits with how many failed.
set -uo pipefail
exe=$1
shift
failed=()
for t in $("$exe" --list 2>/dev/null | sed -n 's/: test$//p'); do
    # An ignored test (the benchmarks) reports itself ignored: cheap, and keeps the list honest.
    echo "=== $t"
    if "$exe" --exact "$t" "$@"; then
        echo "--- ok: $t"
    else
        echo "--- FAILED: $t"
        failed+=("$t")
    fi
done
echo "tests failed: ${#failed[@]}${failed[*]:+ (${failed[*]})}"
exit "${#failed[@]}"
