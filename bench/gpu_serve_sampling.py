#!/usr/bin/env python3
"""copt serve, greedy against sampled requests in the same run (H200, Llama-3.2-1B shape, random weights).

Run from the repo root:  python3 bench/gpu_serve_sampling.py --out $OUT/sampling.json      (up to ~10 minutes;
                         --sampling, --skip http and --repeats 1 run less)
                         python3 bench/gpu_serve_sampling.py --smoke --out /tmp/s.json     (CPU: checks the script)

Sampling settings (`--sampling`, comma-separated; default all):
  greedy   temperature 0
  t0.7     temperature 0.7
  t1.0     temperature 1.0 (OpenAI's default)
  t1.0p95  temperature 1.0, top_p 0.95 (the top-p mode: Gumbel-max candidates checked against the nucleus)
  t1.0k50  temperature 1.0, top_k 50 (the top-k draw: the token drawn among the row's 64 largest entries from a
           Triton top-64 with token ids, no pass over the vocabulary after it)
  t1.0p90k50  temperature 1.0, top_p 0.9, top_k 50 (the top-k draw with top-p: the row's whole mass, then the
              nucleus among the 64 largest entries)
  pen      temperature 0.7, top_k 50, presence_penalty 0.5 (the penalties' graph variant)

Cases, each per sampling setting:
  engine_b1     in-process Engine, one request of 256 tokens at a time: decode ms/token (median of 3)
  http_b1       `copt serve`, one streaming request of 256 tokens at a time: ms/token at the client (median of 3)
  http_c64      64 concurrent streaming requests (prompts 32–256 tokens, 128 output tokens, ignore_eos): tok/s,
                median of --repeats runs (3)
  http_c256     the same with 256 clients
kernels: the sampling graph alone (µs per step by batch, selection mode — plain, topkdraw, topkpdraw, topk, topp,
topkp, topkwide, topkpwide, sort — and penalties)
against the greedy argmax; and each cheap mode's tokens against the sort's on random rows (mismatching rows: 0
expected, a row whose nucleus boundary is within float rounding of top_p can differ).
Also checked on the device: a seeded request gives the same tokens when repeated and alone vs. inside a batch of 64
others (with the greedy request as the control: batched GEMMs may round differently from batch 1), and whether the
sampling graphs were captured (`sampler_graph_error`, `sampler_compile_error`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import (  # noqa: E402
    KV_GIB,
    MAX_MODEL_LEN,
    NUM_REQUESTS,
    OUT_TOKENS,
    free_gpu,
    free_port,
    http_request,
    log,
    make_model_dir,
    per_token_tpot,
    start_server,
    wait_healthy,
    workload,
)

SAMPLING = {
    "greedy": {"temperature": 0.0},
    "t0.7": {"temperature": 0.7},
    "t1.0": {"temperature": 1.0},
    "t1.0p95": {"temperature": 1.0, "top_p": 0.95},
    "t1.0k50": {"temperature": 1.0, "top_k": 50},
    "t1.0p90k50": {"temperature": 1.0, "top_p": 0.9, "top_k": 50},
    "pen": {"temperature": 0.7, "top_k": 50, "presence_penalty": 0.5},
}


def bench_kernels(vocab: int, batches: list[int]) -> dict:
    """The sampling graph alone (SlotSampler, compiled pointwise noise, CUDA graph replay) per batch and variant,
    and the greedy argmax for comparison: µs per step on random logits."""
    import torch

    from clusteropt_cli.core.serve.device_sampling import (
        PLAIN,
        SORT,
        TOP_K,
        TOP_K_DRAW,
        TOP_K_P,
        TOP_K_P_DRAW,
        TOP_K_WIDE,
        TOP_K_WIDE_P,
        TOP_P,
        RowSettings,
        SlotSampler,
    )
    from clusteropt_cli.core.serve.runner import greedy_tokens

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = max(batches)
    sampler = SlotSampler(rows, vocab, dev, compiled=dev.type == "cuda")
    for slot in range(rows):
        sampler.assign(slot, RowSettings(temperature=1.0, top_p=0.95, top_k=50, seed=slot, presence_penalty=0.5,
                                         min_tokens=2, stop_ids=(1, 2)), [3, 4, 5])
    with torch.inference_mode():  # the engine's logits buffer and the sampler's state are inference tensors
        logits = torch.randn(rows, vocab, device=dev)
        sampler.active.fill_(True)
    out: dict = {}

    def timed(fn, iters: int = 50) -> float:
        for _ in range(3):
            fn()
        if dev.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return 1e6 * (time.perf_counter() - t0) / iters
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return 1000 * start.elapsed_time(end) / iters

    with torch.inference_mode():
        for b in batches:
            out[f"b{b}_greedy_argmax_us"] = timed(lambda b=b: greedy_tokens(logits[:b]))
            for mode, label in ((PLAIN, "plain"), (TOP_K_DRAW, "topkdraw"), (TOP_K_P_DRAW, "topkpdraw"),
                                (TOP_K, "topk"), (TOP_P, "topp"), (TOP_K_P, "topkp"), (TOP_K_WIDE, "topkwide"),
                                (TOP_K_WIDE_P, "topkpwide"), (SORT, "sort")):
                for pen in (False, True):
                    key = f"b{b}_{label}{'_pen' if pen else ''}_us"
                    out[key] = timed(lambda b=b, mode=mode, pen=pen: sampler.graph_sample(logits[:b], b, mode, pen))
            row = {k: v for k, v in out.items() if k.startswith(f"b{b}_")}
            log(f"sampling kernels b{b}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()))
        out.update(mode_agreement(sampler, logits, dev))
    out["graph_error"], out["compile_error"] = sampler.graph_error, sampler.compile_error
    out["nucleus_error"] = sampler.nucleus_error
    return out


def mode_agreement(sampler, logits, dev) -> dict:
    """Rows whose token from the top-k / top-p mode differs from the sort's (same logits, seeds and positions),
    over flat (random-weight-like), peaked and tied logits and a spread of top_p / top_k values. `logits`: the
    buffer the captured graphs read (refilled here)."""
    import torch

    from clusteropt_cli.core.serve import device_sampling as ds

    rows, vocab = logits.shape
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict = {}

    def top_k_rows(big: int) -> list:
        return [ds.RowSettings(temperature=1.0, top_k=k, seed=i)
                for i, k in enumerate([1, 20, 50, big, 0] * (rows // 5 + 1))][:rows]

    def top_k_p_rows(big: int) -> list:
        return [ds.RowSettings(temperature=1.0, top_k=k, top_p=p, seed=i)
                for i, (k, p) in enumerate([(50, 0.9), (0, 0.5), (big, 0.95), (20, 1.0)] * rows)][:rows]

    draw_rows = [ds.RowSettings(temperature=1.0, top_k=k, seed=i, min_p=0.01 * (i % 4 == 0))
                 for i, k in enumerate([1, 20, 50, ds.TOP_K_SMALL, 7] * (rows // 5 + 1))][:rows]
    top_p_rows = [ds.RowSettings(temperature=1.0, top_p=p, seed=i, min_p=0.01 * (i % 3 == 0))
                  for i, p in enumerate([0.95, 0.9, 0.5, 0.1, 1e-4] * (rows // 5 + 1))][:rows]
    draw_p_rows = [ds.RowSettings(temperature=1.0, top_k=k, top_p=p, seed=i)
                   for i, (k, p) in enumerate([(50, 0.9), (1, 0.5), (ds.TOP_K_SMALL, 0.95), (20, 1.0)] * rows)][:rows]
    settings = {ds.TOP_K_DRAW: draw_rows, ds.TOP_K_P_DRAW: draw_p_rows, ds.TOP_P: top_p_rows,
                ds.TOP_K: top_k_rows(ds.TOP_K_SMALL), ds.TOP_K_P: top_k_p_rows(ds.TOP_K_SMALL),
                ds.TOP_K_WIDE: top_k_rows(ds.TOP_K_CAP), ds.TOP_K_WIDE_P: top_k_p_rows(ds.TOP_K_CAP)}
    SORT = ds.SORT  # noqa: N806
    for mode, label in ((ds.TOP_K_DRAW, "topkdraw"), (ds.TOP_K_P_DRAW, "topkpdraw"), (ds.TOP_P, "topp"),
                        (ds.TOP_K, "topk"), (ds.TOP_K_P, "topkp"), (ds.TOP_K_WIDE, "topkwide"),
                        (ds.TOP_K_WIDE_P, "topkpwide")):
        for slot, row in enumerate(settings[mode]):
            sampler.assign(slot, row, [3, 4, 5])
        bad = checked = 0
        for kind in ("flat", "peaked", "tied"):
            fresh = torch.randn(rows, vocab, device=dev, generator=gen) * (4.0 if kind == "peaked" else 1.0)
            logits.copy_(torch.round(fresh * 8) / 8 if kind == "tied" else fresh)
            for step in range(4):
                sampler.position[:rows].fill_(100 + step)
                cheap = sampler.graph_sample(logits, rows, mode, False).clone()
                full = sampler.graph_sample(logits, rows, SORT, False).clone()
                bad += int((cheap != full).sum())
                checked += rows
        out[f"{label}_vs_sort_mismatching_rows"] = bad
        out[f"{label}_vs_sort_rows_checked"] = checked
        log(f"{label} vs sort: {bad} of {checked} rows differ")
    return out


def bench_engine(model_dir: Path, prompts: list[list[int]], names: list[str], b1_tokens: int) -> dict:
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), max_batch_size=NUM_REQUESTS, max_model_len=MAX_MODEL_LEN,
                                 kv_cache_memory_gib=KV_GIB, max_batch_tokens=4096))
    engine.start()
    out: dict = {"startup_s": round(time.perf_counter() - t0, 1), "graphs": engine.stats.graphs_captured,
                 "graph_error": engine.runner.graph_error, "compile_error": engine.runner.compile_error,
                 "sampler_graph_error": engine.runner.sampler.graph_error,
                 "sampler_compile_error": engine.runner.sampler.compile_error,
                 "sampler_nucleus_error": engine.runner.sampler.nucleus_error,
                 "sampler_graphs": len(engine.runner.sampler._graphs)}
    try:
        for name in names:
            params = SAMPLING[name]
            engine.generate([GenerationRequest(prompt_ids=prompts[0][:32], max_new_tokens=16, ignore_eos=True,
                                               **params)])  # warm-up
            per_token = []
            chained = engine.stats.chained_steps
            for i in range(3):
                r = engine.generate([GenerationRequest(prompt_ids=prompts[0][:32], max_new_tokens=b1_tokens,
                                                       ignore_eos=True, seed=i, **params)])[0]
                per_token.append(1000 * (r.latency_s - r.ttft_s) / (r.num_output_tokens - 1))
            out[name] = {"engine_b1_ms_per_token": sorted(per_token)[1], "runs_ms": sorted(per_token),
                         "chained_steps": engine.stats.chained_steps - chained}
            log(f"engine b1 {name}: {out[name]['engine_b1_ms_per_token']:.3f} ms/token")
        # seeded reproducibility on the device: alone vs. inside a batch of other sampled requests. The noise is
        # the same by construction; the logits of a batched step can differ from a batch-1 step in the last bits
        # (other GEMM kernels), which can flip a near-tie: the greedy row shows the same effect without sampling
        def prefix(a: list[int], b: list[int]) -> int:
            return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

        others = [GenerationRequest(prompt_ids=p, max_new_tokens=64, ignore_eos=True, temperature=0.8)
                  for p in prompts[2:66]]
        for label, params in (("seeded", {"temperature": 1.0, "top_p": 0.95, "seed": 4321}),
                              ("greedy", {"temperature": 0.0})):
            req = dict(prompt_ids=prompts[1][:40], max_new_tokens=64, ignore_eos=True, **params)
            alone = engine.generate([GenerationRequest(**req)])[0].output_ids
            again = engine.generate([GenerationRequest(**req)])[0].output_ids
            mixed = engine.generate(others[:20] + [GenerationRequest(**req)] + others[20:])[20].output_ids
            out[f"{label}_repeat_identical"] = alone == again
            out[f"{label}_in_batch_identical"] = alone == mixed
            out[f"{label}_in_batch_common_prefix"] = prefix(alone, mixed)
            log(f"{label}: repeat identical {alone == again}, in a batch identical {alone == mixed} "
                f"(first {prefix(alone, mixed)} of 64 tokens)")
    finally:
        engine.stop()
        del engine
        free_gpu()
    return out


async def _load(url: str, prompts: list[list[int]], max_tokens: int, params: dict) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*[http_request(client, url, p, max_tokens, True, params) for p in prompts])
        wall = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in out)
    tpot = sorted(t for t in map(per_token_tpot, out) if t is not None)
    return {"requests": len(out), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": tokens / wall, "tpot_ms_p50": 1000 * tpot[len(tpot) // 2] if tpot else None}


def bench_http(model_dir: Path, prompts: list[list[int]], names: list[str], b1_tokens: int,
               clients: list[int], repeats: int = 3) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir, port, max_batch_size=NUM_REQUESTS, max_model_len=MAX_MODEL_LEN, kv_gib=KV_GIB)
    out: dict = {}
    try:
        out["startup_s"] = round(wait_healthy(url, proc, timeout=300), 1)
        asyncio.run(_load(url, prompts[:16], 16, {}))
        for name in names:
            params = SAMPLING[name]
            row: dict = {}
            try:
                runs = [asyncio.run(_load(url, [prompts[1][:32]], b1_tokens, {**params, "seed": i}))
                        for i in range(3)]
                row["http_b1_ms_per_token"] = sorted(r["tpot_ms_p50"] for r in runs)[1]
                for c in clients:  # median of `repeats` runs (one run of a few seconds is noisy)
                    runs = [asyncio.run(_load(url, prompts[:c], OUT_TOKENS, params)) for _ in range(repeats)]
                    # the median run (the faster of two); the runs' figures are kept in the order they ran
                    res = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
                    row[f"http_c{c}_tok_s"] = res["output_tokens_per_s"]
                    row[f"http_c{c}_tok_s_runs"] = [round(r["output_tokens_per_s"]) for r in runs]
                    row[f"http_c{c}_tpot_ms_p50"] = res["tpot_ms_p50"]
            except Exception as exc:  # noqa: BLE001 - recorded, the next setting runs
                row["error"] = f"{type(exc).__name__}: {exc}"
            out[name] = row
            log(f"http {name}: {row}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001
            proc.kill()
        tail = proc.stderr.read()[-2000:] if proc.stderr else ""
        if tail:
            log("server stderr tail:\n" + tail)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sampling", default=",".join(SAMPLING), help=f"comma-separated of {', '.join(SAMPLING)}")
    parser.add_argument("--clients", default="64,256", help="concurrent HTTP clients per throughput case")
    parser.add_argument("--repeats", type=int, default=3, help="runs per HTTP throughput case (median reported)")
    parser.add_argument("--skip", default="", help="comma-separated: kernels, engine, http")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few requests (checks the script on CPU)")
    args = parser.parse_args()
    names = [n for n in args.sampling.split(",") if n]
    unknown = [n for n in names if n not in SAMPLING]
    if unknown:
        parser.error(f"unknown --sampling {unknown}; choose from {list(SAMPLING)}")
    clients = [int(c) for c in args.clients.split(",") if c]
    skip = set(filter(None, args.skip.split(",")))
    import torch

    global NUM_REQUESTS, OUT_TOKENS, KV_GIB
    b1_tokens = 256
    if args.smoke:
        NUM_REQUESTS, OUT_TOKENS, KV_GIB = 16, 8, 0.05
        clients, b1_tokens = sorted({min(c, 8) for c in clients}), 16
    results: dict = {"bench": "gpu_serve_sampling", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                     "sampling": {n: SAMPLING[n] for n in names}, "clients": clients}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every stage: a run cut short keeps what it measured
        args.out.write_text(json.dumps(results, indent=2, default=str))

    tmp = Path(tempfile.mkdtemp(prefix="copt-sampling-bench-"))
    model_dir = tmp / "llama-1b-shape"
    made = make_model_dir(model_dir, small=args.smoke)
    vocab = made["vocab"]
    del made
    free_gpu()
    prompts = workload(vocab, max([*clients, 66]))
    if "kernels" not in skip:
        try:
            results["kernels"] = bench_kernels(vocab, [1, 64, 256] if not args.smoke else [1, 8])
        except Exception as exc:  # noqa: BLE001
            results["kernels"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        save()
        free_gpu()
    if "engine" not in skip:
        try:
            results["engine"] = bench_engine(model_dir, prompts, names, b1_tokens)
        except Exception as exc:  # noqa: BLE001
            results["engine"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        save()
    if "http" not in skip:
        try:
            results["http"] = bench_http(model_dir, prompts, names, b1_tokens, clients, args.repeats)
        except Exception as exc:  # noqa: BLE001
            results["http"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        save()
    save()

    eng, http = results.get("engine", {}), results.get("http", {})
    print(f"\ncopt serve sampling benchmark — {results['gpu']}, {results['date']}")
    head = f"{'sampling':<11}{'engine b1 ms':>13}{'http b1 ms':>12}" + "".join(f"{f'c{c} tok/s':>12}"
                                                                             for c in clients)
    print(head)
    base = eng.get("greedy", {}).get("engine_b1_ms_per_token")
    for n in names:
        e, h = eng.get(n, {}), http.get(n, {})
        cells = [e.get("engine_b1_ms_per_token"), h.get("http_b1_ms_per_token")]
        cells += [h.get(f"http_c{c}_tok_s") for c in clients]
        fmt = [f"{v:.3f}" if isinstance(v, float) and v < 100 else f"{v:,.0f}" if v else "-" for v in cells]
        print(f"{n:<11}{fmt[0]:>13}{fmt[1]:>12}" + "".join(f"{x:>12}" for x in fmt[2:]))
        if base and e.get("engine_b1_ms_per_token") and n != "greedy":
            print(f"{'':<11}{e['engine_b1_ms_per_token'] / base - 1:>+12.1%} vs greedy")
        temp = eng.get("t1.0", {}).get("engine_b1_ms_per_token")
        if temp and e.get("engine_b1_ms_per_token") and n in ("t1.0p95", "t1.0k50", "t1.0p90k50"):
            print(f"{'':<11}{e['engine_b1_ms_per_token'] / temp - 1:>+12.1%} vs t1.0")
    kern = results.get("kernels", {})
    for b in (1, 64, 256):
        names = ("greedy_argmax", "plain", "topkdraw", "topkpdraw", "topk", "topp", "topkp", "sort")
        cells = {k: kern.get(f"b{b}_{k}_us") for k in names}
        if all(isinstance(c, float) for c in cells.values()):
            print(f"sampling graph b{b} µs: " + ", ".join(f"{k} {v:.1f}" for k, v in cells.items()))
    for k in ("topkdraw_vs_sort_mismatching_rows", "topkpdraw_vs_sort_mismatching_rows",
              "topp_vs_sort_mismatching_rows", "topk_vs_sort_mismatching_rows",
              "topkp_vs_sort_mismatching_rows",
              "nucleus_error"):
        if k in kern:
            print(f"kernels {k}: {kern[k]}")
    for k in ("startup_s", "graphs", "graph_error", "compile_error", "sampler_graph_error", "sampler_compile_error",
              "sampler_nucleus_error",
              "sampler_graphs", "seeded_repeat_identical", "seeded_in_batch_identical", "seeded_in_batch_common_prefix",
              "greedy_repeat_identical", "greedy_in_batch_identical", "greedy_in_batch_common_prefix"):
        if k in eng:
            print(f"engine {k}: {eng[k]}")
    if "error" in eng or "error" in http:
        print("errors:", eng.get("error"), http.get("error"))
    print(f"results: {args.out}")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
