"""bench/fit_decode_parts.py: copt serve's decode step on an H100 (HEAD's engine, 2026-12-08: 1B and 8B widths on
16 layers, 16/320/1,024-token prompts, 1-256 rows) as GPU time by part — GEMMs, attention, the rest — each linear in
its bytes, FLOPs, layers and rows, with the host's gap per pass; and the same constants on the H200's steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from fit_decode_parts import decode_points, fit_parts, host_gap_ms, price_ms  # noqa: E402

RESULTS = BENCH / "results"
H100 = [json.loads((RESULTS / "decode-parts-h100-2026-12-08" / name).read_text())
        for name in ("llama1b.json", "llama8b.json")]
H200 = json.loads((RESULTS / "decode-steps-h200-2026-12-07" / "dense.json").read_text())
H100_BW, H200_BW, PEAK = 3.35e12, 4.8e12, 989.4e12


@pytest.fixture(scope="module")
def fitted():
    points = [p for report in H100 for p in decode_points(report)]
    return points, fit_parts(points, H100_BW, PEAK), host_gap_ms(points)


def test_every_step_was_profiled_at_three_contexts_and_five_row_counts(fitted) -> None:
    points, _, _ = fitted
    assert len(points) == 30 and all(p["parts_us"] for p in points)
    assert {(p["shape"], p["prompt_len"], p["rows"]) for p in points} == {
        (shape, prompt, rows) for shape in ("llama1b-16l", "llama8b-16l") for prompt in (16, 320, 1024)
        for rows in (1, 16, 64, 128, 256)}


def test_the_fitted_constants_are_physical(fitted) -> None:
    """GEMMs read their weights at 0.91 of the datasheet bandwidth after 3.4 µs per launch, and add about half of
    their rows' FLOPs at peak; attention reads the cache at 0.79 of it; the pass waits 0.14 ms on the host."""
    _, constants, gap = fitted
    launch, per_weight, flop_share = constants["gemm"]
    assert 2.5 < launch < 4.5 and 0.85 < 1 / per_weight < 0.95 and 0.4 < flop_share < 0.7
    layer, per_kv = constants["attention"]
    assert 4.0 < layer < 9.0 and 0.7 < 1 / per_kv < 0.9
    assert 0.10 < gap < 0.16


def test_the_parts_price_the_h100_passes_but_where_the_host_sets_the_pace(fitted) -> None:
    """Sum of the parts and the gap ÷ measured pass: 0.98-1.05 but for three of the 1B's passes — 128 and 256 rows at
    16-token prompts, 256 at 1,024 (0.94, 0.90, 0.84) — which ran longer than their GPU time plus the gap."""
    points, constants, gap = fitted
    ratios = {(p["shape"], p["prompt_len"], p["rows"]): price_ms(p, constants, gap, H100_BW, PEAK)["pass_ms"]
              / p["measured_ms"] for p in points}
    off = {key for key, ratio in ratios.items() if abs(ratio - 1) > 0.06}
    assert off == {("llama1b-16l", 16, 128), ("llama1b-16l", 16, 256), ("llama1b-16l", 1024, 256)}, ratios
    for key in off:
        point = next(p for p in points if (p["shape"], p["prompt_len"], p["rows"]) == key)
        gpu_ms = sum(point["parts_us"][f"{part}_us"] for part in ("gemm", "attention", "other")) / 1e3
        assert point["measured_ms"] > gpu_ms + gap + 0.15


def test_the_h100_fit_prices_the_h200s_sixteen_layer_steps_held_out(fitted) -> None:
    """The H200's 16-layer steps (2026-12-07, 16-token prompts, batch 1-64, the merge pass of then included in the
    measurement) at its datasheet bandwidth: 0.94-1.05."""
    _, constants, gap = fitted
    for point in decode_points(H200):
        ratio = price_ms(point, constants, gap, H200_BW, PEAK)["pass_ms"] / point["measured_ms"]
        if point["shape"].endswith("16l"):
            assert ratio == pytest.approx(1.0, abs=0.07), (point["shape"], point["rows"], ratio)
        else:  # four layers: shallower than any real model
            assert ratio == pytest.approx(1.0, abs=0.10), (point["shape"], point["rows"], ratio)
