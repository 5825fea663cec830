#!/usr/bin/env python3
"""Fit the GPU time of copt serve's decode step by part — GEMMs, attention, the rest — from the kernel profiles of
`bench/gpu_moe_decode.py --kernels` (dense shapes, several prompt lengths and row counts), and price each step as the
sum of its parts plus the host's gap per pass. Runs anywhere (no GPU): it reads the reports.

    python3 bench/fit_decode_parts.py FIT.json [FIT.json ...] [--check OTHER.json ...]

The parts, per decode step of L layers, hidden width h, `rows` rows at context c (prompt + half the new tokens):
  GEMMs      n_gemm · t_launch + weights / (bandwidth · e_w) + k · rows · 2 · matmul params / peak
             (n_gemm = 4 per layer + the LM head: fused QKV, O, fused gate-up, down)
  attention  L · a_layer + KV cache read / (bandwidth · e_kv)
  the rest   L · o_layer + rows · (o_row + L · h · o_width)
Each is fitted by least squares on relative error (every step weighs the same). --check prices the steps of other
reports (another GPU: its catalog bandwidth) with the constants fitted here. advise's own price of each step (the one
gpu_moe_decode.py recorded) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# what a report's rounds decode per request (gpu_moe_decode.py --new-tokens' default): the mean context adds half
NEW_TOKENS = 64


def decode_points(report: dict) -> list[dict]:
    """One point per (case, batch) of a gpu_moe_decode.py report with CUDA graphs: the shape's spec, rows, mean
    context, the measured ms per pass (the step trace's decode pass, else the round's ms per step), advise's price
    and, where the case was profiled, the GPU µs per step by part."""
    from clusteropt_cli.modelspec import load_model_spec

    points = []
    for case in report["cases"]:
        if not case.get("graphs"):
            continue
        spec = load_model_spec(report["configs"][case["shape"]])
        for batch, step in case["per_batch"].items():
            parts = (case.get("kernels") or {}).get(batch, {}).get("decode_per_step")
            points.append({"shape": case["shape"], "spec": spec, "rows": int(batch),
                           "prompt_len": case.get("prompt_len", 16),
                           "context": case.get("prompt_len", 16) + NEW_TOKENS // 2,
                           "measured_ms": step.get("decode_ms_per_pass") or step["ms_per_step"],
                           "advise_ms": step.get("advise_ms_per_step"), "parts_us": parts})
    return points


def features(point: dict, bandwidth: float, peak: float) -> dict[str, list[float]]:
    """Each part's regressors (µs) for one point."""
    spec, rows = point["spec"], point["rows"]
    layers = spec.num_layers
    weights = 2.0 * spec.matmul_params_active  # bf16: what the GEMMs read (an untied input embedding is a lookup)
    kv = rows * spec.kv_cache_bytes_per_token(2) * point["context"]
    return {"gemm": [4 * layers + 1, weights / bandwidth * 1e6, rows * weights / peak * 1e6],
            "attention": [layers, kv / bandwidth * 1e6],
            "other": [layers, rows, rows * layers * spec.hidden_size / 1e3]}


def fit_parts(points: list[dict], bandwidth: float, peak: float) -> dict[str, list[float]]:
    """Least squares on relative error, per part, over the points that carry a profile."""
    import numpy as np

    profiled = [p for p in points if p["parts_us"]]
    fitted = {}
    for part in ("gemm", "attention", "other"):
        regressors = np.array([features(p, bandwidth, peak)[part] for p in profiled])
        measured = np.array([p["parts_us"][f"{part}_us"] for p in profiled])
        fitted[part], *_ = np.linalg.lstsq(regressors / measured[:, None], np.ones(len(measured)), rcond=None)
        fitted[part] = [float(c) for c in fitted[part]]
    return fitted


def host_gap_ms(points: list[dict]) -> float:
    """The median of (measured pass - the profile's GPU time per step) at batch 1: the host's gap per pass."""
    import statistics

    gaps = [p["measured_ms"] - sum(p["parts_us"][f"{k}_us"] for k in ("gemm", "attention", "other")) / 1e3
            for p in points if p["parts_us"] and p["rows"] == 1]
    return statistics.median(gaps)


def price_ms(point: dict, fitted: dict[str, list[float]], gap_ms: float, bandwidth: float, peak: float) -> dict:
    """A point's parts (µs) and its pass (ms) under the fitted constants."""
    parts = {part: sum(c * x for c, x in zip(fitted[part], xs, strict=True))
             for part, xs in features(point, bandwidth, peak).items()}
    return {"parts_us": parts, "pass_ms": sum(parts.values()) / 1e3 + gap_ms}


def describe(fitted: dict[str, list[float]], gap_ms: float) -> str:
    (launch, per_w, share), (layer_a, per_kv), (layer_o, row, width) = (fitted["gemm"], fitted["attention"],
                                                                        fitted["other"])
    return (f"GEMMs: {launch:.2f} µs per launch, weights at {1 / per_w:.3f} of bandwidth, {share:.3f} of rows' "
            f"FLOPs at peak; attention: {layer_a:.2f} µs per layer, cache at {1 / per_kv:.3f} of bandwidth; the "
            f"rest: {layer_o:.2f} µs per layer, {row:.3f} µs per row, {width * 1e3:.2f} ns per row, layer and 1k "
            f"of width; host gap {gap_ms:.3f} ms per pass")


def main() -> None:
    from clusteropt_cli.hardware import match_catalog

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="gpu_moe_decode.py --kernels reports to fit on")
    parser.add_argument("--check", nargs="*", type=Path, default=[], help="reports to price with the fit")
    args = parser.parse_args()

    def gpu_of(report: dict) -> tuple[float, float]:
        gpu = match_catalog(report["device"])
        if gpu is None:
            parser.error(f"{report['device']}: not in copt's GPU catalog")
        return gpu.hbm_bandwidth, gpu.peak_flops("bf16")

    reports = [json.loads(path.read_text()) for path in args.reports]
    bandwidth, peak = gpu_of(reports[0])
    if any(gpu_of(r) != (bandwidth, peak) for r in reports):
        parser.error("fit on reports of one GPU; price the others with --check")
    points = [p for r in reports for p in decode_points(r)]
    fitted, gap = fit_parts(points, bandwidth, peak), host_gap_ms(points)
    print(describe(fitted, gap))
    for path, report in [*zip(args.reports, reports, strict=True),
                         *((p, json.loads(p.read_text())) for p in args.check)]:
        bw, pk = gpu_of(report)
        print(f"{path} ({report['device']}): shape prompt rows  measured ms  parts ÷ measured  advise ÷ measured")
        for point in decode_points(report):
            priced = price_ms(point, fitted, gap, bw, pk)["pass_ms"]
            advise = f"{point['advise_ms'] / point['measured_ms']:.2f}" if point["advise_ms"] else "-"
            print(f"  {point['shape']:12s} {point['prompt_len']:5d} {point['rows']:4d}  {point['measured_ms']:9.3f}"
                  f"  {priced / point['measured_ms']:15.2f}  {advise:>17s}")


if __name__ == "__main__":
    main()
