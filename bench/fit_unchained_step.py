#!/usr/bin/env python3
"""Fit what a decode step of copt's engine that is not chained costs over the chained one
(calibration.UNCHAINED_STEP_S + UNCHAINED_STEP_PER_SEQ_S × rows) from engine step traces (COPT_ENGINE_TRACE, gzipped
as kept with the results). Runs anywhere (no GPU): it reads the traces.

    python3 bench/fit_unchained_step.py TRACE.json.gz:PRESET [...] [--prompt-len 256] [--gpu h200]

Steps used: one decode pass with prompt chunks the prefill graphs take and one decode pass alone. From each step's
measured time it takes advise's price of the step without its unchained cost (timing.ServeCosts of a 256-client
sampled plan of PRESET: the chained decode step and the prefill graph of the step's token bucket), bins the rest by
trace and prompt chunks and by 32 decode rows (bins of 5 steps or more, medians), and fits seconds = a + b × rows by
least squares weighted by √steps.

The graphs are copt serve's on CUDA since c6917de — FlashAttention's variable-length kernel, up to 2,048 tokens in
up to PREFILL_GRAPH_VARLEN_SEGMENTS segments, resumed prompts too — priced as mixed_step prices them. --masked-graphs
reads traces of the engine before it (whole prompts of --prompt-len tokens, at most 8 of them and 1,024 tokens, or one
of up to 2,048, priced as a masked prefill pass).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from engine_trace_report import _costs, _read

from clusteropt_cli.core.serve.runner import (
    PREFILL_GRAPH_BUCKETS,
    PREFILL_GRAPH_MAX_PACKED,
    PREFILL_GRAPH_MAX_TOKENS,
    PREFILL_GRAPH_SEGMENTS,
    PREFILL_GRAPH_VARLEN_SEGMENTS,
)

# the decode step priced as when UNCHAINED_STEP_* were fitted: temperature 1 with top-p 0.95
FIT_TOP_P = 0.95


def residuals(path: str, preset: str, prompt_len: int, gpu: str,
              masked_graphs: bool = False) -> dict[tuple, list[tuple[int, float]]]:
    """(trace, chunks, rows // 32) → [(rows, measured − advise's step without its unchained cost)] of the steps
    described."""
    costs = _costs(preset, prompt_len, gpu, top_p=FIT_TOP_P)
    trace = _read(Path(path))
    bins: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for step in trace["steps"]:
        if step[4] != 1:
            continue
        tokens = step[6]
        chunks = -(-tokens // prompt_len)
        rows = max(1, step[7] - tokens // prompt_len)
        if masked_graphs:
            cap = PREFILL_GRAPH_MAX_TOKENS if chunks == 1 else PREFILL_GRAPH_MAX_PACKED
            graphed = tokens % prompt_len == 0 and chunks <= PREFILL_GRAPH_SEGMENTS and tokens <= cap
        else:
            graphed = chunks <= PREFILL_GRAPH_VARLEN_SEGMENTS and tokens <= PREFILL_GRAPH_MAX_TOKENS
        if chunks and not graphed:
            continue
        rest = step[1] - step[0] - costs.decode_step(rows)
        if chunks and masked_graphs:
            rest -= costs.prefill(next(b for b in PREFILL_GRAPH_BUCKETS if b >= tokens), chunks)
        elif chunks:  # the varlen graph's price: the mixed step less its decode and its unchained cost
            cached = chunks * prompt_len - tokens  # a split prompt's earlier part (exact for --prompt-len prompts)
            step_s, _ = costs.mixed_step(rows, tokens, chunks, max(0, cached), False)
            rest -= step_s - costs.decode_step(rows) - costs.unchained_s(rows)
        bins[(path, chunks, rows // 32)].append((rows, rest))
    return bins


def fit(bins: dict[tuple, list[tuple[int, float]]]) -> tuple[float, float, int]:
    """(a seconds, b seconds per row, steps used) by weighted least squares over the bins' medians."""
    xs, ys, ws, used = [], [], [], 0
    for values in bins.values():
        if len(values) < 5:
            continue
        xs.append(statistics.median(r for r, _ in values))
        ys.append(statistics.median(v for _, v in values))
        ws.append(len(values) ** 0.5)
        used += len(values)
    sw = sum(w * w for w in ws)
    mx = sum(w * w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * w * y for w, y in zip(ws, ys, strict=True)) / sw
    sxx = sum(w * w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    b = sxy / sxx
    return my - b * mx, b, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="TRACE.json[.gz]:PRESET")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--masked-graphs", action="store_true",
                        help="traces of the engine before its varlen prefill graphs (c6917de)")
    args = parser.parse_args()
    bins: dict[tuple, list[tuple[int, float]]] = {}
    for item in args.traces:
        path, _, preset = item.rpartition(":")
        bins.update(residuals(path, preset, args.prompt_len, args.gpu, args.masked_graphs))
    a, b, used = fit(bins)
    print(f"unchained decode step: {a * 1e3:.2f} ms + {b * 1e6:.1f} µs per decoding sequence ({used} steps)")


if __name__ == "__main__":
    main()
