#!/usr/bin/env python3
"""Per-phase times of `schedc compile --time-passes`, A/B between builds, on a noisy machine.

    python3 bench/phases.py SCHEDULE ROUNDS SCHEDC_A [SCHEDC_B ...]

Runs each binary ROUNDS times on SCHEDULE, interleaved (A, B, A, B, ...) so that all see the
same load, writing the plan to a temporary file. Prints, for each binary, the median and the
least wall time of the whole command and the median of every phase it reports (`verify`'s
proofs indented under it), and each binary's median wall time as a ratio to the first's.
Nothing to install.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time


def run(binary, schedule, out):
    start = time.perf_counter()
    done = subprocess.run(
        [binary, "compile", schedule, "-o", out, "--time-passes"],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    phases = []
    for line in done.stderr.splitlines():
        name, _, rest = line.rpartition("  ")
        if rest.strip().endswith("ms"):
            phases.append((name.strip(), float(rest.split()[0])))
    return wall, phases


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    schedule, rounds, binaries = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    walls = {b: [] for b in binaries}
    phases = {b: {} for b in binaries}
    order = {b: [] for b in binaries}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        for _ in range(rounds):
            for b in binaries:
                wall, ps = run(b, schedule, out)
                walls[b].append(wall)
                for name, ms in ps:
                    if name not in phases[b]:
                        order[b].append(name)
                    phases[b].setdefault(name, []).append(ms)
    first = statistics.median(walls[binaries[0]])
    for b in binaries:
        med = statistics.median(walls[b])
        print(f"{b}: wall median {med * 1e3:.0f} ms, least {min(walls[b]) * 1e3:.0f} ms "
              f"({med / first:.2f} of the first), {rounds} runs")
        for name in order[b]:
            print(f"  {name:>18}  {statistics.median(phases[b][name]):9.1f} ms")


if __name__ == "__main__":
    main()
