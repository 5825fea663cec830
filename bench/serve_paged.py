#!/usr/bin/env python3
"""copt's engine with the paged KV cache against the slot cache, in the same run (in-process Engine, one GPU).

    python3 bench/serve_paged.py --out $OUT/paged.json            # ~5 minutes on one H200
    python3 bench/serve_paged.py --smoke --out /tmp/paged.json    # tiny model, any machine (checks the script)

Model: the Llama-3.2-1B shape in bf16 with random weights (bench/common.py). Engine defaults otherwise (CUDA graphs
over compiled decoder layers, async scheduling); both layouts get the same KV-cache memory (--kv-gib).

Cases, for kv_layout slots and paged (and paged with the compiled plain-ops decode attention: --standard-variants):
  standard      256 requests, prompts of 32-256 random tokens, 128 output tokens (ignore_eos), greedy and sampled
                (temperature 1.0, top_p 0.95): output tok/s, median of --repeats passes; batch 1: ms per output token
                of one 256-token request
  shared_prefix 256 requests: one 2,000-token system prompt + a 128-token user turn each, 128 output tokens,
                greedy: TTFT p50/p90 and output tok/s (paged with and without prefix caching)
  capacity      sequences of 32k tokens each layout holds in the same memory, from the engine's own sizing code (no
                run): slots with copt's default max_model_len, with --max-model-len 32768 and with the full 131,072
                context; paged (full context served); this shape (--kv-gib) and Llama-3.1-8B's in 100 GiB
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import NUM_REQUESTS, OUT_TOKENS, free_gpu, log, make_model_dir, percentiles, workload  # noqa: E402

LLAMA_8B_KV = dict(num_hidden_layers=32, num_key_value_heads=8, head_dim=128)  # Llama-3.1-8B's KV shape
SYSTEM_TOKENS, USER_TOKENS = 2000, 128


def engine_for(model_dir: str, layout: str, kv_gib: float, max_model_len: int, caching: bool = True,
               max_batch_size: int = 256, decode_attention: str = "auto"):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    config = EngineConfig(model=model_dir, max_batch_size=max_batch_size, max_model_len=max_model_len,
                          kv_cache_memory_gib=kv_gib, kv_layout=layout, enable_prefix_caching=caching,
                          decode_attention=decode_attention)
    return Engine(config).start()


def run_requests(engine, requests) -> dict:
    t0 = time.perf_counter()
    results = engine.generate(requests)
    wall = time.perf_counter() - t0
    out = sum(len(r.output_ids) for r in results)
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    return {"requests": len(results), "output_tokens": out, "wall_s": wall, "output_tok_s": out / wall,
            "ttft_s": percentiles(ttft), "preemptions": engine.stats.preemptions,
            "prefix_cache_hit_rate": (engine.stats.prefix_cache_hits / engine.stats.prefix_cache_queries
                                      if engine.stats.prefix_cache_queries else None)}


def batch1(engine, vocab: int, tokens: int) -> float:
    from clusteropt_cli.core.serve.engine import GenerationRequest

    prompt = workload(vocab, 1, seed=7)[0][:64]
    engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)])  # warm
    r = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True)])[0]
    return 1000 * (r.latency_s - r.ttft_s) / (len(r.output_ids) - 1)


def standard_case(model_dir: str, layout: str, args, vocab: int, decode_attention: str = "auto") -> dict:
    from clusteropt_cli.core.serve.engine import GenerationRequest

    engine = engine_for(model_dir, layout, args.kv_gib, 512, decode_attention=decode_attention)
    try:
        # disjoint prompt sets for the warm-up and every timed pass: the paged cache must find nothing cached.
        # greedy and sampled warm-up requests: whatever compiles at first use is not timed (the first engine of the
        # process would pay it alone)
        warm = [GenerationRequest(prompt_ids=p, max_new_tokens=8, ignore_eos=True,
                                  **({"temperature": 1.0, "top_p": 0.95, "seed": i} if i % 2 else {}))
                for i, p in enumerate(workload(vocab, 32, seed=2))]
        engine.generate(warm)
        out = {"kv_blocks": engine.stats.kv_blocks, "sequences": engine.num_slots,
               "decode_attention": engine.runner.decode_attention, "graphs": engine.stats.graphs_captured}
        for kind, sampling in (("greedy", {}), ("sampled", {"temperature": 1.0, "top_p": 0.95})):
            runs = []
            for r in range(args.repeats):  # a fresh prompt set per pass: nothing of an earlier pass is cached
                prompts = workload(vocab, args.requests, seed=10 + 2 * r + (kind == "sampled"))
                runs.append(run_requests(engine, [
                    GenerationRequest(prompt_ids=p, max_new_tokens=args.out_tokens, ignore_eos=True, **sampling,
                                      **({"seed": i} if sampling else {})) for i, p in enumerate(prompts)]))
            median = sorted(runs, key=lambda x: x["output_tok_s"])[len(runs) // 2]
            out[kind] = {**median, "runs_tok_s": [round(x["output_tok_s"]) for x in runs]}  # in the order they ran
        out["batch1_ms_per_token"] = batch1(engine, vocab, args.batch1_tokens)
        return out
    finally:
        engine.stop()
        del engine
        free_gpu()


def shared_prefix_case(model_dir: str, layout: str, args, vocab: int, caching: bool = True) -> dict:
    import random

    from clusteropt_cli.core.serve.engine import GenerationRequest

    rng = random.Random(3)
    system = [rng.randrange(10, min(vocab, 128000)) for _ in range(args.system_tokens)]
    turns = [[rng.randrange(10, min(vocab, 128000)) for _ in range(USER_TOKENS)] for _ in range(args.requests)]
    length = args.system_tokens + USER_TOKENS + args.out_tokens
    engine = engine_for(model_dir, layout, args.kv_gib, max(1024, 1 << (length - 1).bit_length()), caching)
    try:
        warm_turns = [[rng.randrange(10, min(vocab, 128000)) for _ in range(USER_TOKENS)] for _ in range(8)]
        warm_system = [rng.randrange(10, min(vocab, 128000)) for _ in range(args.system_tokens)]
        engine.generate([GenerationRequest(prompt_ids=warm_system + t, max_new_tokens=8, ignore_eos=True)
                         for t in warm_turns])  # compile/capture on another prefix: the timed prefix starts cold
        out = {"kv_blocks": engine.stats.kv_blocks, "sequences": engine.num_slots, "caching": caching}
        out.update(run_requests(engine, [GenerationRequest(prompt_ids=system + t, max_new_tokens=args.out_tokens,
                                                           ignore_eos=True) for t in turns]))
        return out
    finally:
        engine.stop()
        del engine
        free_gpu()


def capacity_case(shape: dict, kv_gib: float, context: int, block_size: int = 16, max_batch_size: int = 256,
                  model_context: int = 131072) -> dict:
    """Sequences of `context` tokens a KV budget of `kv_gib` holds, from the engine's own sizing code (not a run):
    the slot cache with its default max_model_len (the one `copt serve` picks for --max-batch-size sequences), with
    --max-model-len context, and with the model's full context; the paged cache (full context by default)."""
    from clusteropt_cli.core.serve.kv_blocks import max_concurrent_sequences
    from clusteropt_cli.core.serve.kv_budget import choose_max_model_len

    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2  # bf16
    budget = int(kv_gib * 2**30)
    slot_default = choose_max_model_len(model_context, per_token, budget, max_batch_size).max_model_len

    def slots_at(length: int) -> int:
        return min(max_batch_size, budget // (length * per_token))

    blocks = budget // per_token // block_size
    return {"kv_gib": kv_gib, "context": context, "kv_bytes_per_token": per_token, "max_batch_size": max_batch_size,
            "slot_default_max_model_len": slot_default,
            "slot_sequences_default": slots_at(slot_default) if slot_default >= context else 0,
            "slot_sequences_max_model_len_context": slots_at(context),
            "slot_sequences_full_context": slots_at(model_context),
            "paged_blocks": blocks,
            "paged_sequences": max_concurrent_sequences(blocks, block_size, context, max_batch_size),
            "paged_sequences_at_quarter_context": max_concurrent_sequences(blocks, block_size, context // 4,
                                                                            max_batch_size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kv-gib", type=float, default=16.0)
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--out-tokens", type=int, default=OUT_TOKENS)
    parser.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS)
    parser.add_argument("--batch1-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per standard case (median reported)")
    parser.add_argument("--cases", default="standard,shared_prefix,capacity")
    parser.add_argument("--standard-variants", default="slots,paged",
                        help="of slots, paged (default decode attention: the paged kernel on CUDA), paged_math")
    parser.add_argument("--prefix-variants", default="slots,paged,paged_no_caching")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (any machine)")
    args = parser.parse_args()
    if args.smoke:
        args.kv_gib, args.requests, args.out_tokens, args.system_tokens, args.batch1_tokens = 0.05, 8, 8, 64, 16
    import torch

    results: dict = {"bench": "serve_paged", "date": time.strftime("%Y-%m-%d"),
                     "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__, "kv_gib": args.kv_gib, "requests": args.requests,
                     "out_tokens": args.out_tokens, "system_tokens": args.system_tokens, "cases": {}}
    out_path = Path(args.out)

    def save() -> None:
        out_path.write_text(json.dumps(results, indent=2))

    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        made = make_model_dir(Path(model_dir), small=args.smoke)
        vocab = made["vocab"]
        del made
        free_gpu()
        variants = {"slots": ("slots", "auto"), "paged": ("paged", "auto"), "paged_math": ("paged", "math")}
        for name in args.standard_variants.split(","):
            layout, attention = variants[name]
            if "standard" in cases:
                log(f"standard workload, {name}")
                try:
                    results["cases"][f"standard_{name}"] = standard_case(model_dir, layout, args, vocab, attention)
                except Exception as exc:  # noqa: BLE001 - record and go on
                    traceback.print_exc()
                    results["cases"][f"standard_{name}"] = {"error": f"{type(exc).__name__}: {exc}"}
                save()
        if "shared_prefix" in cases:
            prefix_variants = {"slots": ("slots", True), "paged": ("paged", True), "paged_no_caching": ("paged", False)}
            for name in args.prefix_variants.split(","):
                layout, caching = prefix_variants[name]
                log(f"shared prefix, {name}")
                try:
                    results["cases"][f"shared_prefix_{name}"] = shared_prefix_case(model_dir, layout, args, vocab,
                                                                                   caching)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    results["cases"][f"shared_prefix_{name}"] = {"error": f"{type(exc).__name__}: {exc}"}
                save()
    if "capacity" in cases:
        from common import LLAMA_1B_SHAPE

        results["cases"]["capacity_1b"] = capacity_case(LLAMA_1B_SHAPE, args.kv_gib, 32768, max_batch_size=64)
        results["cases"]["capacity_8b"] = capacity_case(LLAMA_8B_KV, 100.0, 32768, max_batch_size=64)
    save()
    c = results["cases"]

    def pick(name, *keys):
        v = c.get(name, {})
        for k in keys:
            v = v.get(k, {}) if isinstance(v, dict) else {}
        return v if isinstance(v, (int, float)) else float("nan")

    print(f"copt engine, paged vs slot KV cache on {results['gpu']}, {results['date']}")
    for kind in ("greedy", "sampled"):
        s, p = pick("standard_slots", kind, "output_tok_s"), pick("standard_paged", kind, "output_tok_s")
        k = pick("standard_paged_math", kind, "output_tok_s")
        print(f"standard {kind:8s} output tok/s  slots {s:10,.0f}  paged {p:10,.0f} ({p / s:.3f})  paged, math "
              f"attention {k:10,.0f} ({k / s:.3f})")
    s, p = pick("standard_slots", "batch1_ms_per_token"), pick("standard_paged", "batch1_ms_per_token")
    k = pick("standard_paged_math", "batch1_ms_per_token")
    print(f"batch-1 ms/token              slots {s:10.3f}  paged {p:10.3f} ({p / s:.3f})  paged, math attention "
          f"{k:10.3f} ({k / s:.3f})")
    for name in ("slots", "paged", "paged_no_caching"):
        key = f"shared_prefix_{name}"
        print(f"shared prefix {name:17s} TTFT p50 {pick(key, 'ttft_s', 'p50'):8.3f} s  output tok/s "
              f"{pick(key, 'output_tok_s'):10,.0f}  hit rate {c.get(key, {}).get('prefix_cache_hit_rate')}")
    for name in ("capacity_1b", "capacity_8b"):
        if name in c:
            print(f"{name}: {c[name]}")
    print(f"results: {out_path}")


if __name__ == "__main__":
    main()
