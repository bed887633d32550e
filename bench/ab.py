"""Interleaved A/B of schedrun builds on the throughput benchmark (bench/README.md).

Runs each binary on bench/small_gpt.sched's SCHEDULE for 12 steps, ROUNDS times, interleaved so that all see
the same machine load; a run's rate is the median tokens/s of its steps after the first two (warm-up), and
each binary's figure the median of its runs. Prints each binary's figure and its ratio to the first.

    python3 bench/ab.py bench_ddp 5 old/schedrun target/release/schedrun

Finer than `BASELINE=... bench/run.sh` for a change of a few percent: more steps per run, no PyTorch between.
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

SCHED = Path(__file__).resolve().parent / "small_gpt.sched"


def rate(binary, schedule):
    out = subprocess.run(
        [binary, str(SCHED), "--schedule", schedule, "--steps", "12", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout
    steps = [json.loads(line) for line in out.splitlines() if '"step"' in line][2:]
    return statistics.median(s["tokens_per_s"] for s in steps)


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    schedule, rounds, binaries = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    rates = {b: [] for b in binaries}
    for _ in range(rounds):
        for b in binaries:
            rates[b].append(rate(b, schedule))
    base = statistics.median(rates[binaries[0]])
    for b in binaries:
        m = statistics.median(rates[b])
        runs = ", ".join(f"{r:.0f}" for r in rates[b])
        print(f"{schedule} {b}: {m:.0f} tokens/s, x{m / base:.3f} (runs: {runs})")


if __name__ == "__main__":
    main()
