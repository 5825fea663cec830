#!/usr/bin/env python3
"""Where copt serve's time to first token goes at batch 1: the in-process engine with `copt serve`'s defaults, one
request at a time (prompt lengths 32 to 4,096, one output token), its TTFT split into the engine's phases
(scheduling, the prefill forward, the first token's sampling, emission) and, under torch.profiler, the prefill's GPU
kernel time and kernel count against its wall time (kernel time well under wall time: the host launches are the
cost, not the GPU). Each prefill variant (--prefill: graphs, copt's default with captured prefill steps, and eager,
the same engine with its prefill graphs set aside) runs in the same process.

    python3 bench/gpu_ttft_profile.py --shapes 1b,8b --out $OUT/ttft.json     (~3 minutes on the H200)
    python3 bench/gpu_ttft_profile.py --smoke --out /tmp/ttft.json            (tiny model on the CPU: checks the script)

Prompts are random token ids, new for every request (no prefix-cache hits). Greedy, and sampled (temperature 1
alone, with top_p 0.95, with top_k 50) at the shortest length. JSON: per shape, "<variant>/<mode>_<prompt length>":
ttft_ms (median of --repeats), per-phase ms, and for the profiled lengths gpu_kernel_ms, kernels and the costliest
kernels; same_greedy_tokens: whether fixed prompts (5 to 1,500 tokens, alone and together) give the same 8
greedy tokens in both variants.
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

from common import free_gpu, log, summarize_kernels  # noqa: E402
from gpu_serve_models import SHAPES, SMOKE_SHAPE, make_model_dir  # noqa: E402

PHASES = ("schedule", "prefill_forward", "prefill_sample_sync", "emit", "bookkeeping")


# the sampled settings measured at the shortest prompt length (temperature 1 alone, with top_p, with top_k)
SAMPLED = {"t1.0": {"temperature": 1.0}, "t1.0p95": {"temperature": 1.0, "top_p": 0.95},
           "t1.0k50": {"temperature": 1.0, "top_k": 50}}


def one(engine, vocab: int, length: int, rng: random.Random, temperature: float = 0.0,  # noqa: ANN001
        **sampling: float) -> dict:
    """One request of `length` random prompt tokens and one output token: TTFT and the engine's phase times."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    before = dict(engine.stats.phase_s)
    prompt = [rng.randrange(10, vocab - 10) for _ in range(length)]
    req = GenerationRequest(prompt_ids=prompt, max_new_tokens=1, ignore_eos=True, temperature=temperature,
                            **({"seed": rng.randrange(1 << 30)} if temperature else {}), **sampling)
    t = time.perf_counter()
    result = engine.generate([req])[0]
    wall = time.perf_counter() - t
    after = engine.stats.phase_s
    phases = {p: 1e3 * (after.get(p, 0.0) - before.get(p, 0.0)) for p in PHASES}
    return {"ttft_ms": 1e3 * result.ttft_s, "wall_ms": 1e3 * wall, **{f"{p}_ms": v for p, v in phases.items()}}


def measure(engine, vocab: int, variant: str, out: dict) -> None:  # noqa: ANN001
    """Every prompt length (and the SAMPLED settings at the shortest), profiling the --profile-lengths."""
    from torch.profiler import ProfilerActivity, profile

    args, rng, cuda = CTX["args"], CTX["rng"], CTX["cuda"]
    lengths, profiled = CTX["lengths"], CTX["profiled"]
    for length in lengths:
        cases = [("greedy", {"temperature": 0.0})] + (list(SAMPLED.items()) if length == lengths[0] else [])
        for mode, sampling in cases:
            runs = [one(engine, vocab, length, rng, **sampling) for _ in range(args.repeats)]
            row = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
            row["ttft_ms_runs"] = [round(r["ttft_ms"], 3) for r in runs]
            if mode == "greedy" and length in profiled:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    r = one(engine, vocab, length, rng)
                summary = summarize_kernels(prof, r["wall_ms"] / 1e3, 1)
                row["profiled_wall_ms"] = round(r["wall_ms"], 3)
                row["gpu_kernel_ms"] = round(summary["gpu_kernel_ms_per_step"], 3)
                row["kernels"] = summary["kernels_per_step"]
                row["by_category_ms"] = summary["by_category_ms_per_step"]
                row["top_kernels"] = summary["top_kernels"][:12]
                cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
                row["top_cpu_ops"] = [{"name": e.key[:80], "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                                       "calls": e.count} for e in cpu]
            out[f"{variant}/{mode}_{length}"] = row
            log(f"{CTX['shape']} {variant} {mode} prompt {length}: TTFT {row['ttft_ms']:.2f} ms (prefill forward "
                f"{row['prefill_forward_ms']:.2f}, first-token sampling {row['prefill_sample_sync_ms']:.2f}, "
                f"schedule {row['schedule_ms']:.2f}, emit {row['emit_ms']:.2f})"
                + (f"; GPU kernels {row['gpu_kernel_ms']:.2f} ms in {row['kernels']:.0f} kernels"
                   if "gpu_kernel_ms" in row else ""))
            CTX["save"]()


def first_token_paths(engine, vocab: int, out: dict) -> None:  # noqa: ANN001
    """Sampled requests with their first token chosen through the captured sampling graph (the default) and on
    the eager path (runner.graphed_first_tokens off): TTFT of each and whether the same seeded requests got the same
    first four tokens both ways."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    args, runner = CTX["args"], engine.runner
    length = CTX["lengths"][0]
    paths: dict = {}
    for m, (mode, sampling) in enumerate(SAMPLED.items()):
        row: dict = {}
        for graphed in (True, False):
            runner.graphed_first_tokens = graphed
            ttfts, tokens = [], []
            for i in range(args.repeats):
                # the same prompts on both paths, the prefix cache emptied first: a hit would prefill the prompt's
                # rest eagerly (tens of ms at batch 1) instead of through a captured prefill graph
                prompt = random.Random(f"{m}-{i}").sample(range(10, vocab - 10), length)
                if engine.pool is not None:
                    engine.pool.reset_cache()
                req = GenerationRequest(prompt_ids=prompt, max_new_tokens=4, ignore_eos=True, seed=7 + i, **sampling)
                result = engine.generate([req])[0]
                ttfts.append(1e3 * result.ttft_s)
                tokens.append(result.output_ids)
            row["graph" if graphed else "eager"] = {"ttft_ms": round(statistics.median(ttfts), 3), "tokens": tokens}
        runner.graphed_first_tokens = True
        row["same_tokens"] = row["graph"]["tokens"] == row["eager"]["tokens"]
        paths[mode] = row
        log(f"{CTX['shape']} first sampled token {mode} prompt {length}: TTFT through the sampling graph "
            f"{row['graph']['ttft_ms']:.2f} ms, eager {row['eager']['ttft_ms']:.2f} ms; same tokens "
            f"{row['same_tokens']}")
    out["first_token_paths"] = paths
    CTX["save"]()


CTX: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--lengths", default="32,256,1024,4096")
    parser.add_argument("--profile-lengths", default="32,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="smaller than the full context: start-up captures fewer decode graphs")
    parser.add_argument("--prefill", default="graphs,eager",
                        help="prefill variants, in this order: graphs (copt's default: captured prefill steps), "
                             "eager (the same engine with its prefill graphs set aside)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()

    import torch

    from clusteropt_cli.core.serve.engine import Engine, GenerationRequest
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    cuda = torch.cuda.is_available() and not args.smoke
    lengths = [int(x) for x in args.lengths.split(",")]
    profiled = {int(x) for x in args.profile_lengths.split(",")}
    if args.smoke:
        lengths, profiled = [8, 32], {8}
    report: dict = {"bench": "gpu_ttft_profile", "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
                    "max_model_len": args.max_model_len, "shapes": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    variants = args.prefill.split(",")

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2))

    CTX.update(args=args, rng=rng, cuda=cuda, lengths=lengths, profiled=profiled, save=save)
    for shape in ([] if args.smoke else args.shapes.split(",")) or ["smoke"]:
        spec = SMOKE_SHAPE if args.smoke else SHAPES[shape]
        work = Path(tempfile.mkdtemp(prefix=f"copt-ttft-{shape}-"))
        made = make_model_dir(work / "model", spec)
        t0 = time.perf_counter()
        recipe = ServeRecipe(model=str(work / "model"), max_model_len=512 if args.smoke else args.max_model_len)
        engine = Engine.from_settings(recipe, device=None if cuda else "cpu")
        engine.start()
        out: dict = {"startup_s": round(time.perf_counter() - t0, 1), "weight_bytes": made["weight_bytes"]}
        report["shapes"][shape] = out
        CTX["shape"] = shape
        vocab = made["vocab"]
        log(f"{shape}: engine started in {out['startup_s']} s")
        try:
            warm: dict = {}
            for _ in range(3):  # warm-up: the allocator, the eager sampling path
                for mode, sampling in [("greedy", {})] + list(SAMPLED.items()):
                    t = time.perf_counter()
                    one(engine, vocab, 64, rng, **sampling)
                    warm.setdefault(mode, []).append(round(time.perf_counter() - t, 3))
            out["warmup_s"] = warm  # seconds per warm-up request: a first one far above the rest compiled something
            log(f"{shape}: warm-up request seconds {warm}")
            runner = engine.runner
            graphs = list(runner._prefill_graphs)
            out["prefill_graphs"] = len(graphs)
            out["prefill_graph_error"] = runner.prefill_graph_error
            sampler = runner.sampler
            out["sampler_errors"] = {name: getattr(sampler, name, None)
                                     for name in ("graph_error", "compile_error", "nucleus_error")}
            log(f"{shape}: sampler errors {out['sampler_errors']}")
            sizes = [n for n in ((5, 32, 300, 1500) if cuda else (5, 40)) if n + 8 <= engine.max_model_len]
            fixed = [random.Random(n).sample(range(10, vocab - 10), n) for n in sizes]
            tokens = {}
            for variant in variants:
                runner._prefill_graphs = graphs if variant == "graphs" else []
                measure(engine, vocab, variant, out)
                if variant == "graphs":
                    first_token_paths(engine, vocab, out)
                # the same greedy tokens either way: one prompt at a time, then all four in one step
                reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=8, ignore_eos=True) for p in fixed]
                tokens[variant] = []
                for batch in [[r] for r in reqs] + [reqs]:
                    if engine.pool is not None:  # no prefix-cache hits: each prompt prefilled from its start
                        engine.pool.reset_cache()
                    tokens[variant] += [x.output_ids for x in engine.generate(batch)]
            runner._prefill_graphs = graphs
            if len(tokens) == 2:
                a, b = tokens.values()
                out["same_greedy_tokens"] = [x == y for x, y in zip(a, b, strict=True)]
                log(f"{shape}: greedy tokens the same with and without prefill graphs: {out['same_greedy_tokens']}")
        finally:
            engine.stop()
            # the runner, its graphs and its sampler hold the engine's KV cache: let go of them too, or the next
            # shape's engine sizes its cache beside this one's and runs out of memory
            runner = graphs = sampler = None  # noqa: F841
            del engine
            free_gpu()
    args.out.write_text(json.dumps(report, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
