"""advise's MoE decode step against copt serve's engine on an H100 (bench/gpu_moe_decode.py, 2026-12-07; results in
bench/results/moe-h100-2026-12-07): Qwen3-30B-A3B's width (128 experts, top-8) over 8 layers and Mixtral-8x7B's
(8 experts of 14,336, top-2) over 4, decode steps through CUDA graphs, fp16 (copt's dense experts: every expert read)
and bf16 (transformers' grouped GEMM: the routed ones), batch 1, 16 and 64."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from gpu_moe_decode import advise_ms_per_step  # noqa: E402 - the function the bench records advise's figures with

RESULTS = BENCH / "results" / "moe-h100-2026-12-07"
REPORTS = {name: json.loads((RESULTS / name).read_text()) for name in ("moe.json", "moe-mixtral.json")}
STEPS = [(name, case["shape"], case["dtype"], int(batch), step["ms_per_step"])
         for name, report in REPORTS.items() for case in report["cases"] if case["graphs"]
         for batch, step in case["per_batch"].items()]
# the 4-layer Mixtral's batch-1 steps (1.5 and 4.2 ms) are where advise's fixed cost per step (0.57 ms, fitted on
# the 16- and 32-layer dense shapes) weighs most: 1.25 and 1.16 advise ÷ measured
MISSES = {("mixtral-4l", "bf16", 1), ("mixtral-4l", "fp16", 1)}


def _predicted_ms(report: str, shape: str, dtype: str, batch: int) -> float:
    """advise now, for the case that ran (64 new tokens per request)."""
    return advise_ms_per_step(REPORTS[report]["configs"][shape], REPORTS[report]["device"], dtype, batch,
                              new_tokens=64)


def test_the_runs_cover_both_expert_paths_at_three_batches() -> None:
    for shape, layers in (("qwen3moe-8l", 8), ("mixtral-4l", 4)):
        assert sorted({(dtype, batch) for _, s, dtype, batch, _ in STEPS if s == shape}) == [
            (dtype, batch) for dtype in ("bf16", "fp16") for batch in (1, 16, 64)]
        captured = [case for report in REPORTS.values() for case in report["cases"]
                    if case["graphs"] and case["shape"] == shape]
        assert all(case["graphs_captured"] > 0 and case["moe_layers"] == layers for case in captured)


@pytest.mark.parametrize(("report", "shape", "dtype", "batch", "measured_ms"), [
    pytest.param(*step, marks=pytest.mark.xfail(strict=True, reason="advise's fixed step cost on a 4-layer model"))
    if step[1:4] in MISSES else step for step in STEPS], ids=[f"{s}-{d}-b{b}" for _, s, d, b, _ in STEPS])
def test_decode_step_within_15_percent(report: str, shape: str, dtype: str, batch: int, measured_ms: float) -> None:
    """advise's decode step (`decode_step_s`, what the bench measures: the round less its first token) ÷ measured:
    0.90-1.13 on the 8-layer Qwen3 shape, 1.03-1.11 on the 4-layer Mixtral above batch 1."""
    assert _predicted_ms(report, shape, dtype, batch) / measured_ms == pytest.approx(1.0, abs=0.15)


def test_dense_experts_cost_more_than_three_routed_steps_at_batch_one() -> None:
    """fp16's dense experts read all 128 experts where bf16 reads the 8 routed: 3.56x the bf16 step at batch 1 on the
    H100 (3.685 against 1.036 ms), 4.22x in advise (each step within 15%, their ratio 19% above)."""
    measured = {dtype: ms for _, shape, dtype, batch, ms in STEPS if batch == 1 and shape == "qwen3moe-8l"}
    predicted = {dtype: _predicted_ms("moe.json", "qwen3moe-8l", dtype, 1) for dtype in measured}
    assert measured["fp16"] / measured["bf16"] > 3
    assert 3 < predicted["fp16"] / predicted["bf16"] < 5


def test_with_eight_experts_the_routed_path_reads_them_all_from_batch_16() -> None:
    """Top-2 of 8 experts: a batch of 16 routes to all eight (1 - (6/8)^16 = 99% each), so bf16's grouped GEMM reads
    what fp16's dense experts read and the steps meet (H100: 4.99 and 4.65 ms at batch 16, 5.03 and 4.83 at 64);
    advise prices both the same there."""
    steps = {(dtype, batch): ms for _, shape, dtype, batch, ms in STEPS if shape == "mixtral-4l"}
    for batch in (16, 64):
        assert steps["bf16", batch] / steps["fp16", batch] == pytest.approx(1.0, abs=0.1)
        assert _predicted_ms("moe-mixtral.json", "mixtral-4l", "bf16", batch) == pytest.approx(
            _predicted_ms("moe-mixtral.json", "mixtral-4l", "fp16", batch), rel=0.02)
    assert steps["fp16", 1] / steps["bf16", 1] > 2.5  # at batch 1 bf16 reads 2 of the 8
