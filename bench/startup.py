"""Cold start of `copt --help` and `copt advise --help`, against a bare `python -c pass` in the same run.

    python bench/startup.py [--runs 15] [--out bench/results/startup.json]

Target (issue 2): ≤ 0.3 s median for `copt --help` on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], runs: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "0"}
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cases = {
        "python -c pass (baseline)": [sys.executable, "-c", "pass"],
        "copt --help": [sys.executable, "-m", "clusteropt_cli", "--help"],
        "copt advise --help": [sys.executable, "-m", "clusteropt_cli", "advise", "--help"],
        "copt --version": [sys.executable, "-m", "clusteropt_cli", "--version"],
    }
    timed(cases["copt --help"], 2)  # warm the bytecode cache, not the process
    results = {}
    base = None
    for name, cmd in cases.items():
        samples = timed(cmd, args.runs)
        median = statistics.median(samples)
        base = base or median
        results[name] = {"median_s": round(median, 4), "min_s": round(min(samples), 4),
                         "max_s": round(max(samples), 4), "ratio_to_baseline": round(median / base, 2)}
        print(f"{name:32s} median {median * 1000:7.1f} ms  ({median / base:4.1f}x python -c pass)")
    record = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().machine, "cpus": os.cpu_count(),
              "runs": args.runs, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
