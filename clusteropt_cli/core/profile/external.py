"""Read the JSON reports of third-party load testers as `copt.profile/1` endpoint reports.

* guidellm (`guidellm benchmark ... --output-path report.json`): `{"benchmarks": [...]}`, one benchmark per load
  level; each has `metrics.<name>.successful` distribution summaries (`mean`, `median`, `percentiles.p50`...),
  latencies in milliseconds. Its `inter_token_latency_ms` is (last token − first token) / (tokens − 1), what
  copt calls TPOT; its `time_per_output_token_ms` includes the TTFT and is not used.
* `vllm bench serve --save-result` (one level per file): flat keys `median_ttft_ms`, `median_tpot_ms`,
  `median_itl_ms`, `median_e2el_ms`, `output_throughput`, `request_throughput`, `completed`, `max_concurrency`,
  `request_rate`, `total_input_tokens`, `total_output_tokens`, `duration`.

Latency percentiles become seconds under copt's names (p50/p90/p99/mean); each file becomes one ProfileReport whose
metrics are those of its highest completed level, like `copt profile endpoint`.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from clusteropt_cli import __version__
from clusteropt_cli.core.profile.report import EndpointLevel, HardwareInfo, ProfileReport

_PCTS = {"p50": ("p50", "median"), "p90": ("p90",), "p99": ("p99",), "mean": ("mean",)}


def detect_tool(data: Any) -> str | None:
    """'guidellm', 'vllm-bench' or None for a JSON document."""
    if not isinstance(data, dict):
        return None
    benchmarks = data.get("benchmarks")
    if isinstance(benchmarks, list) and benchmarks and isinstance(benchmarks[0], dict) and \
            "metrics" in benchmarks[0]:
        return "guidellm"
    if "output_throughput" in data and any(k in data for k in ("median_ttft_ms", "mean_ttft_ms")):
        return "vllm-bench"
    return None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _guidellm_summary(metrics: dict[str, Any], name: str) -> dict[str, Any]:
    """The `successful` distribution of a guidellm metric (older reports keep it at the top level)."""
    entry = metrics.get(name) or {}
    if not isinstance(entry, dict):
        return {}
    summary = entry.get("successful", entry)
    return summary if isinstance(summary, dict) else {}


def _ms_to_s(summary: dict[str, Any], scale: float = 1e-3) -> dict[str, float]:
    """p50/p90/p99/mean of a distribution summary, times `scale` (ms → s by default)."""
    pcts = summary.get("percentiles") or {}
    out: dict[str, float] = {}
    for key, names in _PCTS.items():
        for source in names:
            value = _num(pcts.get(source)) if source.startswith("p") else None
            if value is None:
                value = _num(summary.get(source))
            if value is not None:
                out[key] = value * scale
                break
    return out


def _guidellm_strategies(bench: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind, fields) of each scheduling strategy a guidellm benchmark states (in its config, args, itself)."""
    for holder in (bench.get("config"), bench.get("args"), bench):
        strategy = holder.get("strategy") if isinstance(holder, dict) else None
        if isinstance(strategy, dict):
            yield str(strategy.get("type_") or strategy.get("type") or ""), strategy


def _guidellm_concurrency(bench: dict[str, Any]) -> tuple[int | None, float | None, str | None]:
    """(concurrent streams, request rate, "constant" when that rate's requests were evenly spaced) of a guidellm
    benchmark's scheduling strategy."""
    for kind, strategy in _guidellm_strategies(bench):
        streams, rate = _num(strategy.get("streams")), _num(strategy.get("rate"))
        if streams is not None:
            return int(streams), None, None
        if kind == "synchronous":
            return 1, None, None
        if rate is not None:
            return None, rate, "constant" if kind == "constant" else None
    return None, None, None


def _from_guidellm(data: dict[str, Any]) -> tuple[list[EndpointLevel], dict[str, Any], str | None]:
    levels, prompt, gen = [], [], []
    model = None
    for bench in data["benchmarks"]:
        metrics = bench.get("metrics") or {}
        concurrency, rate, arrivals = _guidellm_concurrency(bench)
        totals = ((bench.get("scheduler_metrics") or {}).get("requests_made") or metrics.get("request_totals")
                  or bench.get("request_totals") or {})
        completed = int(_num(totals.get("successful")) or _num(_guidellm_summary(metrics, "request_latency")
                                                               .get("count")) or 0)
        errored = int(_num(totals.get("errored")) or 0)
        incomplete = int(_num(totals.get("incomplete")) or 0)
        start, end = _num(bench.get("start_time")), _num(bench.get("end_time"))
        duration = _num(bench.get("duration")) or (
            (end - start) if start is not None and end is not None and end > start else None)
        rps = _num(_guidellm_summary(metrics, "requests_per_second").get("mean"))
        out_tps = _num(_guidellm_summary(metrics, "output_tokens_per_second").get("mean")) or 0.0
        if duration is None:
            duration = completed / rps if rps else 0.0
        errors = {k: v for k, v in (("errored", errored), ("incomplete", incomplete)) if v}
        e2e = _ms_to_s(_guidellm_summary(metrics, "request_latency"), scale=1.0)  # guidellm: seconds
        tpot = _ms_to_s(_guidellm_summary(metrics, "inter_token_latency_ms"))
        levels.append(EndpointLevel(
            concurrency=concurrency, rate=rate, arrivals=arrivals,
            requests=completed + errored + incomplete, completed=completed,
            errors=errors, duration_s=max(duration or 0.0, 1e-9), request_throughput=rps or 0.0,
            output_tokens_per_s=out_tps, ttft_s=_ms_to_s(_guidellm_summary(metrics, "time_to_first_token_ms")),
            itl_s=tpot, tpot_s=tpot, e2e_s=e2e))
        p = _num(_guidellm_summary(metrics, "prompt_token_count").get("mean"))
        g = _num(_guidellm_summary(metrics, "output_token_count").get("mean"))
        if p:
            prompt.append(p)
        if g:
            gen.append(g)
    args = data.get("args") or {}
    backend = _guidellm_backend(data)
    if isinstance(args, dict):
        model = args.get("model") or None
    model = model or backend.get("model") or None
    workload = {"tool": "guidellm", "prompt_len": round(sum(prompt) / len(prompt)) if prompt else None,
                "gen_len": round(sum(gen) / len(gen)) if gen else None, **_guidellm_sampling(backend)}
    return levels, workload, model


def sampling_fields(source: Any) -> dict[str, Any]:
    """temperature and top_p (floats) and top_k (int) where `source` (a request body, a report, generation defaults)
    sets them as numbers."""
    if not isinstance(source, dict):
        return {}
    return {key: cast(value) for key, cast in (("temperature", float), ("top_p", float), ("top_k", int))
            if (value := _num(source.get(key))) is not None}


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _guidellm_backend(data: dict[str, Any]) -> dict[str, Any]:
    """The backend guidellm sent its requests through (guidellm 0.8: config.spec.backend, or a benchmark's
    config.backend): target, model, extras; {} where the report does not say (earlier reports)."""
    candidates = [_mapping(_mapping(data.get("config")).get("spec")).get("backend"),
                  *(_mapping(_mapping(b).get("config")).get("backend") for b in data.get("benchmarks") or [])]
    return next((c for c in candidates if isinstance(c, dict)), {})


def _guidellm_sampling(backend: dict[str, Any]) -> dict[str, Any]:
    """The sampling guidellm's requests carried: its backend's extra body (`--backend ...,extras.body.temperature=0`).
    A request without a temperature gets the server's default — the model's generation config in vLLM and copt
    serve, else 1.0 (the OpenAI default) — so it is priced as sampled at 1.0 and marked (`sampling`). Nothing where
    the report names no backend."""
    if not backend:
        return {}
    out = sampling_fields(_mapping(backend.get("extras")).get("body"))
    if "temperature" not in out:
        out["temperature"] = 1.0
        out["sampling"] = "no temperature sent: the server's default (OpenAI: 1.0)"
    return out


def _from_vllm(data: dict[str, Any]) -> tuple[list[EndpointLevel], dict[str, Any], str | None]:
    def pct(metric: str) -> dict[str, float]:
        out = {}
        for key, source in (("p50", "median"), ("p90", "p90"), ("p99", "p99"), ("mean", "mean")):
            value = _num(data.get(f"{source}_{metric}_ms"))
            if value is not None:
                out[key] = value / 1e3
        return out

    completed = int(_num(data.get("completed")) or 0)
    failed = int(_num(data.get("failed")) or 0)
    rate = _num(data.get("request_rate"))  # "inf" is a string: no rate limit
    concurrency = _num(data.get("max_concurrency"))
    level = EndpointLevel(
        concurrency=int(concurrency) if concurrency else (None if rate else None), rate=rate,
        requests=completed + failed, completed=completed, errors={"failed": failed} if failed else {},
        duration_s=max(_num(data.get("duration")) or 0.0, 1e-9),
        request_throughput=_num(data.get("request_throughput")) or 0.0,
        output_tokens_per_s=_num(data.get("output_throughput")) or 0.0,
        ttft_s=pct("ttft"), itl_s=pct("itl"), tpot_s=pct("tpot"), e2e_s=pct("e2el"))
    # vllm bench serve sends temperature 0 (greedy) unless --temperature is given; a report that records its
    # sampling parameters says which
    workload = {"tool": "vllm bench serve", "temperature": 0.0, **sampling_fields(data),
                "prompt_len": round(data["total_input_tokens"] / completed)
                if completed and _num(data.get("total_input_tokens")) else None,
                "gen_len": round(data["total_output_tokens"] / completed)
                if completed and _num(data.get("total_output_tokens")) else None}
    return [level], workload, data.get("model_id") or None


def external_report(data: dict[str, Any], tool: str) -> ProfileReport:
    """A `copt.profile/1` endpoint report from a guidellm or `vllm bench serve` JSON document."""
    from clusteropt_cli.core.profile.expect import level_figures
    from clusteropt_cli.core.profile.verdict import endpoint_verdict

    levels, workload, model = _from_guidellm(data) if tool == "guidellm" else _from_vllm(data)
    done = [lv for lv in levels if lv.completed > 0]
    metrics: dict[str, float | None] = {}
    if done:
        metrics.update(level_figures(done[-1]))
        metrics["max_output_tokens_per_s"] = max(lv.output_tokens_per_s for lv in done)
    workload["concurrency"] = [lv.concurrency for lv in levels if lv.concurrency is not None] or None
    workload["rate"] = [lv.rate for lv in levels if lv.rate is not None] or None
    return ProfileReport(kind="endpoint", mode="endpoint", created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                         copt_version=__version__, hardware=HardwareInfo(device="remote"),
                         model={"name": model} if model else {}, workload=workload, metrics=metrics, levels=levels,
                         verdict=endpoint_verdict(levels, slo_ttft_s=None, slo_tpot_s=None))


def vllm_bench_results(report: ProfileReport) -> list[dict[str, Any]]:
    """Each level of a copt endpoint report in `vllm bench serve --save-result`'s flat schema (one document per
    level, as vLLM writes one per run); latencies in milliseconds, vLLM's names (median/p90/p99/mean_*_ms), and the
    sampling the requests carried (temperature, top_p, top_k: read back by --from-profile)."""
    docs = []
    for lv in report.levels:
        failed = lv.requests - lv.completed
        doc: dict[str, Any] = {
            "date": report.created_at, "backend": "openai", "model_id": report.model.get("name"),
            "tokenizer_id": None, "num_prompts": lv.requests,
            "request_rate": "inf" if lv.rate is None else lv.rate, "max_concurrency": lv.concurrency,
            "duration": lv.duration_s, "completed": lv.completed, "failed": failed,
            "total_output_tokens": round(lv.output_tokens_per_s * lv.duration_s),
            "request_throughput": lv.request_throughput, "request_goodput": lv.goodput,
            "output_throughput": lv.output_tokens_per_s, "source": f"copt profile endpoint {report.copt_version}",
            **sampling_fields(report.workload),
        }
        for metric, summary in (("ttft", lv.ttft_s), ("tpot", lv.tpot_s), ("itl", lv.itl_s), ("e2el", lv.e2e_s)):
            for ours, theirs in (("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p99", "p99")):
                if ours in summary:
                    doc[f"{theirs}_{metric}_ms"] = summary[ours] * 1e3
        docs.append(doc)
    return docs


def _guidellm_distribution(summary: dict[str, float], count: int, scale: float) -> dict[str, Any] | None:
    """A guidellm StatusDistributionSummary (`successful`/`incomplete`/`errored`/`total`) holding the statistics
    copt measured: mean, median and the p50/p90/p99 percentiles, times `scale` (s → ms for the *_ms metrics).
    The fields copt does not measure (mode, variance, min, max, the other percentiles) are left out."""
    if not summary:
        return None
    stats: dict[str, Any] = {"count": count}
    if "mean" in summary:
        stats["mean"] = summary["mean"] * scale
        stats["total_sum"] = summary["mean"] * scale * count
    if "p50" in summary:
        stats["median"] = summary["p50"] * scale
    stats["percentiles"] = {k: summary[k] * scale for k in ("p50", "p90", "p99") if k in summary}
    return {"successful": stats, "incomplete": None, "errored": None, "total": None}


def guidellm_report(report: ProfileReport) -> dict[str, Any]:
    """A copt endpoint report as a guidellm benchmarks report (`guidellm benchmark --output-path report.json`):
    one `generative_benchmark` per load level, in guidellm's layout (`config.strategy`,
    `scheduler_metrics.requests_made`, `metrics.<name>.successful` distribution summaries, `duration`).

    Units as guidellm writes them: `time_to_first_token_ms` and `inter_token_latency_ms` in milliseconds,
    `request_latency` in seconds. guidellm's inter-token latency is per request (last − first token) / (tokens −
    1), which is copt's TPOT, so that is what it carries. Only the figures copt measures are written; guidellm's
    per-request samples (`requests`) and scheduler state are not, so guidellm's own loader does not validate the
    file, while readers of its metrics (copt's among them) do."""
    workload = report.workload
    benchmarks = []
    for index, lv in enumerate(report.levels):
        errored = lv.requests - lv.completed
        if lv.concurrency is not None:
            strategy: dict[str, Any] = {"type_": "concurrent", "streams": lv.concurrency}
        else:
            strategy = {"type_": lv.arrivals or "poisson", "rate": lv.rate}
        out_tokens = lv.output_tokens_per_s * lv.duration_s
        metrics: dict[str, Any] = {
            "requests_per_second": _guidellm_distribution({"mean": lv.request_throughput}, lv.completed, 1.0),
            "output_tokens_per_second": _guidellm_distribution({"mean": lv.output_tokens_per_s}, lv.completed, 1.0),
            "request_latency": _guidellm_distribution(lv.e2e_s, lv.completed, 1.0),
            "time_to_first_token_ms": _guidellm_distribution(lv.ttft_s, lv.completed, 1e3),
            "inter_token_latency_ms": _guidellm_distribution(lv.tpot_s, lv.completed, 1e3),
        }
        if lv.completed:
            metrics["output_token_count"] = _guidellm_distribution({"mean": out_tokens / lv.completed},
                                                                   lv.completed, 1.0)
        benchmarks.append({
            "type_": "generative_benchmark",
            "config": {"id_": f"copt-{index}", "run_index": index, "strategy": strategy},
            "scheduler_metrics": {"requests_made": {"successful": lv.completed, "incomplete": 0,
                                                    "errored": errored, "total": lv.requests}},
            "metrics": {k: v for k, v in metrics.items() if v is not None},
            "duration": lv.duration_s,
        })
    concurrent = [lv.concurrency for lv in report.levels if lv.concurrency is not None]
    rates = [lv.rate for lv in report.levels if lv.concurrency is None and lv.rate is not None]
    args: dict[str, Any] = {"target": workload.get("url"), "model": report.model.get("name"),
                            "profile": "concurrent" if concurrent else (
                                "constant" if rates and all(lv.arrivals == "constant" for lv in report.levels
                                                            if lv.concurrency is None and lv.rate is not None)
                                else "poisson"),
                            "rate": concurrent or rates}
    if workload.get("prompt_len") and workload.get("gen_len") and not workload.get("dataset"):
        args["data"] = [f"prompt_tokens={workload['prompt_len']},output_tokens={workload['gen_len']}"]
    # the requests' sampling where guidellm 0.8 keeps it (its backend's extra body), read back by --from-profile
    backend = {"kind": "openai_http", "target": workload.get("url"), "model": report.model.get("name"),
               "extras": {"body": sampling_fields(workload)}}
    return {"metadata": {"version": 1, "source": f"copt profile endpoint {report.copt_version}",
                         "created_at": report.created_at},
            "config": {"spec": {"backend": backend}}, "args": args, "benchmarks": benchmarks}
