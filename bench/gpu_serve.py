#!/usr/bin/env python3
"""copt serve on the H200: throughput against HF static batching, batch-1 decode against the bandwidth floor.

Run from the repo root:  python3 bench/gpu_serve.py --out $OUT/serve.json   (≤ 5 minutes)

Model: the Llama-3.2-1B shape in bf16 with random weights (saved to a temporary model dir with a word-level
tokenizer, so the real `copt serve` command can load it). Workload: 256 requests, prompts of 32–256 random
tokens, 128 output tokens each (ignore_eos), greedy.

Cases (each guarded; GPU memory freed between them):
  hf_static        transformers generate(), static batches of 64, left-padded (the baseline)
  engine           copt's engine in-process (Engine.generate), plus batch-1 decode ms/token (defaults: CUDA
                   graphs over torch.compile'd decoder layers)
  engine_eager_layers  the same with `compile=False` (CUDA graphs of the eager layers): what compiling buys
  http_stream      `copt serve` subprocess, 256 concurrent streaming requests over HTTP: the headline
                   output tok/s, TTFT and inter-token-latency percentiles (client-side)
  http_plain       the same, non-streaming
  http_batch1      one streaming request of 256 tokens at a time: decode ms/token through the server
Ratios are against hf_static measured in the same run; batch-1 against weights-bytes / 4.26 TB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import common  # noqa: E402
from common import (  # noqa: E402
    COPY_BW,
    KV_GIB,
    MAX_MODEL_LEN,
    NUM_REQUESTS,
    OUT_TOKENS,
    PROMPT_MAX,
    PROMPT_MIN,
    free_gpu,
    free_port,
    http_load,
    log,
    make_model_dir,
    percentiles,
    wait_healthy,
    workload,
)

COMPILE_MODE = "default"  # copt serve --compile-mode (--compile-mode flag of this script)
DECODE_ATTENTION = "auto"  # copt serve --decode-attention (engine and server cases)
ASYNC_SCHEDULING = True  # copt serve's async scheduling (on by default; --no-async-scheduling of this script)


# ---- baseline ------------------------------------------------------------------------------------------
def bench_hf_static(model, prompts: list[list[int]], batch: int = 64, out_tokens: int = OUT_TOKENS) -> dict:
    import torch

    pad = model.config.pad_token_id

    def run(chunk: list[list[int]]) -> int:
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_tokens, min_new_tokens=out_tokens,
                             do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(chunk)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.inference_mode():
        run(prompts[:4])  # warm-up
        sync()
        t0 = time.perf_counter()
        tokens = sum(run(prompts[i : i + batch]) for i in range(0, len(prompts), batch))
        sync()
        wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall, "batch": batch}


def reference_tokens(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch

    out = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(input_ids=torch.tensor([p], device=model.device), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=model.config.pad_token_id)
            out.append(gen[0, len(p):].tolist())
    return out


# ---- where the engine thread's time goes ---------------------------------------------------------------
def phase_mark(engine) -> tuple[dict[str, float], int, int]:
    s = engine.stats
    return dict(s.phase_s), s.steps, s.decode_steps


def phase_delta(engine, mark: tuple[dict[str, float], int, int]) -> dict:
    """Engine-thread seconds per phase since `mark`, plus steps: decode_forward = host launch of the decode graph,
    decode_sample_sync = waiting for the GPU + sampling, prefill_forward = packed prefill incl. its GPU time,
    emit = handing tokens to requests (stop checks, streaming wake-ups)."""
    before, steps, dsteps = mark
    s = engine.stats
    return phases_from({k: v - before.get(k, 0.0) for k, v in s.phase_s.items()}, s.steps - steps,
                       s.decode_steps - dsteps)


def phases_from(seconds: dict[str, float], steps: int, decode_steps: int) -> dict:
    """Per phase: seconds, and ms per scheduler pass; decode phases (and emit) also per decode step, since async
    scheduling runs many decode steps in one pass."""
    per_decode = {k: round(1000 * v / decode_steps, 3) for k, v in seconds.items()
                  if decode_steps and (k.startswith("decode") or k == "emit")}
    return {"steps": steps, "decode_steps": decode_steps, "seconds": {k: round(v, 4) for k, v in seconds.items()},
            "ms_per_step": {k: round(1000 * v / max(1, steps), 3) for k, v in seconds.items()},
            "ms_per_decode_step": per_decode}


def server_phases(url: str) -> tuple[dict[str, float], float, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    phases, steps, dsteps = {}, 0.0, 0.0
    for line in text.splitlines():
        if line.startswith("copt_engine_phase_seconds_total{"):
            phases[line.split('"')[1]] = float(line.split()[-1])
        elif line.startswith("copt_engine_steps_total "):
            steps = float(line.split()[-1])
        elif line.startswith("copt_engine_decode_steps_total "):
            dsteps = float(line.split()[-1])
    return phases, steps, dsteps


def server_phase_delta(url: str, mark: tuple[dict[str, float], float, float]) -> dict:
    now, steps, dsteps = server_phases(url)
    return phases_from({k: v - mark[0].get(k, 0.0) for k, v in now.items()}, int(steps - mark[1]),
                       int(dsteps - mark[2]))


def print_phases(name: str, ph: dict | None) -> None:
    if not ph or "seconds" not in ph:
        return
    total = sum(ph["seconds"].values())
    wall = ph.get("wall_s") or ph.get("wall_s_client")
    per_decode = ph.get("ms_per_decode_step") or {}

    def rate(k: str) -> str:
        if k in per_decode:
            return f"{per_decode[k]:.2f} ms/decode step"
        return f"{ph['ms_per_step'][k]:.2f} ms/pass"

    parts = ", ".join(f"{k} {v:.2f}s ({rate(k)})"
                      for k, v in sorted(ph["seconds"].items(), key=lambda kv: -kv[1]) if v >= 0.005)
    of_wall = f" of {wall:.2f} s wall" if wall else ""
    print(f"  phases {name}: {ph['steps']} scheduler passes, {ph.get('decode_steps', 0)} decode steps, "
          f"{total:.2f} s on the engine thread{of_wall}: {parts}")


# ---- in-process engine ---------------------------------------------------------------------------------
def bench_engine(model_dir: Path, prompts: list[list[int]], reference: list[list[int]], cuda_graphs: bool,
                 compile_: bool | None = None) -> dict:
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), max_batch_size=NUM_REQUESTS, max_model_len=MAX_MODEL_LEN,
                                 kv_cache_memory_gib=KV_GIB, max_batch_tokens=4096, cuda_graphs=cuda_graphs,
                                 compile=compile_, compile_mode=COMPILE_MODE if compile_ is not False else "default",
                                 decode_attention=DECODE_ATTENTION,
                                 async_scheduling=ASYNC_SCHEDULING))
    engine.start()
    startup = time.perf_counter() - t0
    try:
        reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=OUT_TOKENS, ignore_eos=True) for p in prompts]
        engine.generate(reqs[:8])  # warm-up
        mark = phase_mark(engine)
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t0
        phases = phase_delta(engine, mark)
        phases["wall_s"] = round(wall, 3)
        tokens = sum(r.num_output_tokens for r in results)
        check = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=len(ref), ignore_eos=True)
                                 for p, ref in zip(prompts[: len(reference)], reference, strict=True)])
        first = [r.output_ids[:1] == ref[:1] for r, ref in zip(check, reference, strict=True)]
        full = [r.output_ids == ref for r, ref in zip(check, reference, strict=True)]
        per_token = []
        mark = phase_mark(engine)
        for _ in range(3):
            r = engine.generate([GenerationRequest(prompt_ids=prompts[0][:32], max_new_tokens=256,
                                                   ignore_eos=True)])[0]
            per_token.append((r.latency_s - r.ttft_s) / (r.num_output_tokens - 1))
        phases_b1 = phase_delta(engine, mark)
        ttfts = [r.ttft_s for r in results]
        return {"startup_s": startup, "graphs": engine.stats.graphs_captured, "slots": engine.num_slots,
                "phases": phases, "phases_batch1": phases_b1,
                "graph_error": engine.runner.graph_error, "compiled_layers": engine.runner.compiled_layers,
                "merged_projections": getattr(engine.runner, "fused_projections", 0),
                "chained_steps": getattr(engine.stats, "chained_steps", 0),
                "compile_error": engine.runner.compile_error,
                "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
                "ttft_s": percentiles(ttfts), "batch1_ms_per_token": 1000 * sorted(per_token)[1],
                "hf_agreement": {"first_token": sum(first) / len(first), "all_tokens": sum(full) / len(full),
                                 "requests": len(full)}}
    finally:
        engine.stop()
        del engine
        free_gpu()


# ---- through HTTP --------------------------------------------------------------------------------------
def start_server(model_dir: Path, port: int) -> subprocess.Popen:
    """common.start_server with this run's sizes and engine settings."""
    return common.start_server(
        model_dir, port, max_batch_size=NUM_REQUESTS, max_model_len=MAX_MODEL_LEN, kv_gib=KV_GIB,
        extra_args=(["--compile-mode", COMPILE_MODE] if COMPILE_MODE != "default" else [])
        + (["--async-scheduling"] if ASYNC_SCHEDULING else ["--no-async-scheduling"])
        + ["--decode-attention", DECODE_ATTENTION])


def bench_http(model_dir: Path, prompts: list[list[int]]) -> dict:
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir, port)
    try:
        out: dict = {"startup_s": wait_healthy(url, proc, timeout=240)}
        asyncio.run(http_load(url, prompts[:16], 16, True))  # warm-up
        for name, stream in (("http_stream", True), ("http_plain", False)):
            try:
                mark = server_phases(url)
                out[name] = asyncio.run(http_load(url, prompts, OUT_TOKENS, stream))
                out[name]["phases"] = server_phase_delta(url, mark)
                out[name]["phases"]["wall_s_client"] = round(out[name]["wall_s"], 3)
                log(f"{name}: {out[name]['output_tokens_per_s']:.0f} tok/s")
            except Exception as exc:  # noqa: BLE001
                out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        try:
            mark = server_phases(url)
            runs = [asyncio.run(http_load(url, [prompts[1][:32]], 256, True)) for _ in range(3)]
            ms = sorted(1000 * r["tpot_s"]["p50"] for r in runs)
            out["http_batch1"] = {"ms_per_token": ms[1], "runs_ms": ms, "ttft_s": runs[1]["ttft_s"]["p50"],
                                  "phases": server_phase_delta(url, mark)}
        except Exception as exc:  # noqa: BLE001
            out["http_batch1"] = {"error": f"{type(exc).__name__}: {exc}"}
        metrics = httpx.get(url + "/metrics", timeout=10).text
        out["server_metrics"] = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                                 if line.startswith(("copt_engine_steps_total", "copt_generation_tokens_total",
                                                     "copt_prefill_chunks_total", "copt_kv_cache_slots"))}
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out_code = "killed"
        log(f"server exit status: {out_code}")
        tail = proc.stderr.read()[-2000:] if proc.stderr else ""
        if tail:
            log("server stderr tail:\n" + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_gpu.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny model, few requests (checks the script on CPU)")
    parser.add_argument("--decode-attention", default="auto", choices=["auto", "sdpa", "flex", "math"],
                        help="copt serve --decode-attention for the engine and server cases")
    parser.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                        help="copt serve --compile-mode for the engine and server cases")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="copt serve's async scheduling for the engine and server cases (default on, as in "
                             "copt serve)")
    parser.add_argument("--skip", default="", help="comma-separated cases to leave out (e.g. engine_eager_layers)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    global NUM_REQUESTS, OUT_TOKENS, KV_GIB, COMPILE_MODE, ASYNC_SCHEDULING, DECODE_ATTENTION
    COMPILE_MODE, ASYNC_SCHEDULING, DECODE_ATTENTION = args.compile_mode, args.async_scheduling, args.decode_attention
    if args.smoke:
        NUM_REQUESTS, OUT_TOKENS, KV_GIB = 16, 16, 0.05

    import torch

    results: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "compile_mode": COMPILE_MODE,
                     "decode_attention": DECODE_ATTENTION,
                     "async_scheduling": ASYNC_SCHEDULING,
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                     "workload": {"requests": NUM_REQUESTS, "prompt_tokens": [PROMPT_MIN, PROMPT_MAX],
                                  "output_tokens": OUT_TOKENS, "greedy": True, "ignore_eos": True}}
    tmp = Path(tempfile.mkdtemp(prefix="copt-serve-bench-"))
    model_dir = tmp / "llama-1b-shape"
    t0 = time.perf_counter()
    made = make_model_dir(model_dir, small=args.smoke)
    model = made["model"]
    results["model"] = {"shape": "llama-3.2-1b" if not args.smoke else "tiny", "weight_bytes": made["weight_bytes"],
                        "setup_s": time.perf_counter() - t0}
    floor_ms = 1000 * made["weight_bytes"] / COPY_BW
    results["batch1_floor_ms"] = floor_ms
    prompts = workload(made["vocab"], NUM_REQUESTS)

    reference = []
    try:
        results["hf_static"] = bench_hf_static(model, prompts)
        log(f"hf_static: {results['hf_static']['output_tokens_per_s']:.0f} tok/s")
        reference = reference_tokens(model, prompts[:4], 16)
    except Exception as exc:  # noqa: BLE001
        results["hf_static"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    del model, made
    free_gpu()

    try:
        results["engine"] = bench_engine(model_dir, prompts, reference, cuda_graphs=torch.cuda.is_available())
        log(f"engine: {results['engine']['output_tokens_per_s']:.0f} tok/s, "
            f"batch-1 {results['engine']['batch1_ms_per_token']:.2f} ms/token")
    except Exception as exc:  # noqa: BLE001
        results["engine"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        free_gpu()

    try:  # the same engine with eager decoder layers (graphs only): what compiling the layers buys
        if "engine_eager_layers" in skip:
            results["engine_eager_layers"] = {"skipped": "--skip"}
        else:
            results["engine_eager_layers"] = bench_engine(model_dir, prompts, reference,
                                                      cuda_graphs=torch.cuda.is_available(), compile_=False)
            log(f"engine, eager layers: {results['engine_eager_layers']['output_tokens_per_s']:.0f} tok/s, "
                f"batch-1 {results['engine_eager_layers']['batch1_ms_per_token']:.2f} ms/token")
    except Exception as exc:  # noqa: BLE001
        results["engine_eager_layers"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        free_gpu()

    try:
        results.update(bench_http(model_dir, prompts))
    except Exception as exc:  # noqa: BLE001
        results["http"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}

    base = results.get("hf_static", {}).get("output_tokens_per_s")
    rows = []
    for name in ("hf_static", "engine", "engine_eager_layers", "http_stream", "http_plain"):
        tps = results.get(name, {}).get("output_tokens_per_s")
        ratio = tps / base if (tps and base) else None
        results.setdefault(name, {})["ratio_vs_hf_static"] = ratio
        rows.append((name, tps if tps else ("skipped" if results[name].get("skipped") else None), ratio))
    b1_engine = results.get("engine", {}).get("batch1_ms_per_token")
    b1_http = results.get("http_batch1", {}).get("ms_per_token")
    results["batch1_vs_floor"] = {"engine": b1_engine / floor_ms if b1_engine else None,
                                  "http": b1_http / floor_ms if b1_http else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))

    print(f"\ncopt serve benchmark — {results['gpu']}, {results['date']}")
    print(f"{'case':<20}{'output tok/s':>14}{'× HF static':>13}")
    for name, tps, ratio in rows:
        shown = tps if isinstance(tps, str) else f"{tps:,.0f}" if tps else "error"
        print(f"{name:<20}{shown:>14}{(f'{ratio:.2f}' if ratio else '-'):>13}")
    stream = results.get("http_stream", {})
    if "ttft_s" in stream:
        t, i = stream["ttft_s"], stream["itl_s"]
        print(f"http_stream TTFT p50/p90/p99 (s): {t['p50']:.3f} / {t['p90']:.3f} / {t['p99']:.3f}")
        print(f"http_stream ITL  p50/p90/p99 (ms): {1e3 * i['p50']:.2f} / {1e3 * i['p90']:.2f} / {1e3 * i['p99']:.2f}")
    b1_eager = results.get("engine_eager_layers", {}).get("batch1_ms_per_token")
    print(f"batch-1 decode ms/token: engine {b1_engine and f'{b1_engine:.2f}'} "
          f"(eager layers {b1_eager and f'{b1_eager:.2f}'}), "
          f"http {b1_http and f'{b1_http:.2f}'}, floor {floor_ms:.2f}")
    eng = results.get("engine", {})
    if "ttft_s" in eng:
        print(f"engine: startup {eng['startup_s']:.1f} s, {eng['graphs']} graphs"
              f"{' (capture error: ' + str(eng['graph_error']) + ')' if eng.get('graph_error') else ''}, "
              f"TTFT p50/p99 {eng['ttft_s']['p50']:.3f}/{eng['ttft_s']['p99']:.3f} s, "
              f"HF agreement {eng['hf_agreement']}, compiled layers {eng.get('compiled_layers')}, "
              f"merged projection groups {eng.get('merged_projections')}"
              f"{' (compile error: ' + str(eng['compile_error']) + ')' if eng.get('compile_error') else ''}")
    print_phases("engine (all requests)", eng.get("phases"))
    print_phases("engine (batch 1)", eng.get("phases_batch1"))
    for name in ("http_stream", "http_plain", "http_batch1"):
        print_phases(f"server {name}", results.get(name, {}).get("phases"))
    print(f"results: {args.out}")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
