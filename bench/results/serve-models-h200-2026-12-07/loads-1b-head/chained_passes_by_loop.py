"""Each closed loop's chained decode passes (chains of 8 or more, no prompt tokens) by decoding rows, against advise's
decode_step for that loop's sampling (64-client plan of the 1B preset on the H200, this run's host probe).

    python3 chained_passes_by_loop.py traces/engine-trace-1435-0.json.gz

The loops in the trace's order: guidellm 64, 256 sampled; profile endpoint 64, 256 sampled (top-p 0.95); guidellm
64, 256 greedy; profile endpoint 64, 256 greedy.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys

from requests_in_api import loops  # this folder: the script's own directory is on sys.path

from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.core.advise.timing import infer_time
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import load_model_spec

LOOPS = ["guidellm 64 sampled", "guidellm 256 sampled", "profile endpoint 64 sampled", "profile endpoint 256 sampled",
         "guidellm 64 greedy", "guidellm 256 greedy", "profile endpoint 64 greedy", "profile endpoint 256 greedy"]


def main() -> None:
    with gzip.open(sys.argv[1], "rt") as handle:
        trace = json.load(handle)
    spec = load_model_spec("llama-3.2-1b")
    for name, group in zip(LOOPS, loops(trace["requests"]), strict=False):  # the same loops as requests_in_api
        start, end = group[0][0], max(r[2] for r in group)
        sampled = name.endswith("sampled")
        plan = InferPlan(batch=64, prompt_len=256, gen_len=128, continuous_batching=True,
                         temperature=1.0 if sampled else 0.0,
                         top_p=0.95 if sampled and name.startswith("profile") else 1.0)
        costs = infer_time(spec, plan, Target(get_gpu("h200"), host_loop_s=14.33e-3)).costs
        bins: dict[int, list[float]] = {}
        for step in trace["steps"]:
            if start <= step[0] <= end and not step[6] and step[4] >= 8:
                bins.setdefault(step[2] // 16 * 16, []).append((step[1] - step[0]) / step[4])
        cells = []
        for rows in sorted(bins):
            if len(bins[rows]) >= 3:
                measured = statistics.median(bins[rows])
                priced = costs.decode_step(rows + 8)
                cells.append(f"rows {rows}-{rows + 15}: {measured * 1e3:.2f} ms ({priced / measured:.2f}, "
                             f"{len(bins[rows])} chains)")
        print(f"{name:30s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
