"""Where a lone streamed request's time to first token went in copt serve (no other request in the API process during
its span), from the API and engine traces of a results folder: medians in ms.

    python3 lone-requests.py FOLDER [...]
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def main() -> None:
    for folder in map(Path, sys.argv[1:]):
        api = load(next(folder.rglob("api-trace*")))
        engine = {r[5]: r for r in load(next(folder.rglob("engine-trace*")))["requests"]}
        ordered = sorted(r for r in api["requests"] if r[0] is not None)
        lone = [r for i, r in enumerate(ordered)
                if (i == 0 or ordered[i - 1][5] < r[0]) and (i + 1 == len(ordered) or ordered[i + 1][0] > r[5])]
        parts: dict[str, list[float]] = {name: [] for name in (
            "body", "parse", "encode", "to submit", "submit → engine", "engine TTFT", "engine → API", "API out",
            "server TTFT")}
        for r in lone:
            e = engine.get(r[6])
            if e is None or r[7] is None:
                continue
            for name, seconds in zip(parts, (r[7] - r[0], r[8] - r[7], r[9] - r[8], r[1] - r[9], e[0] - r[1],
                                             e[1] - e[0], r[2] - e[1], r[3] - r[2], r[3] - r[0]), strict=True):
                parts[name].append(seconds)
        print(f"{folder}: {len(parts['server TTFT'])} lone requests")
        print("  " + ", ".join(f"{name} {statistics.median(v) * 1e3:.2f}" for name, v in parts.items() if v))


if __name__ == "__main__":
    main()
