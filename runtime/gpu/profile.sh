#!/usr/bin/env bash
# Where a GPT-2-small step's GPU time goes, kernel by kernel: run on the device machine after
# checklist.sh (same gpu-carry/, same library links), it profiles the first LAUNCHES kernels of
# `gpt2_small_step_mfu` (two steps and more) with Nsight Compute's duration metric only,
# then prints one whole step's launches and kernel time (from one loss sum to the next), the
# total and the kernels that take most of it, grouped by name and launch shape.
# Output: $OUT/profile.txt (or ./gpu-results). The image has ncu but no nsys.
set -uo pipefail
cd "$(dirname "$0")/../.."
carry="$PWD/gpu-carry"
results="${OUT:-$PWD/gpu-results}"
launches="${LAUNCHES:-3500}"
export SCHED_PTX_DIR="$carry/ptx"
export LD_LIBRARY_PATH="$results/.libs:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# The step with the attention kernels only (the benchmark times the chunked path first).
SCHED_GPT2_ATTENTION=kernels timeout 300 "$ncu" --metrics gpu__time_duration.sum -c "$launches" --csv \
    --log-file "$results/ncu.csv" "$carry/bin/cuda-tests" --ignored gpt2_small_step_mfu \
    --nocapture >"$results/profiled_run.log" 2>&1
python3 - "$results/ncu.csv" <<'PY' | tee "$results/profile.txt"
import collections, csv, sys
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
header, by, order = None, collections.defaultdict(lambda: [0, 0.0]), []
for row in csv.reader(open(sys.argv[1])):
    if "Kernel Name" in row:
        header = row
        continue
    if not header or len(row) != len(header):
        continue
    d = dict(zip(header, row))
    if d.get("Metric Name") != "gpu__time_duration.sum":
        continue
    us = float(d["Metric Value"].replace(",", "")) * scale.get(d["Metric Unit"], 1.0)
    key = f'{d["Kernel Name"][:80]} grid{d.get("Grid Size", "")} block{d.get("Block Size", "")}'
    by[key][0] += 1
    by[key][1] += us
    order.append((d["Kernel Name"], us))
# One whole step: from one launch of the loss sum (once per step) to the next.
marks = [i for i, (name, _) in enumerate(order) if name.startswith("add_loss")]
if len(marks) >= 2:
    step = order[marks[0]:marks[1]]
    print(f"one step: {len(step)} launches, {sum(us for _, us in step) / 1e3:.2f} ms of kernel time")
total = sum(v[1] for v in by.values())
print(f"{sum(v[0] for v in by.values())} launches, {total / 1e3:.2f} ms of kernel time")
for key, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"{us / 1e3:10.3f} ms {100 * us / total:5.1f}% {n:5d}x  {key}")
PY
