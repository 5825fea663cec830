#!/usr/bin/env python3
"""The LM head of a decode step written as float32 logits, two ways, each timed as a CUDA graph on a 128,256-token
vocabulary (the Llama-3 shapes) at 1-256 rows: the bf16 GEMM then a copy into the float32 logits buffer (copt serve's
decode graphs before), against one GEMM that writes float32 (`torch.mm(..., out_dtype=torch.float32, out=...)`), and
the largest difference between their logits.

    python3 bench/gpu_lm_head.py --out $OUT/lm_head.json       (~20 s on an H100; needs CUDA)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import time_graph  # noqa: E402

VOCAB = 128256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,16,64,128,256")
    parser.add_argument("--hidden", default="2048,4096")
    args = parser.parse_args()

    import torch

    report: dict = {"bench": "gpu_lm_head", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "vocab": VOCAB, "cases": []}
    for hidden in (int(h) for h in args.hidden.split(",")):
        weight = torch.randn(VOCAB, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
        for rows in (int(r) for r in args.rows.split(",")):
            states = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            copied = torch.empty(rows, VOCAB, device="cuda", dtype=torch.float32)
            direct = torch.empty_like(copied)
            copy_s, copy_mode = time_graph(
                lambda s=states, w=weight, o=copied: o.copy_(torch.nn.functional.linear(s, w)), "cuda", 200)
            direct_s, direct_mode = time_graph(
                lambda s=states, w=weight, o=direct: torch.mm(s, w.t(), out_dtype=torch.float32, out=o), "cuda", 200)
            case = {"hidden": hidden, "rows": rows, "gemm_then_copy_us": round(copy_s * 1e6, 1),
                    "fp32_out_gemm_us": round(direct_s * 1e6, 1), "modes": [copy_mode, direct_mode],
                    "max_abs_diff": float((copied - direct).abs().max()),
                    "logit_scale": float(direct.abs().max())}
            report["cases"].append(case)
            print(f"h {hidden:5d} rows {rows:4d}: gemm+copy {case['gemm_then_copy_us']:8.1f} µs  fp32-out gemm "
                  f"{case['fp32_out_gemm_us']:8.1f} µs  max |diff| {case['max_abs_diff']:.3g} "
                  f"(of {case['logit_scale']:.3g})", flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
