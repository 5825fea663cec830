#!/usr/bin/env python3
"""The top-k values behind copt serve's TOP_K sampling thresholds, each variant timed as a CUDA graph on a
128,256-token vocabulary (the Llama-3 shapes) at 1, 8 and 64 rows: the two-pass Triton top-k of
clusteropt_cli/core/serve/topk_kernel.py (K = 64, the piece width CHUNK) against torch.topk(64) and the stable sort
the sampler used for one row before, and whether the Triton values equal torch.topk's (rows with -inf and ties).

    python3 bench/gpu_topk.py --out $OUT/topk.json       (~20 s on the H200; needs CUDA and Triton)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 128256


def timed(fn, iters: int = 200) -> float:  # noqa: ANN001
    """µs per call of fn replayed as a CUDA graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(1000 * start.elapsed_time(end) / iters, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from clusteropt_cli.core.serve import topk_kernel as tk

    report: dict = {"bench": "gpu_topk", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "kernel_error": tk.kernel_error(), "chunk": tk.CHUNK, "rows": {}}
    for rows in (1, 8, 64):
        x = torch.randn(rows, VOCAB, device="cuda") * 3
        x[0, :1000] = float("-inf")
        x[-1, 5:40] = x[-1, 3]
        out = {"triton_equals_torch": bool(torch.equal(tk._triton_top_values(x, 64), x.topk(64, -1).values)),
               "triton_top64_us": timed(lambda x=x: tk._triton_top_values(x, 64)),
               "torch_topk64_us": timed(lambda x=x: x.topk(64, -1)),
               "torch_topk1024_us": timed(lambda x=x: x.topk(1024, -1)),
               "stable_sort_us": timed(lambda x=x: x.sort(dim=-1, descending=True, stable=True))}
        report["rows"][rows] = out
        print(rows, out, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
