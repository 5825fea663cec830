"""Where a batch-1 decode step of copt serve's engine spends its GPU time: torch.profiler over one request of 256
greedy tokens (CUDA graphs, compiled layers, merged projections, async scheduling: copt serve's defaults), kernels
grouped by category, per decode step, against the wall time per token.

    python3 bench/gpu_decode_profile.py --out $OUT/decode_profile.json      (~1.5 minutes on the H200)
    python3 bench/gpu_decode_profile.py --shape 8b --compile-mode default --out dp8b.json   (Llama-3.1-8B shape)
    python3 bench/gpu_decode_profile.py --smoke --out /tmp/dp.json          (tiny model on the CPU: checks the script)

Model: the Llama-3.2-1B shape in bf16 with random weights (bench/gpu_serve.py's model dir). The matrix-vector
products alone took 0.833 ms as a CUDA graph (bench/gpu_decode_b1.py, cuBLAS, merged); the engine's token took
1.40 ms through bench/gpu_serve.py: this says where the rest goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEPS_TOKENS = 256


def decode_ms_per_token(result) -> float:  # noqa: ANN001 - an engine GenerationResult
    """Wall ms per token after the first (the decode steps)."""
    return 1000 * (result.latency_s - result.ttft_s) / (result.num_output_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    parser.add_argument("--decode-attention", default="auto", choices=["auto", "sdpa", "flex", "math", "paged"],
                        help="default auto: copt serve's own choice")
    parser.add_argument("--compile-mode", default="default",
                        choices=["default", "auto", "max-autotune-no-cudagraphs"])
    parser.add_argument("--b1-options", default=None,
                        help="comma-separated inductor options set true for the batch-1 decode layers instead of "
                        "--compile-mode's (e.g. max_autotune: the autotuned products without coordinate descent), "
                        "to weigh start-up against ms/token")
    parser.add_argument("--shape", default="1b", choices=["1b", "8b"], help="Llama-3.2-1B or Llama-3.1-8B shape")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse (or create) the model here")
    args = parser.parse_args()

    import torch
    from common import make_model_dir, summarize_kernels
    from torch.profiler import ProfilerActivity, profile

    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    cuda = torch.cuda.is_available() and not args.smoke
    if args.b1_options:
        import clusteropt_cli.core.serve.runner as runner_module

        options = {name.strip(): True for name in args.b1_options.split(",") if name.strip()}
        base = runner_module.decode_compile_modes
        runner_module.decode_compile_modes = lambda mode, device_type: (base(mode, device_type)[0], options)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="copt-decode-profile-")) / "model"
    if not (model_dir / "config.json").exists():
        if args.shape == "8b" and not args.smoke:
            from common import LLAMA_8B_SHAPE
            from gpu_serve_models import make_model_dir as make_shape_dir

            make_shape_dir(model_dir, LLAMA_8B_SHAPE)
        else:
            make_model_dir(model_dir, small=args.smoke)  # (the returned model is dropped here)
    if cuda:
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), max_batch_size=8, max_model_len=512, kv_cache_memory_gib=1.0,
                                 max_batch_tokens=1024, cuda_graphs=cuda, async_scheduling=args.async_scheduling,
                                 decode_attention=args.decode_attention, compile_mode=args.compile_mode,
                                 device="cuda" if cuda else "cpu"))
    engine.start()
    startup = time.perf_counter() - t0
    request = GenerationRequest(prompt_ids=list(range(10, 42)), max_new_tokens=STEPS_TOKENS, ignore_eos=True)
    try:
        for _ in range(2):
            engine.generate([request])  # warm-up: graphs, allocator
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            result = engine.generate([request])[0]
        per_token_ms = decode_ms_per_token(result)
        per_token_unprofiled_ms = decode_ms_per_token(engine.generate([request])[0])
    finally:
        engine.stop()

    steps = result.num_output_tokens - 1
    summary = summarize_kernels(prof, (result.latency_s - result.ttft_s), steps)  # kernels by category per step
    report = {
        "bench": "gpu_decode_profile", "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
        "shape": "smoke" if args.smoke else args.shape,
        "async_scheduling": args.async_scheduling, "decode_attention": args.decode_attention,
        "compile_mode": args.compile_mode, "b1_options": args.b1_options, "startup_s": round(startup, 1),
        "decode_steps": steps,
        "wall_ms_per_token_profiled": round(per_token_ms, 3),
        "wall_ms_per_token_unprofiled": round(per_token_unprofiled_ms, 3),
        **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"batch-1 decode on {report['gpu']} ({report['shape']}, compile mode {args.compile_mode}"
          f"{', batch-1 options ' + args.b1_options if args.b1_options else ''}, start-up "
          f"{startup:.1f} s): {per_token_unprofiled_ms:.3f} ms/token "
          f"({per_token_ms:.3f} under the profiler); GPU kernels {report['gpu_kernel_ms_per_step']:.3f} ms/step, "
          f"{report['kernels_per_step']:.1f} kernels/step")
    for name, ms in report["by_category_ms_per_step"].items():
        print(f"  {name:<48} {ms:.4f} ms/step")
    for row in report["top_kernels"][:16]:
        print(f"  {row['ms_per_step']:.4f} ms  x{row['calls_per_step']:<6} {row['name'][:100]}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
