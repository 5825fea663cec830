"""copt profile: measure a model (`model`) or an OpenAI-compatible endpoint (`endpoint`) and name the bottleneck.

Both write the versioned ProfileReport (core/profile/report.py) that `copt advise --from-profile` reads:
`--json` prints it on stdout, `--report FILE` writes it. `--expect R.yaml` checks the measurement against the
prediction a recipe carries and exits 6 when a figure misses by more than `--tolerance`. At a closed loop that
kept the engine full, a TTFT that misses by what its passing tok/s and TPOT errors imply is marked `explained`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from clusteropt_cli import console
from clusteropt_cli.errors import BadInputError, CheckFailedError
from clusteropt_cli.options import JsonOpt, OverwriteOpt

app = typer.Typer(help="Measure a model or an endpoint and name the bottleneck.", no_args_is_help=True)

GiB = 1024**3

ReportOpt = Annotated[
    Path | None, typer.Option("--report", help="Write the profile JSON (schema copt.profile/1) to this file.")
]
ExpectOpt = Annotated[
    str | None,
    typer.Option("--expect", help="A recipe with a prediction block (copt advise --emit-recipe): check it. Its "
                                  "figures must be positive (a 0 or negative one is refused, exit 2, before any "
                                  "measurement); a figure this profile does not measure is not checked."),
]
ToleranceOpt = Annotated[
    float, typer.Option("--tolerance", help="Allowed relative error per predicted figure with --expect (a full "
                                "closed loop's TTFT: against the ratio its tok/s and TPOT errors imply).", min=0.0)
]


def _check_outputs(paths: dict[str, Path | None], overwrite: bool, inputs: dict[str, Any] | None = None) -> None:
    """Refuse, before any work, to replace a user's files without --overwrite, or to write over an input."""
    from clusteropt_cli.core.io import check_distinct_outputs, check_output

    check_distinct_outputs(paths)
    problems = [f"{flag} {path} already exists" for flag, path in paths.items()
                if path is not None and path.exists() and not path.is_dir() and not overwrite]
    if problems:
        raise BadInputError("; ".join(problems) + ".", hint="Pass --overwrite to replace it, or choose another name.")
    for flag, path in paths.items():
        if path is not None:
            check_output(path, inputs, overwrite=overwrite, kind="file", flag=flag)


def _write_report(report: Any, path: Path | None) -> None:
    if path is None:
        return
    from clusteropt_cli.core.io import atomic_write_text

    atomic_write_text(path, report.model_dump_json(indent=2) + "\n")
    console.log(f"profile written to {path}")


def _vllm_bench_paths(path: Path, concurrency: list[int], rate: list[float]) -> list[Path]:
    """One file per level: PATH itself for a single level, else PATH-c8.json / PATH-r2.0.json."""
    tags = [f"c{c}" for c in concurrency] + [f"r{r}" for r in rate]
    if len(tags) <= 1:
        return [path]
    return [path.with_name(f"{path.stem}-{tag}{path.suffix or '.json'}") for tag in tags]


def _write_vllm_bench(report: Any, paths: list[Path]) -> None:
    import json

    from clusteropt_cli.core.io import atomic_write_text
    from clusteropt_cli.core.profile.external import vllm_bench_results

    for target, doc in zip(paths, vllm_bench_results(report), strict=True):
        atomic_write_text(target, json.dumps(doc, indent=2) + "\n")
        console.log(f"vllm bench serve result written to {target}")


def _write_guidellm(report: Any, path: Path) -> None:
    import json

    from clusteropt_cli.core.io import atomic_write_text
    from clusteropt_cli.core.profile.external import guidellm_report

    atomic_write_text(path, json.dumps(guidellm_report(report), indent=2) + "\n")
    console.log(f"guidellm benchmarks report written to {path}")


# ---- formatting --------------------------------------------------------------------------------------------
def fmt(name: str, value: Any) -> str:
    """A figure for people: bytes, seconds, fractions, FLOP/s and rates in their natural units."""
    if value is None:
        return "-"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if name.endswith("_bytes") or name == "decode_bytes_per_step":
        return console.human_bytes(value)
    if name.endswith("_frac") or name in ("mfu", "mbu", "error_rate"):
        return f"{100 * value:.1f}%"
    if name.endswith("_s") and not name.endswith("per_s"):
        return f"{value * 1e3:.2f} ms" if abs(value) < 1 else f"{value:.3f} s"
    if name.endswith("flops"):
        return f"{value / 1e12:.3f} TFLOP/s"
    if name.endswith("bandwidth"):
        return f"{value / 1e9:.1f} GB/s"
    if name.endswith("per_s") or name in ("request_throughput", "goodput"):
        return f"{value:,.1f}/s"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _render_verdict(report: Any, report_path: Path | None = None) -> None:
    v = report.verdict
    console.out.print(f"[bold]verdict:[/bold] {v.bottleneck}"
                      + (f"   [bold]symptoms:[/bold] {', '.join(v.symptoms)}" if v.symptoms else ""))
    for line in v.evidence:
        console.out.print(f"  - {line}", highlight=False)
    if v.symptoms:
        extra = ""
        if report.kind == "endpoint":  # a served name and a remote GPU: name the model's config and the GPU
            from pathlib import Path as _Path

            name = str(report.model.get("name") or "")
            extra = f" --model {name if name and _Path(name).exists() else 'MODEL_DIR'}"
            extra += f" --gpu {report.hardware.catalog or 'GPU'}"
        console.out.print(f"next: copt advise --from-profile {report_path or 'PROFILE.json'}{extra}  (or: copt "
                          f"advise {' '.join('--symptom ' + s for s in v.symptoms)})", highlight=False)


def _render_model(report: Any, report_path: Path | None = None) -> None:
    hw = report.hardware
    head = [("model", f"{report.model.get('source')} ({report.model.get('num_params'):,} params, "
                      f"{'random' if report.model.get('random_weights') else 'trained'} weights)"),
            ("hardware", f"{hw.device}: {hw.name}" + (f" [{hw.catalog}]" if hw.catalog else "")),
            ("workload", ", ".join(f"{k}={v}" for k, v in report.workload.items()))]
    console.out.print(console.kv_table(f"copt profile model --mode {report.mode}", head))
    if report.mode == "train":
        order = ["step_time_s", "tokens_per_s", "mfu", "achieved_flops", "forward_frac", "backward_frac",
                 "optimizer_frac", "peak_mem_bytes", "peak_reserved_bytes", "model_states_bytes",
                 "saved_activations_bytes", "logits_loss_bytes", "device_busy_frac", "loss"]
    else:
        order = ["ttft_s", "tpot_s", "output_tokens_per_s", "prefill_tokens_per_s", "mfu", "mbu", "achieved_flops",
                 "decode_bytes_per_step", "peak_mem_bytes", "peak_reserved_bytes", "weights_bytes",
                 "kv_cache_bytes", "device_busy_frac"]
    rows = []
    for name in order:
        if name not in report.metrics:
            continue
        sp = report.spread.get(name)
        spread_text = f"p10 {fmt(name, sp.p10)} … p90 {fmt(name, sp.p90)} (n={sp.n})" if sp else ""
        rows.append([name, fmt(name, report.metrics[name]), spread_text])
    console.out.print(console.grid("measured (medians)", ["figure", "value", "spread"], rows))
    if report.top_ops:
        console.out.print(console.grid("top ops by self time", ["op", "self time", "share", "calls"],
                                       [[op.name[:70], fmt("t_s", op.self_time_s), f"{100 * op.fraction:.1f}%",
                                         op.calls] for op in report.top_ops[:10]]))
    if report.trace_file:
        console.out.print(f"trace: {report.trace_file} (open in https://ui.perfetto.dev or chrome://tracing)")
    _render_verdict(report, report_path)


def _load_label(level: Any) -> str:
    """A level as the tables name it: c=N (a concurrency) or R/s (a request rate)."""
    return f"c={level.concurrency}" if level.concurrency is not None else f"{level.rate}/s"


def _render_endpoint(report: Any, report_path: Path | None = None) -> None:
    rows = []
    for lv in report.levels:
        load = _load_label(lv)
        errors = ", ".join(f"{k}:{n}" for k, n in lv.errors.items()) or "-"

        def ms(d: dict, key: str) -> str:
            return f"{d[key] * 1e3:.1f}" if key in d else "-"

        rows.append([load, f"{lv.completed}/{lv.requests}", f"{lv.request_throughput:.2f}",
                     f"{lv.output_tokens_per_s:.1f}", "-" if lv.goodput is None else f"{lv.goodput:.2f}",
                     f"{ms(lv.ttft_s, 'p50')}/{ms(lv.ttft_s, 'p90')}/{ms(lv.ttft_s, 'p99')}",
                     f"{ms(lv.itl_s, 'p50')}/{ms(lv.itl_s, 'p99')}",
                     f"{ms(lv.tpot_s, 'p50')}/{ms(lv.tpot_s, 'p90')}",
                     f"{ms(lv.e2e_s, 'p50')}/{ms(lv.e2e_s, 'p99')}", ms(lv.client_loop_lag_s or {}, "p90"), errors])
    headers = ["load", "ok", "req/s", "out tok/s", "goodput", "TTFT ms p50/90/99", "ITL ms p50/99",
               "TPOT ms p50/90", "E2E ms p50/99", "client lag ms p90", "errors"]
    console.out.print(console.grid(f"copt profile endpoint: {report.model.get('name')} @ "
                                   f"{report.workload.get('url') or report.workload.get('tool')}", headers, rows))
    control = report.workload.get("output_length_control")
    if control:
        mean = report.workload.get("mean_output_tokens")
        console.out.print(f"output lengths: {control}"
                          + (f"; {mean} tokens per request on average (max_tokens {report.workload.get('gen_len')})"
                             if mean is not None else ""), highlight=False, markup=False)
    hits = [(lv, lv.prefix_cache_hit_rate) for lv in report.levels if lv.prefix_cache_hit_rate is not None]
    if hits:
        console.out.print("prefix-cache hits (the server's /metrics): " + ", ".join(
            f"{_load_label(lv)} {rate:.1%}" for lv, rate in hits), highlight=False, markup=False)
    split = [lv for lv in report.levels if lv.rechunked]
    if split:
        console.out.print("streams with more text events than tokens (split by a proxy; tokens and TPOT from usage, "
                          "their event gaps left out of ITL): "
                          + ", ".join(f"{_load_label(lv)} {lv.rechunked}" for lv in split), highlight=False,
                          markup=False)
    _render_verdict(report, report_path)


_STATUS_MARKUP = {"pass": "[green]pass[/green]", "miss": "[red]MISS[/red]", "explained": "[yellow]explained[/yellow]"}


def _render_check(comparison: Any) -> None:
    rows = [[c.name + (f" ({c.note})" if c.note in ("out of step", "closed loop", "open loop") else ""),
             ("≤ " if c.note == "upper" else "") + fmt(c.name, c.predicted), fmt(c.name, c.measured),
             "-" if c.rel_error is None else f"{100 * c.rel_error:+.1f}%",
             console.markup(_STATUS_MARKUP[c.status]) if c.status in _STATUS_MARKUP else c.status]
            for c in comparison.checks]
    where = f" at {comparison.level}" if comparison.level else ""
    console.out.print(console.grid(f"predicted vs measured{where} ({comparison.recipe}, tolerance "
                                   f"±{100 * comparison.tolerance:.0f}%)",
                                   ["figure", "predicted", "measured", "error", "status"], rows))


def _finish(report: Any, comparison: Any, as_json: bool, render: Any, report_path: Path | None = None) -> None:
    """Print (JSON or tables), then fail with exit 6 when the check missed."""
    if as_json:
        if comparison is None:
            console.print_json(report, "copt.profile/1")
        else:
            console.print_json({"check": {"passed": comparison.passed, "recipe": comparison.recipe,
                                          "tolerance": comparison.tolerance, "level": comparison.level,
                                          "figures": comparison.checks, "caveats": comparison.caveats},
                                "profile": report}, "copt.profile-check/1")
    else:
        render(report, report_path)
        if comparison is not None:
            _render_check(comparison)
    for check in (comparison.checks if comparison is not None else []):
        if check.status == "not-measured":
            console.warn(f"--expect: {check.name} is not measured by this profile; not checked")
    for caveat in (comparison.caveats if comparison is not None else []):
        console.warn(f"--expect: {caveat}")
    if comparison is not None and not comparison.passed:
        misses = ", ".join(f"{c.name} {100 * c.rel_error:+.1f}%" for c in comparison.misses)
        raise CheckFailedError(f"Prediction missed by more than ±{100 * comparison.tolerance:.0f}%: {misses}.",
                               hint="Recalibrate the plan (copt advise --from-profile) or widen --tolerance.")


# ---- profile model -----------------------------------------------------------------------------------------
@app.command("model")
def model(
    model_path: Annotated[str | None, typer.Argument(
        metavar="MODEL", help="Local HF model dir, a config.json or a preset (random weights); "
                              "taken from the --expect recipe when omitted.", show_default=False)] = None,
    mode: Annotated[Literal["infer", "train"] | None, typer.Option(
        "--mode", help="infer: prefill + decode of one batch; train: one optimizer step. (default: infer)")] = None,
    device: Annotated[Literal["auto", "cuda", "cpu"] | None, typer.Option(
        "--device", help="Where to run. (default: auto)")] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="infer: sequences per batch. (default: 1)")] = None,
    prompt_len: Annotated[int | None, typer.Option("--prompt-len", help="infer: prompt tokens. (default: 128)")] = None,
    gen_len: Annotated[int | None, typer.Option("--gen-len", help="infer: generated tokens. (default: 32)")] = None,
    dtype: Annotated[Literal["auto", "bf16", "fp16", "fp32"] | None, typer.Option(
        "--dtype", help="infer: weights dtype (auto: bf16 on GPU, fp32 on CPU).")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="train: sequences per step. (default: 1)")
                           ] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="train: tokens per sequence. (default: 512)")] = None,
    precision: Annotated[Literal["auto", "bf16", "fp16", "fp32"] | None, typer.Option(
        "--precision", help="train: autocast dtype over fp32 weights (auto: bf16 on GPU, fp32 on CPU).")] = None,
    activation_checkpointing: Annotated[bool | None, typer.Option(
        "--activation-checkpointing/--no-activation-checkpointing", help="train: recompute activations.")] = None,
    optimizer: Annotated[Literal["adamw", "sgd"] | None, typer.Option(
        "--optimizer", help="train: torch AdamW (fused on GPU) or plain SGD. (default: adamw)")] = None,
    loss_impl: Annotated[Literal["auto", "fused", "hf"] | None, typer.Option(
        "--loss-impl", help="train: as copt train: fused chunked head + cross-entropy (auto) or the model's loss.")
    ] = None,
    compile_: Annotated[bool | None, typer.Option(
        "--compile/--no-compile", help="train: torch.compile the decoder (warm-up then includes compilation).")
    ] = None,
    attn: Annotated[Literal["sdpa", "eager"] | None, typer.Option("--attn", help="Attention implementation.")] = None,
    warmup: Annotated[int | None, typer.Option("--warmup", help="Untimed iterations first. (default: 2)")] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Timed iterations (median reported). (default: 5)")
                       ] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Write a torch.profiler Chrome/Perfetto trace (JSON) of one more iteration.")] = None,
    memory_budget: Annotated[float | None, typer.Option(
        "--memory-budget", help="GiB: a peak above it is memory-capacity-bound (symptom oom).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed for weights and inputs. (default: 0)")] = None,
    expect: ExpectOpt = None,
    tolerance: ToleranceOpt = 0.10,
    report_path: ReportOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Time one inference batch or one training step; peak memory, MFU/MBU and the bottleneck verdict."""
    from clusteropt_cli.core.profile.settings import ModelProfileSettings

    _check_outputs({"--report": report_path, "--trace": trace}, overwrite,
                   inputs={"MODEL": model_path, "--expect": expect})
    values: dict[str, Any] = {}
    expectation = None
    if expect is not None:
        from clusteropt_cli.core.profile.expect import load_expectation, model_values_from_recipe

        expectation = load_expectation(expect)
        values.update(model_values_from_recipe(expectation))
    if memory_budget is not None and not (math.isfinite(memory_budget) and memory_budget > 0):
        raise BadInputError(f"--memory-budget must be a positive number of GiB (got {memory_budget}).")
    typed = {"model": model_path, "mode": mode, "device": device, "batch": batch, "prompt_len": prompt_len,
             "gen_len": gen_len, "dtype": dtype, "micro_batch": micro_batch, "seq_len": seq_len,
             "precision": precision, "activation_checkpointing": activation_checkpointing, "optimizer": optimizer,
             "loss_impl": loss_impl, "compile": compile_, "attn": attn,
             "warmup": warmup, "repeats": repeats, "trace": trace, "seed": seed,
             "memory_budget_bytes": int(memory_budget * GiB) if memory_budget is not None else None}
    values.update({k: v for k, v in typed.items() if v is not None})
    if "model" not in values:
        raise BadInputError("MODEL is missing.", hint="Pass a model dir, a config.json or a preset "
                                                       "(e.g. copt profile model llama-3.2-1b), or --expect R.yaml.")
    settings = ModelProfileSettings(**values)
    settings.validate()

    from clusteropt_cli.core.profile.model import profile_model

    report = profile_model(settings, log=console.log)
    _write_report(report, report_path)
    comparison = None
    if expectation is not None:
        from clusteropt_cli.core.profile.expect import compare_to_prediction

        comparison = compare_to_prediction(report, expectation, tolerance)
    _finish(report, comparison, json_out, _render_model, report_path)


# ---- profile endpoint --------------------------------------------------------------------------------------
def _int_list(text: str | None, flag: str) -> list[int]:
    try:
        return _number_list(text, flag, int)
    except ValueError:
        raise BadInputError(f"{flag} {text!r} is not a comma-separated list of integers.",
                            hint=f"e.g. {flag} 1,8,32") from None


def _float_list(text: str | None, flag: str) -> list[float]:
    try:
        return _number_list(text, flag, float)
    except ValueError:
        raise BadInputError(f"{flag} {text!r} is not a comma-separated list of numbers.",
                            hint=f"e.g. {flag} 2,4") from None


def _number_list(text: str | None, flag: str, kind: type) -> list:
    """A typed comma-separated list of `kind` (None: not given, []); one that names no value (',', '') is refused."""
    if text is None:
        return []
    values = [kind(part) for part in text.split(",") if part.strip()]
    if not values:  # ',' or '' read as no list at all: the default level ran instead of the one meant
        example = "1,8,32" if kind is int else "2,4"
        raise BadInputError(f"{flag} {text!r} names no value.", hint=f"e.g. {flag} {example}")
    return values


def _endpoint_from_file(path: Path, load_flags: list[str], *, expect: str | None, tolerance: float,
                        report_path: Path | None, plot: Path | None, save_vllm_bench: Path | None,
                        save_guidellm: Path | None, overwrite: bool, json_out: bool) -> None:
    """`profile endpoint --from-profile FILE`: a saved measurement (copt, guidellm or vllm bench serve JSON) in
    place of a load test: rendered, written in the --report/--save-* formats, checked against --expect."""
    from clusteropt_cli.core.profile.report import load_profile

    if load_flags:
        raise BadInputError(f"--from-profile takes the measurement from {path}; {', '.join(load_flags)} "
                            "configure a load test and do not apply.",
                            hint="Drop them, or measure the server without --from-profile.")
    report = load_profile(str(path))
    if report.kind != "endpoint" or not report.levels:
        raise BadInputError(f"--from-profile {path}: a {report.kind} profile with no endpoint levels; profile "
                            "endpoint reads endpoint measurements.",
                            hint="Check a model profile's recipe with 'copt profile model --expect'.")
    expectation = None
    if expect is not None:
        from clusteropt_cli.core.profile.expect import load_expectation

        expectation = load_expectation(expect)
        if expectation.task != "serve":
            raise BadInputError(f"--expect {expect}: profile endpoint checks a serve recipe (this one is task "
                                f"{expectation.task}).")
        want = expectation.assumptions.get("concurrency", expectation.assumptions.get("batch"))
        open_rate = expectation.assumptions.get("open_loop_rate")
        have = [lv.concurrency for lv in report.levels]
        measured = ", ".join(f"concurrency {c}" if c is not None else f"rate {lv.rate}/s"
                             for c, lv in zip(have, report.levels, strict=True))
        if open_rate is not None:
            if open_rate not in [lv.rate for lv in report.levels if lv.concurrency is None]:
                raise BadInputError(
                    f"--expect {expect} predicts an open loop at {open_rate} requests/s; {path} measured {measured}.",
                    hint=f"Measure it: copt profile endpoint --expect {expect} (it sends the recipe's rate for its "
                         f"duration), or guidellm --profile poisson --rate {open_rate}.")
        elif want is not None and want not in have:
            raise BadInputError(f"--expect {expect} predicts concurrency {want}; {path} measured {measured}.",
                                hint=f"Measure concurrency {want} (copt profile endpoint --expect {expect}, or "
                                     f"guidellm --profile concurrent --rate {want}).")
    vllm_paths: list[Path] = []
    if save_vllm_bench is not None:  # one file per level, named as a live sweep names them
        tags = [f"c{lv.concurrency}" if lv.concurrency is not None else f"r{lv.rate}" if lv.rate else str(i)
                for i, lv in enumerate(report.levels)]
        vllm_paths = [save_vllm_bench] if len(tags) == 1 else [
            save_vllm_bench.with_name(f"{save_vllm_bench.stem}-{tag}{save_vllm_bench.suffix or '.json'}")
            for tag in tags]
    _check_outputs({f"--save-vllm-bench ({p.name})": p for p in vllm_paths}, overwrite,
                   inputs={"--from-profile": path, "--expect": expect})
    if plot is not None:
        from clusteropt_cli.deps import require

        require("matplotlib", "profile")
    _emit_endpoint(report, report_path, vllm_paths, save_guidellm, plot, expectation, tolerance, json_out,
                   report_path or path)


@app.command("endpoint")
def endpoint(
    url: Annotated[str | None, typer.Option(
        "--url", help="Server root, e.g. http://127.0.0.1:8000 (or its /v1 base); with --expect, default: the "
                      "recipe's host and port.", show_default=False)] = None,
    model_name: Annotated[str | None, typer.Option(
        "--model", help="Model name the server serves (GET /v1/models); with --expect, default: the recipe's "
                        "served_model_name or model.", show_default=False)] = None,
    concurrency: Annotated[str | None, typer.Option(
        "--concurrency", help="Concurrent requests, a sweep: 1,8,32. (default: 1)")] = None,
    rate: Annotated[str | None, typer.Option(
        "--rate", help="Poisson arrivals in requests/s (one or a list: 2,4) instead of --concurrency.")] = None,
    num_requests: Annotated[int | None, typer.Option(
        "--num-requests", help="Requests per level (default: 4 per concurrent slot, at least 8; 32 per rate).")
    ] = None,
    duration: Annotated[float | None, typer.Option(
        "--duration", help="Seconds per level in which requests are sent (those in flight then finish, each "
                           "within --request-timeout).")] = None,
    prompt_len: Annotated[int | None, typer.Option(
        "--prompt-len", help="Synthetic prompt length in tokens (default 128; with --expect, the predicted "
                             "workload's).", show_default=False)] = None,
    gen_len: Annotated[int | None, typer.Option(
        "--gen-len", help="max_tokens per request (default 64; with --expect, the predicted workload's).",
        show_default=False)] = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", help="Sampling temperature of the requests (default 0: greedy; with --expect, the "
                              "predicted workload's).", show_default=False)] = None,
    top_p: Annotated[float | None, typer.Option(
        "--top-p", help="top_p of the requests (default: not sent; with --expect, the predicted workload's).",
        show_default=False)] = None,
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="top_k of the requests, vLLM's extra parameter (default: not sent; with --expect, the "
                        "predicted workload's).", show_default=False)] = None,
    dataset: Annotated[Path | None, typer.Option(
        "--dataset", help="A .jsonl of prompts ({\"prompt\": ...} or {\"text\": ...}) instead of synthetic ones.")
    ] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="Local tokenizer dir: synthetic prompts of exactly --prompt-len tokens.")] = None,
    slo_ttft_ms: Annotated[float | None, typer.Option("--slo-ttft-ms", help="TTFT SLO for goodput.")] = None,
    slo_tpot_ms: Annotated[float | None, typer.Option("--slo-tpot-ms", help="TPOT SLO for goodput.")] = None,
    request_timeout: Annotated[float, typer.Option("--request-timeout", help="Seconds per request at most.")] = 60.0,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed requests before the sweep.")] = 1,
    client_processes: Annotated[int | None, typer.Option(
        "--client-processes", help="Processes that send each concurrency level, each with its own event loop "
        "(default: one per 64 streams, at most half the host's cores and 8).", show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="OPENAI_API_KEY", show_envvar=False,
                                                help="Bearer token for the server.")] = None,
    ignore_eos: Annotated[bool | None, typer.Option(
        "--ignore-eos/--no-ignore-eos", help="Ask for exactly --gen-len tokens with vLLM's ignore_eos (default: "
        "sent, and dropped if the server rejects it; --ignore-eos insists, --no-ignore-eos never sends it).",
        show_default=False)] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="PNG: throughput against TTFT/TPOT per level.")] = None,
    save_vllm_bench: Annotated[Path | None, typer.Option(
        "--save-vllm-bench", help="Also write the result in `vllm bench serve --save-result`'s JSON (one file per "
                                  "level: NAME-c8.json, NAME-r2.0.json when there are several).")] = None,
    save_guidellm: Annotated[Path | None, typer.Option(
        "--save-guidellm", help="Also write the result as a guidellm benchmarks report JSON (one benchmark per "
                                "level, in one file).")] = None,
    save_requests: Annotated[Path | None, typer.Option(
        "--save-requests", help="Also write every timed request as a line of JSON: level, sent_at (Unix time), ok, "
                                "error, ttft_s, tpot_s, e2e_s, output_tokens, prompt_tokens.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for the synthetic prompts' bodies and the Poisson "
                                      "arrivals; every run puts its own random head on each prompt, so a second run "
                                      "is not served from the server's prefix cache.")] = 0,
    from_profile: Annotated[Path | None, typer.Option(
        "--from-profile", help="Take the measurement from this file (a copt endpoint profile, a guidellm report "
                               "or a vllm bench serve result) instead of load-testing a server: check it with "
                               "--expect, convert it with --report/--save-*.")] = None,
    expect: ExpectOpt = None,
    tolerance: ToleranceOpt = 0.10,
    report_path: ReportOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Load-test an OpenAI-compatible server (streaming /v1/completions): TTFT, ITL, TPOT, E2E per level."""
    from clusteropt_cli.core.profile.settings import EndpointSettings

    _check_outputs({"--report": report_path, "--plot": plot, "--save-vllm-bench": save_vllm_bench,
                    "--save-guidellm": save_guidellm, "--save-requests": save_requests}, overwrite,
                   inputs={"--dataset": dataset, "--tokenizer": tokenizer, "--expect": expect,
                           "--from-profile": from_profile})
    if plot is not None and plot.suffix.lower() != ".png":
        raise BadInputError(f"--plot {plot}: the plot is a PNG; name the file *.png.")
    if from_profile is not None:
        if save_requests is not None:
            raise BadInputError("--save-requests records the requests of a live run; --from-profile reads a "
                                "finished one.", hint="Drop --save-requests, or load-test the server with --url.")
        load_flags = {"--url": url, "--model": model_name, "--concurrency": concurrency, "--rate": rate,
                      "--num-requests": num_requests, "--duration": duration, "--prompt-len": prompt_len,
                      "--gen-len": gen_len, "--temperature": temperature, "--top-p": top_p, "--top-k": top_k,
                      "--dataset": dataset,
                      "--tokenizer": tokenizer, "--slo-ttft-ms": slo_ttft_ms, "--slo-tpot-ms": slo_tpot_ms,
                      "--ignore-eos": ignore_eos, "--client-processes": client_processes}
        _endpoint_from_file(from_profile, [flag for flag, value in load_flags.items() if value is not None],
                            expect=expect, tolerance=tolerance, report_path=report_path, plot=plot,
                            save_vllm_bench=save_vllm_bench, save_guidellm=save_guidellm, overwrite=overwrite,
                            json_out=json_out)
        return
    expectation = None
    given = {"url": url, "model": model_name, "concurrency": _int_list(concurrency, "--concurrency"),
             "prompt_len": prompt_len, "gen_len": gen_len, "temperature": temperature, "top_p": top_p,
             "top_k": top_k}
    if expect is not None:  # the endpoint and workload the prediction is for, where not typed
        from clusteropt_cli.core.profile.expect import endpoint_values_from_recipe, load_expectation

        expectation = load_expectation(expect)
        given = endpoint_values_from_recipe(expectation, given, rate_given=bool(rate))
    missing = [flag for flag, key in (("--url", "url"), ("--model", "model")) if not given[key]]
    if missing:
        raise BadInputError(f"{' and '.join(missing)} required.", hint="Name the server and the model it serves, "
                                                                        "or pass --expect with a serve recipe.")
    settings = EndpointSettings(
        url=given["url"], model=given["model"], concurrency=given["concurrency"],
        rate=_float_list(rate, "--rate") or given.get("rate", []),
        # a typed bound replaces the recipe's open-loop bound (both typed: both apply, as without a recipe)
        num_requests=num_requests if num_requests is not None or duration is not None else given.get("num_requests"),
        duration_s=duration if duration is not None or num_requests is not None else given.get("duration_s"),
        # a typed 0 is checked (validate), not replaced by the default
        prompt_len=128 if given["prompt_len"] is None else given["prompt_len"],
        gen_len=64 if given["gen_len"] is None else given["gen_len"], dataset=dataset, tokenizer=tokenizer,
        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, request_timeout_s=request_timeout, warmup=warmup,
        api_key=api_key, ignore_eos=ignore_eos, seed=seed, temperature=given["temperature"] or 0.0,
        top_p=given.get("top_p"), top_k=given.get("top_k"), client_processes=client_processes)
    settings.validate()
    bench_paths = (_vllm_bench_paths(save_vllm_bench, settings.concurrency, settings.rate)
                   if save_vllm_bench is not None else [])
    _check_outputs({f"--save-vllm-bench ({p.name})": p for p in bench_paths}, overwrite,
                   inputs={"--dataset": dataset, "--tokenizer": tokenizer, "--expect": expect})
    if plot is not None:
        from clusteropt_cli.deps import require

        require("matplotlib", "profile")
    from clusteropt_cli.deps import require

    require("aiohttp", "profile")
    from clusteropt_cli.core.profile.endpoint import profile_endpoint

    requests_out: list[dict[str, Any]] | None = [] if save_requests is not None else None
    report = profile_endpoint(settings, log=console.log, requests_out=requests_out)
    if save_requests is not None:
        import json

        from clusteropt_cli.core.io import atomic_write_text

        atomic_write_text(save_requests, "".join(json.dumps(row) + "\n" for row in requests_out))
        console.log(f"{len(requests_out)} requests written to {save_requests}")
    _emit_endpoint(report, report_path, bench_paths, save_guidellm, plot, expectation, tolerance, json_out,
                   report_path)


def _emit_endpoint(report: Any, report_path: Path | None, vllm_paths: list[Path], save_guidellm: Path | None,
                   plot: Path | None, expectation: Any, tolerance: float, json_out: bool, source: Path | None) -> None:
    """Write an endpoint report's files (report, vllm-bench, guidellm, plot), compare it with --expect, render it."""
    _write_report(report, report_path)
    if vllm_paths:
        _write_vllm_bench(report, vllm_paths)
    if save_guidellm is not None:
        _write_guidellm(report, save_guidellm)
    if plot is not None:
        from clusteropt_cli.core.profile.plot import plot_endpoint

        plot_endpoint(report, plot)
        console.log(f"plot written to {plot}")
    comparison = None
    if expectation is not None:
        from clusteropt_cli.core.profile.expect import compare_to_prediction

        comparison = compare_to_prediction(report, expectation, tolerance)
    _finish(report, comparison, json_out, _render_endpoint, source)
