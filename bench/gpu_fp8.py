"""FP8 (W8A8) checkpoints on the H200: do they run FP8 GEMMs, and what do they gain over bf16?

    python3 bench/gpu_fp8.py --out $OUT/fp8.json        (≤ 4 minutes)

Llama-3.2-1B shape, random bf16 weights (bench/gpu_serve.py's model dir) → `copt quantize --method fp8`
(llm-compressor FP8_DYNAMIC: per-channel e4m3 weights, per-token dynamic activations). Then, same run:
  proof      one forward of the FP8 model as copt serve loads it (Fp8Linear): the aten::_scaled_mm calls and the
             GEMM kernels the profiler sees, against the bf16 model's; logits cosine FP8 vs bf16
  linears    every linear layer of the model once (the 112 GEMMs of a forward), bf16 vs FP8, at 1, 16, 256 and
             4,096 tokens, captured as CUDA graphs (launch overhead out; eager timing as a fallback)
  engine     copt serve's engine on each checkpoint: batch-1 decode ms/token, prefill of one 2,048-token prompt
             (TTFT), and 256 requests (prompts 32–256, 128 tokens) output tok/s
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def log(msg: str) -> None:
    print(msg, flush=True)


def free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def load(path: Path, fp8: bool):
    import torch
    from transformers import AutoModelForCausalLM

    from clusteropt_cli.core.serve.fp8_linear import swap_fp8_linears

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    swapped = swap_fp8_linears(model) if fp8 else 0
    return model, swapped


def proof(bf16_dir: Path, fp8_dir: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    out: dict = {}
    ids = torch.randint(10, 120000, (1, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = {}
    for name, path, fp8 in (("bf16", bf16_dir, False), ("fp8", fp8_dir, True)):
        model, swapped = load(path, fp8)
        with torch.no_grad():
            model(ids)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                logits[name] = model(ids).logits.float()
                torch.cuda.synchronize()
        events = prof.key_averages()
        cpu_ops = {e.key: e.count for e in events if e.key.startswith("aten::") and e.key in (
            "aten::_scaled_mm", "aten::mm", "aten::matmul", "aten::linear", "aten::addmm")}
        kernels = {}
        for e in events:
            if "CUDA" in str(e.device_type) and any(t in e.key.lower() for t in ("gemm", "nvjet", "xmma", "cutlass",
                                                                              "gemv", "sm90")):
                kernels[e.key[:140]] = e.count
        out[name] = {"fp8_linears": swapped, "ops": cpu_ops, "gemm_kernels": kernels,
                     "weights_bytes": sum(b.numel() * b.element_size() for b in model.buffers())
                     + sum(p.numel() * p.element_size() for p in model.parameters())}
        if fp8:
            layer = model.model.layers[0].mlp.down_proj
            out[name]["layer_repr"] = repr(layer)
        del model
        free()
    out["fp8_runs_scaled_mm"] = out["fp8"]["ops"].get("aten::_scaled_mm", 0) > 0
    out["logits_cosine_fp8_vs_bf16"] = torch.nn.functional.cosine_similarity(
        logits["fp8"].flatten(), logits["bf16"].flatten(), dim=0).item()
    return out


def linears(bf16_dir: Path, fp8_dir: Path, token_counts=(1, 16, 256, 4096)) -> dict:
    """All linear layers of the decoder once, as a CUDA graph per token count."""
    import torch

    out: dict = {}
    for name, path, fp8 in (("bf16", bf16_dir, False), ("fp8", fp8_dir, True)):
        model, _ = load(path, fp8)
        layers = [m for n, m in model.model.named_modules() if n.endswith(("_proj",))]
        res = {}
        for tokens in token_counts:
            xs = {}
            for m in layers:
                k = m.in_features
                if k not in xs:
                    xs[k] = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)

            def run(layers=layers, xs=xs):
                for m in layers:
                    m(xs[m.in_features])

            with torch.no_grad():
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
                mode = "cuda-graph"
                try:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    fn = graph.replay
                except Exception as exc:  # noqa: BLE001 - time eagerly instead
                    mode, fn = f"eager ({type(exc).__name__})", run
                fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    fn()
                end.record()
                torch.cuda.synchronize()
            res[tokens] = {"ms": start.elapsed_time(end) / 20, "mode": mode, "layers": len(layers)}
        out[name] = res
        del model
        free()
    out["speedup_fp8_over_bf16"] = {t: out["bf16"][t]["ms"] / out["fp8"][t]["ms"] for t in token_counts}
    return out


def engine_case(path: Path) -> dict:
    from common import OUT_TOKENS, workload

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=str(path), max_batch_size=256, max_model_len=2304, kv_cache_memory_gib=24.0,
                                 max_batch_tokens=2048, cuda_graphs=True))
    engine.start()
    out = {"startup_s": time.perf_counter() - t0, "graphs": engine.stats.graphs_captured,
           "fp8_linears": engine.runner.fp8_linears, "fp8_kernels": engine.runner.fp8_kernels}
    try:
        prompts = workload(128256, 256)
        engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=16, ignore_eos=True) for p in prompts[:8]])
        per_token = []
        for _ in range(3):
            r = engine.generate([GenerationRequest(prompt_ids=prompts[0][:32], max_new_tokens=256,
                                                   ignore_eos=True)])[0]
            per_token.append((r.latency_s - r.ttft_s) / (r.num_output_tokens - 1))
        out["batch1_ms_per_token"] = 1000 * sorted(per_token)[1]
        long_prompt = (prompts[1] * 20)[:2048]
        ttfts = [engine.generate([GenerationRequest(prompt_ids=long_prompt, max_new_tokens=2, ignore_eos=True)])[0]
                 .ttft_s for _ in range(3)]
        out["prefill_2048_ttft_ms"] = 1000 * sorted(ttfts)[1]
        t0 = time.perf_counter()
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=OUT_TOKENS, ignore_eos=True)
                                   for p in prompts])
        wall = time.perf_counter() - t0
        out["throughput_256_requests_tok_s"] = sum(r.num_output_tokens for r in results) / wall
    finally:
        engine.stop()
        del engine
        free()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/copt-fp8-bench"))
    args = parser.parse_args()
    import torch

    results: dict = {"bench": "gpu_fp8", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0),
                     "torch": torch.__version__, "model": "llama-3.2-1b shape, random bf16 weights"}
    bf16_dir, fp8_dir = args.work / "bf16", args.work / "fp8"

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str))

    try:
        if not (bf16_dir / "config.json").exists():
            from common import make_model_dir

            made = make_model_dir(bf16_dir)
            del made
            free()
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "clusteropt_cli", "quantize", str(bf16_dir), "--method", "fp8",
                               "--output", str(fp8_dir), "--overwrite", "--json"], capture_output=True, text=True,
                              cwd=REPO)
        results["quantize"] = {"rc": proc.returncode, "wall_s": time.perf_counter() - t0,
                               "stderr_tail": proc.stderr[-1500:] if proc.returncode else None}
        log(f"quantize fp8: rc={proc.returncode} in {results['quantize']['wall_s']:.1f} s")
    except Exception as exc:  # noqa: BLE001
        results["setup_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
        save()
        raise
    for part, fn in (("proof", lambda: proof(bf16_dir, fp8_dir)), ("linears", lambda: linears(bf16_dir, fp8_dir)),
                     ("engine_bf16", lambda: engine_case(bf16_dir)), ("engine_fp8", lambda: engine_case(fp8_dir))):
        t0 = time.perf_counter()
        try:
            results[part] = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the next part runs
            results[part] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2500:]}
            free()
        log(f"[{part} {time.perf_counter() - t0:.0f} s] {json.dumps(results[part], default=str)[:600]}")
        save()
    b, f = results.get("engine_bf16", {}), results.get("engine_fp8", {})
    if "batch1_ms_per_token" in b and "batch1_ms_per_token" in f:
        results["engine_fp8_vs_bf16"] = {
            "batch1_decode_speedup": b["batch1_ms_per_token"] / f["batch1_ms_per_token"],
            "prefill_2048_speedup": b["prefill_2048_ttft_ms"] / f["prefill_2048_ttft_ms"],
            "throughput_ratio": f["throughput_256_requests_tok_s"] / b["throughput_256_requests_tok_s"]}
        log(f"fp8 vs bf16 (engine): {results['engine_fp8_vs_bf16']}")
    save()
    log(f"results: {args.out}")


if __name__ == "__main__":
    main()
