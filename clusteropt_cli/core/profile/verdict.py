"""The bottleneck verdict: one label, the evidence behind it, and the symptom ids `copt advise` accepts.

Rules (thresholds below are module constants, documented in docs/profile.md):
- memory-capacity-bound: the run hit OOM, the peak exceeds --memory-budget, or the reserved peak is within 8% of
  the device memory → symptom `oom`.
- On CUDA, the device-busy fraction (kernel time / wall time of one profiled iteration) below 60% → overhead-bound
  (launch/Python time dominates).
- Training: MFU ≥ 35% → compute-bound; busy but below that → memory-bandwidth-bound (elementwise kernels
  dominate); `low-mfu` whenever MFU < 30%.
- Inference: decode ≥ 50% of the request time → memory-bandwidth-bound when MBU ≥ 30% else overhead-bound, with
  `slow-tpot` (and `low-throughput` at batch ≤ 8); prefill dominating → compute-bound with `high-ttft`.
- CPU: no catalog peak, so the same rules use fractions of this CPU's measured matmul rate and copy bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clusteropt_cli.core.profile.report import EndpointLevel, Verdict

NEAR_LIMIT_FRAC = 0.92
BUSY_FRAC_MIN = 0.60
MFU_COMPUTE_BOUND = 0.35
MFU_LOW = 0.30
MBU_BANDWIDTH_BOUND = 0.30
CPU_MATMUL_FRAC_COMPUTE_BOUND = 0.30
SMALL_BATCH = 8
GiB = 1024**3


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def memory_capacity_evidence(metrics: dict[str, Any], *, oom: bool, memory_bytes: int | None,
                             budget_bytes: int | None) -> list[str]:
    """Evidence lines when memory capacity is the bottleneck (empty when it is not)."""
    evidence = []
    peak = metrics.get("peak_mem_bytes")
    reserved = metrics.get("peak_reserved_bytes")
    if oom:
        evidence.append("the run ran out of device memory")
    if budget_bytes is not None and peak is not None and peak > budget_bytes:
        evidence.append(f"peak {peak / GiB:.3f} GiB exceeds the memory budget of {budget_bytes / GiB:.3f} GiB "
                        f"by {_pct(peak / budget_bytes - 1)}")
    top = reserved if reserved is not None else peak
    if memory_bytes and top is not None and top > NEAR_LIMIT_FRAC * memory_bytes and not oom:
        evidence.append(f"peak {top / GiB:.1f} GiB is {_pct(top / memory_bytes)} of the device's "
                        f"{memory_bytes / GiB:.1f} GiB")
    return evidence


def model_verdict(mode: str, metrics: dict[str, Any], *, device: str, memory_bytes: int | None,
                  budget_bytes: int | None, oom: bool, batch: int) -> Verdict:
    """Name the bottleneck of a profiled inference request shape or training step."""
    capacity = memory_capacity_evidence(metrics, oom=oom, memory_bytes=memory_bytes, budget_bytes=budget_bytes)
    if capacity:
        symptoms = ["oom"]
        if mode == "train" and metrics.get("mfu") is not None and metrics["mfu"] < MFU_LOW:
            symptoms.append("low-mfu")
        return Verdict(bottleneck="memory-capacity-bound", evidence=capacity, symptoms=symptoms)
    if mode == "train":
        return _train_verdict(metrics, device)
    return _infer_verdict(metrics, device, batch)


def _busy_evidence(metrics: dict[str, Any]) -> tuple[bool, list[str]]:
    busy = metrics.get("device_busy_frac")
    if busy is None:
        return False, []
    line = f"the GPU runs kernels {_pct(busy)} of a profiled iteration"
    return busy < BUSY_FRAC_MIN, [line + (" (it idles between kernels)" if busy < BUSY_FRAC_MIN else "")]


def _train_verdict(metrics: dict[str, Any], device: str) -> Verdict:
    evidence = []
    split = [metrics.get(k) for k in ("forward_frac", "backward_frac", "optimizer_frac")]
    if all(v is not None for v in split):
        evidence.append("step split: forward {}, backward {}, optimizer {}".format(*(_pct(v) for v in split)))
    if device == "cpu":
        frac = metrics.get("cpu_matmul_frac")
        if frac is None:
            return Verdict(bottleneck="unknown", evidence=evidence + ["no FLOP count for this model"])
        evidence.append(f"the step runs at {_pct(frac)} of this CPU's measured matmul rate "
                        "(MFU is null on CPU: the hardware catalog has no CPU peak)")
        if frac >= CPU_MATMUL_FRAC_COMPUTE_BOUND:
            return Verdict(bottleneck="compute-bound", evidence=evidence, symptoms=[])
        evidence.append("small matmuls: framework/Python overhead dominates the step")
        return Verdict(bottleneck="overhead-bound", evidence=evidence, symptoms=["low-mfu"])
    mfu = metrics.get("mfu")
    idle, busy_lines = _busy_evidence(metrics)
    evidence += busy_lines
    if mfu is not None:
        evidence.append(f"MFU {_pct(mfu)} of the catalog peak")
    symptoms = ["low-mfu"] if mfu is not None and mfu < MFU_LOW else []
    if idle:
        return Verdict(bottleneck="overhead-bound", evidence=evidence, symptoms=symptoms or ["low-mfu"])
    if mfu is None:
        return Verdict(bottleneck="unknown", evidence=evidence + ["no catalog peak for this GPU"], symptoms=[])
    if mfu >= MFU_COMPUTE_BOUND:
        return Verdict(bottleneck="compute-bound", evidence=evidence, symptoms=symptoms)
    evidence.append("kernels are busy but far from the matmul peak: memory-bound kernels dominate")
    return Verdict(bottleneck="memory-bandwidth-bound", evidence=evidence, symptoms=symptoms or ["low-mfu"])


def _infer_verdict(metrics: dict[str, Any], device: str, batch: int) -> Verdict:
    evidence = []
    ttft = metrics.get("ttft_s") or 0.0
    decode = metrics.get("decode_s") or 0.0
    total = ttft + decode
    decode_frac = decode / total if total > 0 else 0.0
    evidence.append(f"prefill {_pct(1 - decode_frac)} and decode {_pct(decode_frac)} of the request time")
    if device == "cpu":
        mfu = metrics.get("cpu_matmul_frac")
        mbu = metrics.get("cpu_bandwidth_frac")
        if mfu is not None:
            evidence.append(f"prefill at {_pct(mfu)} of this CPU's measured matmul rate")
        if mbu is not None:
            evidence.append(f"decode moves bytes at {_pct(mbu)} of this CPU's measured copy bandwidth")
        evidence.append("MFU/MBU are null on CPU: the hardware catalog has no CPU peak")
        idle = False
    else:
        mfu = metrics.get("mfu")
        mbu = metrics.get("mbu")
        if mfu is not None:
            evidence.append(f"prefill MFU {_pct(mfu)}")
        if mbu is not None:
            evidence.append(f"decode MBU {_pct(mbu)}")
        idle, busy_lines = _busy_evidence(metrics)
        evidence += busy_lines
    if decode_frac >= 0.5:
        symptoms = ["slow-tpot"] + (["low-throughput"] if batch <= SMALL_BATCH else [])
        if batch <= SMALL_BATCH:
            evidence.append(f"batch {batch}: each decode step reads all weights for few tokens")
        if idle or mbu is None or mbu < MBU_BANDWIDTH_BOUND:
            evidence.append("decode steps are far from the bandwidth floor: per-step overhead dominates")
            return Verdict(bottleneck="overhead-bound", evidence=evidence, symptoms=symptoms)
        return Verdict(bottleneck="memory-bandwidth-bound", evidence=evidence, symptoms=symptoms)
    threshold = CPU_MATMUL_FRAC_COMPUTE_BOUND if device == "cpu" else MFU_LOW
    if idle or mfu is None or mfu < threshold:
        return Verdict(bottleneck="overhead-bound", evidence=evidence, symptoms=["high-ttft"])
    return Verdict(bottleneck="compute-bound", evidence=evidence, symptoms=["high-ttft"])


def endpoint_verdict(levels: Sequence[EndpointLevel], *, slo_ttft_s: float | None,
                     slo_tpot_s: float | None) -> Verdict:
    """From a load sweep: errors, SLO misses and throughput saturation → bottleneck and symptoms."""
    ok = [lv for lv in levels if lv.completed > 0]
    if not ok:
        kinds = {}
        for lv in levels:
            for kind, n in lv.errors.items():
                kinds[kind] = kinds.get(kind, 0) + n
        return Verdict(bottleneck="unknown", evidence=[f"no request completed; errors: {kinds or 'none'}"])
    evidence: list[str] = []
    symptoms: list[str] = []
    first, last = ok[0], ok[-1]
    for lv in ok:
        overload = {k: n for k, n in lv.errors.items() if k in ("http_429", "http_503")}
        if overload:
            evidence.append(f"{_level_name(lv)}: the server refused requests {overload} (queue or KV cache full)")
            if "low-throughput" not in symptoms:
                symptoms.append("low-throughput")
    ttft = last.ttft_s.get("p90")
    tpot = last.tpot_s.get("p50")
    if ttft is not None and slo_ttft_s is not None and ttft > slo_ttft_s:
        evidence.append(f"{_level_name(last)}: TTFT p90 {ttft * 1e3:.0f} ms misses the {slo_ttft_s * 1e3:.0f} ms SLO")
        symptoms.append("high-ttft")
    if tpot is not None and slo_tpot_s is not None and tpot > slo_tpot_s:
        evidence.append(f"{_level_name(last)}: TPOT p50 {tpot * 1e3:.1f} ms misses the {slo_tpot_s * 1e3:.1f} ms SLO")
        symptoms.append("slow-tpot")
    bottleneck = "unknown"
    load_first = first.concurrency or first.rate or 1
    load_last = last.concurrency or last.rate or 1
    if len(ok) >= 2 and load_last > load_first and first.output_tokens_per_s > 0:
        scale = last.output_tokens_per_s / first.output_tokens_per_s
        load = load_last / load_first
        evidence.append(f"throughput ×{scale:.2f} for load ×{load:.1f} "
                        f"({first.output_tokens_per_s:.0f} → {last.output_tokens_per_s:.0f} output tok/s)")
        if scale < 0.5 * load:
            bottleneck = "compute-bound"
            evidence.append("throughput saturates while latency grows: the server is at capacity")
            if "low-throughput" not in symptoms:
                symptoms.append("low-throughput")
        else:
            bottleneck = "memory-bandwidth-bound"
            evidence.append("throughput still scales with load: decode is bandwidth-bound, batching pays")
    elif tpot is not None:
        bottleneck = "memory-bandwidth-bound"
        evidence.append("single load level: decode latency dominates; sweep --concurrency to see saturation")
    if first.ttft_s.get("p50") and first.tpot_s.get("p50") and "high-ttft" not in symptoms:
        if first.ttft_s["p50"] > 20 * first.tpot_s["p50"]:
            evidence.append(f"at the lowest load TTFT is {first.ttft_s['p50'] / first.tpot_s['p50']:.0f}× TPOT")
            symptoms.append("high-ttft")
    return Verdict(bottleneck=bottleneck, evidence=evidence, symptoms=symptoms)


def _level_name(level: EndpointLevel) -> str:
    return f"concurrency {level.concurrency}" if level.concurrency is not None else f"rate {level.rate}/s"
