#!/usr/bin/env python3
"""Host CPU beside a GPU run: every --interval seconds one JSON line with time.perf_counter() (CLOCK_MONOTONIC, the
clock of the engine traces, so samples line up with a trace's steps), the busy cores, the mean and highest core MHz
/proc/cpuinfo reports, and the busiest processes (CPU in cores, name, command line). Runs until killed.

    python3 bench/host_sampler.py host.jsonl & SAMPLER=$!; ...the run...; kill $SAMPLER

Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def cpu_times() -> tuple[int, int]:
    """(all jiffies, idle + iowait jiffies) since boot, every core."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def processes() -> dict[str, tuple[int, str, str]]:
    """pid → (user + system jiffies, name, command line) of every process readable now."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out[pid] = (int(fields[11]) + int(fields[12]), name, command[:120])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            pass
    return out


def core_mhz() -> tuple[int | None, int | None]:
    try:
        values = [float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
        return round(sum(values) / len(values)), round(max(values))
    except (OSError, ValueError, ZeroDivisionError):
        return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=8, help="processes per sample")
    args = parser.parse_args()
    hz = os.sysconf("SC_CLK_TCK")
    cores = os.cpu_count() or 1
    then, (total_then, idle_then), procs_then = time.perf_counter(), cpu_times(), processes()
    with args.out.open("w") as out:
        while True:
            time.sleep(args.interval)
            now, (total, idle), procs = time.perf_counter(), cpu_times(), processes()
            busy = cores * (1 - (idle - idle_then) / max(1, total - total_then))
            shares = sorted(((procs[p][0] - procs_then[p][0]) / hz / (now - then), procs[p][1], procs[p][2])
                            for p in procs if p in procs_then)
            mean_mhz, max_mhz = core_mhz()
            out.write(json.dumps({"t": round(now, 3), "busy_cores": round(busy, 2), "mhz_mean": mean_mhz,
                                  "mhz_max": max_mhz,
                                  "top": [[round(c, 2), n, cmd] for c, n, cmd in shares[::-1][: args.top] if c > 0.05]})
                      + "\n")
            out.flush()
            then, total_then, idle_then, procs_then = now, total, idle, procs


if __name__ == "__main__":
    main()
