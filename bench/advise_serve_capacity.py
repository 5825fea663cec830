#!/usr/bin/env python3
"""copt advise's serving capacity against copt serve's engine: the KV pool it sizes and the sequences it admits.

    python3 bench/advise_serve_capacity.py --out $OUT/advise_capacity.json          # ~3 minutes on one H200
    python3 bench/advise_serve_capacity.py --smoke --out /tmp/advise_capacity.json  # tiny model, any machine

Model: the Llama-3.2-1B shape in bf16 with random weights (bench/common.py). For each sizing (the default 85% of
the memory free after loading, --gpu-memory-utilization 0.9, --kv-cache-memory 16, the same in fp8 blocks) the
engine is loaded (no CUDA graphs or compile: they come after the cache is sized) and its pool's blocks are compared
with the blocks advise predicts for the detected GPU, with the concurrency each gives at 1k, 8k and 32k tokens
(--max-batch-size 1024, --max-model-len 32768). Then admission: requests of 8,000 prompt tokens + 256 generated
(long enough that the first requests still run when the pool fills) against a 4 GiB pool, the most that run at
once, without and with a 6,000-token prefix shared by all of them (cached by a first request), against advise's
prediction. The issue's bar: within ±10%.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import free_gpu, log, make_model_dir  # noqa: E402

CONTEXTS = (1024, 8192, 32768)
MAX_MODEL_LEN = 32768
MAX_BATCH = 1024


def _target(cuda: bool):
    from clusteropt_cli.core.advise.api import resolve_target
    from clusteropt_cli.core.advise.plan import Target

    if cuda:
        return resolve_target(None)[0]  # the detected GPU's catalog entry
    import psutil

    return Target(None, budget_bytes=int(psutil.virtual_memory().total))


def _engine(model_dir: str, device: str, **kw):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    settings = dict(model=model_dir, device=device, max_batch_size=MAX_BATCH, max_model_len=MAX_MODEL_LEN,
                    cuda_graphs=False, compile=False)
    settings.update(kw)
    return Engine(EngineConfig(**settings))


def _plan(prompt_len: int, gen_len: int = 1, **kw):
    from clusteropt_cli.core.advise.plan import InferPlan

    settings = dict(batch=1, prompt_len=prompt_len, gen_len=gen_len, continuous_batching=True,
                    max_batch_size=MAX_BATCH, max_model_len=MAX_MODEL_LEN)
    settings.update(kw)
    return InferPlan(**settings)


def sizing_case(model_dir: str, device: str, target, name: str, engine_kw: dict, plan_kw: dict,
                contexts=CONTEXTS) -> dict:
    from clusteropt_cli.core.advise.memory import serving_capacity
    from clusteropt_cli.modelspec import load_model_spec

    spec = load_model_spec(model_dir)
    engine = _engine(model_dir, device, **engine_kw)
    try:
        engine.load()
        blocks, bs = engine.pool.num_blocks, engine.pool.block_size
    finally:
        engine.stop()
        del engine
        free_gpu()
    rows = []
    for context in contexts:
        predicted = serving_capacity(spec, _plan(context, **plan_kw), target)
        actual = min(MAX_BATCH, blocks // -(-context // bs))
        rows.append({"context": context, "engine_sequences": actual,
                     "advise_sequences": predicted.max_concurrent_seqs,
                     "error_pct": 100.0 * (predicted.max_concurrent_seqs - actual) / actual if actual else None})
    predicted = serving_capacity(spec, _plan(contexts[0], **plan_kw), target)
    return {"case": name, "engine_blocks": blocks, "advise_blocks": predicted.num_blocks,
            "blocks_error_pct": 100.0 * (predicted.num_blocks - blocks) / blocks, "budget": predicted.budget,
            "contexts": rows}


def admission_case(model_dir: str, device: str, target, vocab: int, kv_gib: float, prompt: int, shared: int,
                   gen: int) -> dict:
    import random

    from clusteropt_cli.core.advise.memory import serving_capacity
    from clusteropt_cli.core.serve.engine import GenerationRequest
    from clusteropt_cli.modelspec import load_model_spec

    spec = load_model_spec(model_dir)
    predicted = serving_capacity(spec, _plan(prompt, gen_len=gen, kv_cache_memory_gib=kv_gib, shared_prefix_len=shared),
                                 target).max_concurrent_seqs
    rng = random.Random(0)
    top = min(vocab, 128000)
    prefix = [rng.randrange(10, top) for _ in range(shared)]

    def one() -> list[int]:
        return prefix + [rng.randrange(10, top) for _ in range(prompt - shared)]

    engine = _engine(model_dir, device, kv_cache_memory_gib=kv_gib, max_model_len=prompt + gen + 64).start()
    try:
        if shared:
            engine.generate([GenerationRequest(prompt_ids=one(), max_new_tokens=1)])
        requests = [GenerationRequest(prompt_ids=one(), max_new_tokens=gen, ignore_eos=True)
                    for _ in range(max(8, 2 * predicted))]
        t0 = time.perf_counter()
        engine.generate(requests)
        peak = engine.stats.peak_running
        wall = time.perf_counter() - t0
        hit_rate = (engine.stats.prefix_cache_hits / engine.stats.prefix_cache_queries
                    if engine.stats.prefix_cache_queries else None)
    finally:
        engine.stop()
        del engine
        free_gpu()
    return {"kv_gib": kv_gib, "prompt": prompt, "generated": gen, "shared_prefix": shared, "requests": len(requests),
            "engine_peak_running": peak, "advise_sequences": predicted,
            "error_pct": 100.0 * (predicted - peak) / peak if peak else None, "wall_s": wall,
            "prefix_cache_hit_rate": hit_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny model and pools (any machine)")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    results: dict = {"bench": "advise_serve_capacity", "date": time.strftime("%Y-%m-%d"),
                     "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                     "sizing": [], "admission": []}
    out_path = Path(args.out)
    target = _target(cuda)
    gib = 0.01 if args.smoke else 16.0
    sizings = [(f"kv-cache-memory {gib:g}", {"kv_cache_memory_gib": gib}, {"kv_cache_memory_gib": gib}),
               (f"kv-cache-memory {gib:g} fp8", {"kv_cache_memory_gib": gib, "kv_cache_dtype": "fp8"},
                {"kv_cache_memory_gib": gib, "kv_cache": "fp8"})]
    if cuda:
        sizings = [("default (85% of free)", {}, {}),
                   ("gpu-memory-utilization 0.9", {"gpu_memory_utilization": 0.9}, {"gpu_memory_utilization": 0.9}),
                   *sizings]
    contexts = CONTEXTS
    # requests must outlive the pool's filling (a prefill of 8,000 tokens takes steps): 256 generated tokens each
    admissions = [(4.0, 8000, 0, 256), (4.0, 8000, 6000, 256)]
    if args.smoke:
        global MAX_MODEL_LEN
        MAX_MODEL_LEN = 1024
        contexts = (16, 100, 1000)
        admissions = [(0.002, 100, 0, 8), (0.002, 100, 64, 8)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        made = make_model_dir(Path(model_dir), small=args.smoke)
        vocab = made["vocab"]
        del made
        free_gpu()
        for name, engine_kw, plan_kw in sizings:
            log(f"sizing: {name}")
            results["sizing"].append(sizing_case(model_dir, device, target, name, engine_kw, plan_kw, contexts))
            out_path.write_text(json.dumps(results, indent=2))
        for kv_gib, prompt, shared, gen in admissions:
            log(f"admission: {prompt}-token prompts, shared prefix {shared}")
            results["admission"].append(admission_case(model_dir, device, target, vocab, kv_gib, prompt, shared,
                                                             gen))
            out_path.write_text(json.dumps(results, indent=2))
    print(f"{'sizing':28s} {'blocks engine':>14s} {'advise':>9s} {'err':>7s}   sequences engine/advise at "
          + ", ".join(str(c) for c in contexts))
    for row in results["sizing"]:
        seqs = "  ".join(f"{r['engine_sequences']}/{r['advise_sequences']}" for r in row["contexts"])
        print(f"{row['case']:28s} {row['engine_blocks']:14,d} {row['advise_blocks']:9,d} "
              f"{row['blocks_error_pct']:+6.2f}%   {seqs}")
    for row in results["admission"]:
        err = "-" if row["error_pct"] is None else f"{row['error_pct']:+.1f}%"
        print(f"admission {row['prompt']}-token prompts, shared {row['shared_prefix']:5d}: engine ran "
              f"{row['engine_peak_running']} at once, advise {row['advise_sequences']} ({err})")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
