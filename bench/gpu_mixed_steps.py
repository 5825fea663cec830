#!/usr/bin/env python3
"""Where a loaded engine's steps go, greedy against sampled requests: the in-process engine with `copt serve`'s
defaults under a closed loop of --clients clients (each submits a request of --prompt-len random prompt tokens and
--out-tokens output tokens, ignore_eos, and its next one when it finishes), one variant after another in the same
process:

- greedy; sampled at temperature 1 alone; sampled with top_p 0.95 (copt's default first-token path: a prefill
  step's first tokens through a captured sampling graph of their own count, staged in rows 0..n-1);
- the same top-p requests with the first tokens sampled in their slots' own rows (the graph of the bucket above the
  highest slot, up to runner.GRAPHED_FIRST_TOKEN_ROWS rows, the eager kernels above), in their own rows at every
  size ("-rows-all"), and always on the eager path.

A name given twice in --variants runs twice (the second "#2"): the spread between repeats is the noise.

Per variant: output tok/s, the engine's phase ms per step (prefill forward, first-token sampling, decode, emit), the
mean step wall by (running rows, prompt chunks) from its step trace, and a torch.profiler window's costliest CPU ops
and kernels.

    python3 bench/gpu_mixed_steps.py --shapes 1b --out $OUT/mixed.json    (~5 minutes a shape on an H100 or H200)
    python3 bench/gpu_mixed_steps.py --smoke --out /tmp/mixed.json       (tiny model on the CPU: checks the script)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, summarize_kernels  # noqa: E402
from gpu_serve_models import SHAPES, SMOKE_SHAPE, make_model_dir  # noqa: E402

PHASES = ("schedule", "prefill_forward", "prefill_sample_sync", "decode_forward", "decode_sample_sync", "emit",
          "bookkeeping")
TOP_P = {"temperature": 1.0, "top_p": 0.95}
# name: (sampling settings, first-token path: None = copt's default (staged), "rows" = the slots' own rows up to
# GRAPHED_FIRST_TOKEN_ROWS, "rows-all" = the slots' own rows at every size, "eager" = never a graph)
VARIANTS = {"greedy": ({"temperature": 0.0}, None), "t1.0": ({"temperature": 1.0}, None),
            "t1.0p95": (TOP_P, None), "t1.0p95-rows": (TOP_P, "rows"), "t1.0p95-rows-all": (TOP_P, "rows-all"),
            "t1.0p95-eager": (TOP_P, "eager")}
DEFAULT_VARIANTS = "greedy,t1.0,t1.0p95,t1.0p95-rows,t1.0p95-eager,t1.0p95,t1.0p95-rows"


def closed_loop(engine, vocab: int, clients: int, seconds: float, warmup: float, sampling: dict,  # noqa: ANN001
                prompt_len: int, out_tokens: int, rng: random.Random, profile_s: float = 0.0) -> dict:
    """Keep `clients` requests in flight for warmup + seconds; measure the last `seconds` (and profile the first
    profile_s of them, when asked)."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    def request() -> GenerationRequest:
        seed = {"seed": rng.randrange(1 << 30)} if sampling.get("temperature") else {}
        return GenerationRequest(prompt_ids=[rng.randrange(10, vocab - 10) for _ in range(prompt_len)],
                                 max_new_tokens=out_tokens, ignore_eos=True, **sampling, **seed)

    handles = [engine.submit(request()) for _ in range(clients)]
    t_start = time.perf_counter()
    marks: dict = {}
    prof = None
    while True:
        now = time.perf_counter()
        if "t0" not in marks and now - t_start >= warmup:
            marks.update(t0=now, tokens0=engine.stats.generated_tokens, phases0=dict(engine.stats.phase_s),
                         steps0=len(engine._trace.steps))
            if profile_s > 0:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.runner.device.type == "cuda"
                                                 else [])
                prof = profile(activities=acts)
                prof.__enter__()
                marks["prof_t0"], marks["prof_steps0"] = now, len(engine._trace.steps)
        if prof is not None and now - marks["prof_t0"] >= profile_s:
            prof.__exit__(None, None, None)
            marks["prof_wall"], marks["prof_steps"] = now - marks["prof_t0"], (len(engine._trace.steps)
                                                                                - marks["prof_steps0"])
            marks["prof"], prof = prof, None
        if "t0" in marks and now - marks["t0"] >= seconds:
            break
        for i, h in enumerate(handles):
            if h.done:
                handles[i] = engine.submit(request())
        time.sleep(0.0005)
    t1 = time.perf_counter()
    tokens = engine.stats.generated_tokens - marks["tokens0"]
    steps = engine._trace.steps[marks["steps0"]:]
    for h in handles:  # drain: the next variant starts from an idle engine
        h.cancel()
    for h in handles:
        h.result(timeout=120)
    phases = {p: engine.stats.phase_s.get(p, 0.0) - marks["phases0"].get(p, 0.0) for p in PHASES}
    out = {"output_tok_s": round(tokens / (t1 - marks["t0"]), 1), "steps": len(steps),
           "step_ms_mean": round(1e3 * (t1 - marks["t0"]) / max(len(steps), 1), 3),
           "phase_ms_per_step": {p: round(1e3 * v / max(len(steps), 1), 3) for p, v in phases.items()},
           "by_rows_chunks": by_rows_chunks(steps, prompt_len)}
    prefill_steps = [s for s in steps if s[6] > 0]
    if prefill_steps:
        out["first_token_sampling_ms_per_prefill_step"] = round(1e3 * phases["prefill_sample_sync"]
                                                                / len(prefill_steps), 3)
        out["prefill_forward_ms_per_prefill_step"] = round(1e3 * phases["prefill_forward"] / len(prefill_steps), 3)
    if "prof" in marks:
        n = max(marks["prof_steps"], 1)
        summary = summarize_kernels(marks["prof"], marks["prof_wall"], n)
        cpu = sorted(marks["prof"].key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
        out["profiled"] = {"wall_ms_per_step": round(summary["wall_ms_per_step"], 3),
                           "gpu_kernel_ms_per_step": round(summary["gpu_kernel_ms_per_step"], 3),
                           "kernels_per_step": round(summary["kernels_per_step"], 1),
                           "top_kernels": summary["top_kernels"][:15],
                           "top_cpu_ops": [{"name": e.key[:90], "self_cpu_ms_per_step": round(
                               e.self_cpu_time_total / 1e3 / n, 4), "calls_per_step": round(e.count / n, 2)}
                               for e in cpu]}
    return out


def same_tokens(engine, vocab: int, fillers: int, prompt_len: int, rng: random.Random) -> dict:  # noqa: ANN001
    """Seeded top-p requests (with and without penalties) admitted while `fillers` greedy requests hold the low
    slots, so their first tokens come from high slots: staged (copt's default) against the eager path, the same
    prompts and seeds. Returns how many of them got the same first 4 tokens both ways."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    runner = engine.runner
    tests = [GenerationRequest(prompt_ids=[rng.randrange(10, vocab - 10) for _ in range(prompt_len)],
                               max_new_tokens=4, ignore_eos=True, seed=100 + i, **TOP_P,
                               **({"presence_penalty": 0.5, "repetition_penalty": 1.1} if i % 2 else {}))
             for i in range(8)]
    outputs = {}
    for path in ("staged", "eager"):
        runner.graphed_first_tokens = path == "staged"
        if engine.pool is not None:
            engine.pool.reset_cache()  # no prefix-cache hit on the second pass: the same prefill both ways
        held = [engine.submit(GenerationRequest(prompt_ids=[rng.randrange(10, vocab - 10) for _ in range(16)],
                                                max_new_tokens=10_000 if fillers else 1, ignore_eos=True))
                for _ in range(fillers)]
        started: set[int] = set()
        while len(started) < fillers:  # every filler holds its slot (it has a token)
            started.update(i for i, h in enumerate(held) if i not in started and (h.take()[0] or h.done))
            time.sleep(0.01)
        outputs[path] = [h.result(timeout=120).output_ids for h in [engine.submit(t) for t in tests]]
        for h in held:
            h.cancel()
        for h in held:
            h.result(timeout=120)
    runner.graphed_first_tokens = True
    same = sum(a == b for a, b in zip(outputs["staged"], outputs["eager"], strict=True))
    return {"requests": len(tests), "same_first_4_tokens": same}


def by_rows_chunks(steps: list, prompt_len: int) -> dict:
    """Mean step wall (ms) and count per (running rows bucket of 32, prompt chunks), from the trace's steps."""
    groups: dict[str, list[float]] = {}
    for t0, t1, running, _waiting, _dec, _chained, prompt_tokens, _gen in steps:
        chunks = -(-prompt_tokens // prompt_len)
        key = f"rows {running // 32 * 32:3d}-{running // 32 * 32 + 31:3d}, {chunks} chunks"
        groups.setdefault(key, []).append(1e3 * (t1 - t0))
    return {k: {"steps": len(v), "ms_mean": round(statistics.fmean(v), 3), "ms_p50": round(statistics.median(v), 3)}
            for k, v in sorted(groups.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="1b")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="in this order: " + ", ".join(VARIANTS))
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds per variant")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds per variant before measuring")
    parser.add_argument("--profile-s", type=float, default=1.0, help="torch.profiler window per variant (0: off)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--out-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()

    import torch

    from clusteropt_cli.core.serve.engine import Engine, StepTrace
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.clients, args.seconds, args.warmup, args.prompt_len, args.out_tokens = 4, 2.0, 1.0, 16, 8
        args.profile_s = min(args.profile_s, 0.5)
    report: dict = {"bench": "gpu_mixed_steps", "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
                    "clients": args.clients, "prompt_len": args.prompt_len, "out_tokens": args.out_tokens,
                    "seconds": args.seconds, "shapes": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2))

    rng = random.Random(0)
    for shape in ["smoke"] if args.smoke else args.shapes.split(","):
        spec = SMOKE_SHAPE if args.smoke else SHAPES[shape]
        work = Path(tempfile.mkdtemp(prefix=f"copt-mixed-{shape}-"))
        made = make_model_dir(work / "model", spec)
        t0 = time.perf_counter()
        recipe = ServeRecipe(model=str(work / "model"), max_model_len=args.max_model_len)
        engine = Engine.from_settings(recipe, device=None if cuda else "cpu")
        engine._trace = StepTrace(str(work))  # read in place, never written
        engine.start()
        out: dict = {"startup_s": round(time.perf_counter() - t0, 1), "variants": {}}
        report["shapes"][shape] = out
        runner = engine.runner
        default_rows = runner.GRAPHED_FIRST_TOKEN_ROWS
        log(f"{shape}: engine started in {out['startup_s']} s (first tokens graphed up to {default_rows} rows)")
        if cuda:  # what the first-token stage's graphs add to the start-up (captured again, the same way)
            t = time.perf_counter()
            with torch.inference_mode():
                runner.capture_first_token_stage()
            torch.cuda.synchronize()
            out["first_token_stage_capture_s"] = round(time.perf_counter() - t, 2)
            log(f"{shape}: the first-token stage's graphs captured in {out['first_token_stage_capture_s']} s")
        try:
            out["same_tokens"] = same_tokens(engine, made["vocab"], min(200, args.clients), args.prompt_len, rng)
            log(f"{shape}: staged against eager first tokens: {out['same_tokens']}")
            for key in args.variants.split(","):
                sampling, path = VARIANTS[key]
                name = key if key not in out["variants"] else f"{key}#2"
                runner.graphed_first_tokens = path != "eager"
                runner.staged_first_tokens = path is None
                runner.GRAPHED_FIRST_TOKEN_ROWS = 1 << 20 if path == "rows-all" else default_rows
                r = closed_loop(engine, made["vocab"], args.clients, args.seconds, args.warmup, sampling,
                                args.prompt_len, args.out_tokens, rng, args.profile_s)
                out["variants"][name] = r
                ph = r["phase_ms_per_step"]
                log(f"{shape} {name}: {r['output_tok_s']:.0f} tok/s, {r['steps']} steps of {r['step_ms_mean']:.2f} ms;"
                    f" first-token sampling {r.get('first_token_sampling_ms_per_prefill_step', 0):.2f} ms and prefill"
                    f" forward {r.get('prefill_forward_ms_per_prefill_step', 0):.2f} ms per prefill step; per step "
                    + ", ".join(f"{k} {v:.2f}" for k, v in ph.items() if v))
                save()
        finally:
            runner.graphed_first_tokens, runner.staged_first_tokens = True, True
            runner.GRAPHED_FIRST_TOKEN_ROWS = default_rows
            engine.stop()
        out["sampler_errors"] = {n: getattr(runner.sampler, n, None)
                                 for n in ("graph_error", "compile_error", "nucleus_error")}
        save()
        del engine, runner
        if cuda:
            torch.cuda.empty_cache()
    save()
    for shape, out in report["shapes"].items():
        print(f"{shape}: variant | tok/s | step ms | first-token ms/prefill step | 8-chunk steps at 224-255 rows ms")
        for name, r in out["variants"].items():
            eight = r["by_rows_chunks"].get("rows 224-255, 8 chunks", {}).get("ms_mean")
            print(f"  {name:14s} | {r['output_tok_s']:9.0f} | {r['step_ms_mean']:6.2f} | "
                  f"{r.get('first_token_sampling_ms_per_prefill_step', 0):6.2f} | {eight}")


if __name__ == "__main__":
    main()
