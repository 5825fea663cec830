"""copt quantize: post-training quantization (AWQ, GPTQ, FP8, INT8, RTN) with a quality report."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from clusteropt_cli import console
from clusteropt_cli.options import DryRunOpt, JsonOpt, OverridesArg, OverwriteOpt, RecipeOpt, model_and_overrides
from clusteropt_cli.options import opt as _opt


def quantize(
    model: Annotated[str | None, typer.Argument(help="Local Hugging Face model directory.", show_default=False)] = None,
    overrides: OverridesArg = None,
    method: _opt("--method", "awq | gptq | fp8 | int8 | rtn (default awq).") = None,
    scheme: _opt("--scheme", "llm-compressor preset: W4A16 | W4A16_ASYM | W8A16 (with awq/gptq/rtn) | W8A8 | "
                 "FP8_DYNAMIC; sets bits/group size/symmetry or the method.") = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output directory (default "
                                                "./<model>-<method>-w<bits>g<group>, beside the model when run "
                                                "inside it).", show_default=False)] = None,
    bits: _opt("--bits", "Weight bits 2 | 3 | 4 | 8 (default 4; fp8/int8 are 8).", int) = None,
    group_size: _opt("--group-size", "Columns sharing one scale (default 128; -1 per-channel).", int) = None,
    symmetric: Annotated[bool | None, typer.Option("--symmetric/--asymmetric", help="Integer weights with or "
                                                   "without a zero point (default symmetric).",
                                                   show_default=False)] = None,
    calib: _opt("--calib", "Calibration text: .txt (one sample a line) or .jsonl with a 'text' field.") = None,
    num_samples: _opt("--num-samples", "Calibration samples to use (default 128).", int) = None,
    seq_len: _opt("--seq-len", "Tokens per calibration sample and eval block (default 512).", int) = None,
    ignore: Annotated[list[str] | None, typer.Option("--ignore", help="Module kept in full precision: its exact "
                                                     "name, re:REGEX or a class name; must match a module of the "
                                                     "model (repeat; default lm_head).", show_default=False)] = None,
    backend: _opt("--backend", "llmcompressor (default) | gptqmodel | auto-gptq | autoawq.") = None,
    eval_file: _opt("--eval", "Held-out text file: perplexity before and after.") = None,
    compare_rtn: Annotated[bool | None, typer.Option("--compare-rtn", help="Also score round-to-nearest at the "
                                                     "same bits (needs --eval).", show_default=False)] = None,
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    json_out: JsonOpt = False,
    recipe: RecipeOpt = None,
) -> None:
    """Quantize a causal LM (AWQ, GPTQ, FP8, INT8 or RTN); writes the checkpoint and copt_quant_report.json."""
    from clusteropt_cli.core.quantize import plan, run
    from clusteropt_cli.recipe.load import load_settings

    model, overrides = model_and_overrides(model, overrides)
    settings = load_settings("quantize", recipe, overrides, dict(
        model=model, output=str(output) if output else None, scheme=scheme, method=method, bits=bits,
        group_size=group_size,
        symmetric=symmetric, calib=calib, num_samples=num_samples, seq_len=seq_len, ignore=ignore,
        backend=backend, eval=eval_file, compare_rtn=compare_rtn), flags={"model": "MODEL"})
    the_plan = plan(settings, overwrite=overwrite, recipe=recipe)
    for warning in the_plan.warnings:
        console.warn(warning)
    if dry_run:  # every input validated above; nothing loaded or written
        info = {"model": settings.model, "method": settings.method, "backend": settings.backend,
                "output": str(the_plan.output)}
        if json_out:
            console.print_json(info, "copt.quantize/1")
        else:
            console.out.print(console.kv_table("copt quantize (dry run)", list(info.items())))
        return
    verbose = os.environ.get("COPT_DEBUG", "").lower() in ("1", "true", "yes")
    if not verbose:
        os.environ.setdefault("TQDM_DISABLE", "1")  # library progress bars; ours is on stderr
    console.log(f"quantizing {settings.model} with {settings.method} ({settings.backend}) → {the_plan.output}")
    with console.progress_bar(f"{settings.method}", total=None) as advance, contextlib.redirect_stdout(sys.stderr):
        def progress(stage: str, done: int, total: int) -> None:
            advance(0, info=f"{stage} {done}/{total}" if total else stage)

        report = run(the_plan, progress=progress, verbose=verbose)
    if json_out:
        console.print_json(report, "copt.quantize/1")
        return
    console.out.print(_table(report))


def _fmt_ppl(value: float | None, base: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if base is None or value is base else f"{value:.3f} ({value - base:+.3f})"


def _table(report):
    rows = [
        ("output", report.output),
        ("method", f"{report.method} — {report.scheme}"),
        ("backend", report.backend_version),
        ("size", f"{console.human_bytes(report.size_before_bytes)} → {console.human_bytes(report.size_after_bytes)}"
                 f" ({report.compression_ratio:.2f}x smaller)"),
        ("servable by vLLM", _servable(report)),
        ("calibration", f"{report.calib_samples} samples, {report.calib_tokens} tokens"
         if report.calib_samples else "none"),
        ("quantize time", f"{report.quantize_time_s:.1f} s (total {report.total_time_s:.1f} s)"),
    ]
    if report.ppl_before is not None:
        rows += [("perplexity before", _fmt_ppl(report.ppl_before, None)),
                 ("perplexity after", _fmt_ppl(report.ppl_after, report.ppl_before))]
        if report.ppl_rtn is not None:
            rows.append(("perplexity RTN", _fmt_ppl(report.ppl_rtn, report.ppl_before)))
        if report.kl_divergence is not None:
            rows.append(("KL to the original", f"{report.kl_divergence:.4f} nats/token, top-1 agreement "
                                               f"{report.top1_agreement:.1%} ({report.kl_tokens} tokens)"))
        rows.append(("eval", f"{report.eval_tokens} tokens in blocks of {report.eval_block_len}"))
    rows.append(("sample", repr(report.sample_generation)))
    return console.kv_table("copt quantize", rows)


def _servable(report) -> str:
    info = report.servable_by_vllm or {}
    return f"{'yes' if info.get('servable') else 'no'} ({info.get('reason', '?')})"
