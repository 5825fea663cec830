#!/usr/bin/env python3
"""What a packed prefill step of copt serve's engine costs, eager against captured graphs: the in-process engine on
a model shape (random weights), one output token per request, so every step is one packed prefill and its first
tokens. Each case is a batch of prompts submitted at once (the prefix cache emptied before each, so nothing is a
hit):

    8x256      eight whole prompts, one 2,048-token step of 8 segments
    4x256      four, one 1,024-token step
    1x2048     one prompt, one 2,048-token step of one segment
    split      one 300-token and fifteen 256-token prompts: 2,048-token steps in which a prompt is split and the
               next step resumes it (the resumed segment reads cached keys)

Variants of the same engine: "graphs", its prefill graphs as copt serve captures them (on CUDA one per token bucket
through FlashAttention's variable-length kernel, resumed prompts too); "masked", the graphs without that kernel
(the segments of a step under a block-diagonal mask, packed up to --max-packed tokens; new prompts only); "eager",
prefill graphs set aside. Per step: the wall time from the engine's trace (median of --repeats), and under
torch.profiler the GPU kernel time and kernel count of one 8x256 step, with its costliest kernels (kernel time
well under wall time: the host's launches are the cost).

    python3 bench/gpu_prefill_steps.py --shapes 1b,8b --out $OUT/prefill_steps.json   (~4 min, H200)
    python3 bench/gpu_prefill_steps.py --smoke --out /tmp/prefill_steps.json       (tiny model on the CPU)
"""

from __future__ import annotations

import argparse
import json
import os
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

CASES = {"8x256": [256] * 8, "4x256": [256] * 4, "1x2048": [2048], "split": [300] + [256] * 15}


def run_case(engine, vocab: int, lengths: list[int], rng: random.Random) -> float:  # noqa: ANN001
    """Submit one batch of fresh random prompts (one output token each); the wall seconds of generate()."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    if engine.pool is not None:
        engine.pool.reset_cache()
    reqs = [GenerationRequest(prompt_ids=[rng.randrange(10, vocab - 10) for _ in range(n)], max_new_tokens=1,
                              ignore_eos=True) for n in lengths]
    t = time.perf_counter()
    engine.generate(reqs)
    return time.perf_counter() - t


def step_times(trace: dict, windows: list[tuple[str, str, float, float]]) -> dict:
    """Per (variant, case): the median wall ms of the steps that prefilled inside each of its runs, by tokens."""
    out: dict = {}
    for variant, case, t0, t1 in windows:
        steps = [s for s in trace["steps"] if s[0] >= t0 and s[1] <= t1 and s[6] > 0]
        row = out.setdefault(f"{variant}/{case}", {})
        for s in steps:
            row.setdefault(str(s[6]), []).append(1e3 * (s[1] - s[0]))
    return {key: {tokens: {"steps": len(v), "median_ms": round(statistics.median(v), 3)}
                  for tokens, v in sorted(row.items(), key=lambda kv: int(kv[0]))} for key, row in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="1b")
    parser.add_argument("--max-packed", type=int, default=2048,
                        help="masked graphs: packed up to this many tokens (the runner's default: 1,024)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-model-len", type=int, default=2304,
                        help="small: start-up captures fewer decode graphs")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import clusteropt_cli.core.serve.runner as runner_module
    from clusteropt_cli.core.serve.engine import Engine
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    cuda = torch.cuda.is_available() and not args.smoke
    runner_module.PREFILL_GRAPH_MAX_PACKED = args.max_packed
    report: dict = {"bench": "gpu_prefill_steps", "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
                    "max_packed": args.max_packed, "shapes": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for shape in ([] if args.smoke else args.shapes.split(",")) or ["smoke"]:
        spec = SMOKE_SHAPE if args.smoke else SHAPES[shape]
        work = Path(tempfile.mkdtemp(prefix=f"copt-prefill-steps-{shape}-"))
        made = make_model_dir(work / "model", spec)
        os.environ["COPT_ENGINE_TRACE"] = str(work / "trace")
        t0 = time.perf_counter()
        max_len = min(args.max_model_len, 2048) if args.smoke else args.max_model_len
        engine = Engine.from_settings(ServeRecipe(model=str(work / "model"), max_model_len=max_len),
                                      device=None if cuda else "cpu")
        engine.start()
        out: dict = {"startup_s": round(time.perf_counter() - t0, 1), "max_batch_tokens": engine.max_batch_tokens}
        report["shapes"][shape] = out
        vocab = made["vocab"]
        runner = engine.runner
        graphs = list(runner._prefill_graphs)
        out["prefill_graphs"] = sorted({(g.tokens, g.single, g.kernel is not None) for g in graphs})
        out["prefill_graph_error"] = runner.prefill_graph_error
        variants = {"graphs": graphs, "eager": []}
        if any(g.kernel is not None for g in graphs):  # the same engine's masked graphs beside them
            kernel, runner.varlen = runner.varlen, None
            runner.capture_prefill_graphs(engine.max_batch_tokens)
            variants["masked"], runner.varlen = list(runner._prefill_graphs), kernel
        log(f"{shape}: engine started in {out['startup_s']} s; prefill graphs (tokens, one segment, varlen) "
            f"{out['prefill_graphs']}; variants {list(variants)}")
        windows = []
        try:
            for variant, chosen in variants.items():
                runner._prefill_graphs = chosen
                for case, lengths in CASES.items():
                    lengths = [min(n, engine.max_model_len - 8) for n in lengths]
                    run_case(engine, vocab, lengths, rng)  # warm-up
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        run_case(engine, vocab, lengths, rng)
                        windows.append((variant, case, start, time.perf_counter()))
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    wall = run_case(engine, vocab, CASES["8x256"], rng)
                summary = summarize_kernels(prof, wall, 1)
                out[f"{variant}/8x256_profiled"] = {
                    "wall_ms": round(1e3 * wall, 3), "gpu_kernel_ms": round(summary["gpu_kernel_ms_per_step"], 3),
                    "kernels": summary["kernels_per_step"], "by_category_ms": summary["by_category_ms_per_step"],
                    "top_kernels": summary["top_kernels"][:12]}
                log(f"{shape} {variant} 8x256 profiled: wall {1e3 * wall:.2f} ms, GPU kernels "
                    f"{summary['gpu_kernel_ms_per_step']:.2f} ms in {summary['kernels_per_step']:.0f}")
            runner._prefill_graphs = graphs
            out["graph_steps"] = runner.prefill_graph_steps
        finally:
            engine.stop()
            del engine, runner, graphs, variants  # the graphs hold the runner: its memory goes with them
            free_gpu()
        trace_files = sorted((work / "trace").glob("engine-trace-*.json"))
        if trace_files:
            out["steps"] = step_times(json.loads(trace_files[-1].read_text()), windows)
            for key, row in out["steps"].items():
                log(f"{shape} {key}: " + ", ".join(f"{t} tokens {v['median_ms']:.2f} ms (x{v['steps']})"
                                                   for t, v in row.items()))
        args.out.write_text(json.dumps(report, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
