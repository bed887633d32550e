#!/usr/bin/env bash
# The cpu backend's throughput against PyTorch (bench/README.md). Runs schedrun on bench/small_gpt.sched under
# ddp and zero3 (4 CPU ranks) and bench/torch_step.py on the same model and global batch, interleaved ROUNDS
# times so that both see the same machine load, and prints the median tokens/s of each and their ratios.
#
#   bench/run.sh            # needs: pip install torch (the registry's `torch` package)
#   BASELINE=old/schedrun bench/run.sh    # also an earlier schedrun build, interleaved (an A/B)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
THREADS=${THREADS:-$(nproc)}
cargo build --release -q -p schedrun
out=$(mktemp -d)
for round in $(seq "$ROUNDS"); do
    for s in bench_ddp bench_zero3; do
        # Median over the steps after the first two (warm-up: scratch pools fill, pages fault in).
        ./target/release/schedrun bench/small_gpt.sched --schedule "$s" --steps "$STEPS" --json > "$out/$s.$round.jsonl"
        if [ -n "${BASELINE:-}" ]; then
            "$BASELINE" bench/small_gpt.sched --schedule "$s" --steps "$STEPS" --json > "$out/baseline_$s.$round.jsonl"
        fi
    done
    python3 bench/torch_step.py --threads "$THREADS" --steps $((STEPS - 2)) --warmup 2 > "$out/torch.$round.json" 2>/dev/null
done
python3 - "$out" "$ROUNDS" "${BASELINE:-}" <<'PY'
import json, statistics, sys
out, rounds, baseline = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def sched(name):
    rates, waits = [], []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{out}/{name}.{r}.jsonl")]
        steps = [l for l in lines if "step" in l][2:]
        rates.append(statistics.median(l["tokens_per_s"] for l in steps))
        summary = lines[-1]["summary"]
        compute = [s for s in summary["streams"] if s["name"] == "compute"][0]
        waits.append(compute["waiting_share"])
    return statistics.median(rates), statistics.median(waits)
torch = statistics.median(json.load(open(f"{out}/torch.{r}.json"))["tokens_per_s"] for r in range(1, rounds + 1))
print(f"pytorch (1 process)          {torch:10.0f} tokens/s")
for name in ("bench_ddp", "bench_zero3"):
    rate, wait = sched(name)
    print(f"schedrun {name:<12} 4 ranks {rate:10.0f} tokens/s  ratio {rate / torch:5.2f}  compute stream waiting {100 * wait:4.1f}% of its time")
    if baseline:
        base, _ = sched("baseline_" + name)
        print(f"  baseline {name:<12}       {base:10.0f} tokens/s  ratio {base / torch:5.2f}  this build / baseline {rate / base:4.2f}")
PY
