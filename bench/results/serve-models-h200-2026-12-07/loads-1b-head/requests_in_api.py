"""Requests an API process held, time-averaged, per closed loop of its COPT_API_TRACE file (entered → last event out).

    python3 requests_in_api.py FOLDER [...]     (reads FOLDER/api-trace-*.json[.gz] or FOLDER/traces/api-trace-*)

Loops are found by pauses of more than 1 s between arrivals; each is read over the middle 70% of its span. Clients is
the 99.5th percentile of the requests held; "outside" is what the clients' requests spent beyond the API process per
request (clients - held, over the request rate).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def loops(requests: list) -> list[list]:
    ordered = sorted(r for r in requests if r[0] is not None)
    groups = [[ordered[0]]]
    for request in ordered[1:]:
        if request[0] - groups[-1][-1][0] > 1.0:
            groups.append([request])
        else:
            groups[-1].append(request)
    return [g for g in groups if len(g) >= 50]


def main() -> None:
    for folder in map(Path, sys.argv[1:]):
        traces = sorted(folder.glob("api-trace*")) + sorted(folder.glob("traces/api-trace*"))
        if not traces:
            continue
        print(folder)
        for group in loops(load(traces[0])["requests"]):
            start, end = group[0][0], max(r[5] for r in group)
            times = np.linspace(start + 0.15 * (end - start), end - 0.15 * (end - start), 3000)
            entered = np.array([r[0] for r in group])
            left = np.array([r[5] for r in group])
            held = np.array([((entered <= t) & (left > t)).sum() for t in times])
            rate = len(group) / (end - start)
            clients = int(np.percentile(held, 99.5))
            print(f"  {len(group):5d} requests, {clients:4d} clients: {held.mean():6.1f} held on average, "
                  f"{rate:6.1f} requests/s, outside the API {(clients - held.mean()) / rate * 1e3:6.1f} ms and in it "
                  f"{held.mean() / rate * 1e3:6.1f} ms per request")


if __name__ == "__main__":
    main()
