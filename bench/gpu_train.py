"""copt train on the H200: tokens/s and peak memory of a Llama-3.2-1B-shaped model (random weights), micro-batch
8 × 2048, bf16 (single GPU: autocast over fp32 weights; ZeRO: DeepSpeed's bf16 mode, bf16 weights + fp32 masters
in the optimizer), against a plain PyTorch loop measured in the same run, plus `copt advise`'s predictions.

    python3 bench/gpu_train.py --out $OUT/train.json                      # baseline vs copt defaults (1 GPU)
    python3 bench/gpu_train.py --mode techniques --out $OUT/train_tech.json  # checkpointing, ZeRO-3+offload, fp8
    python3 bench/gpu_train.py --mode zero --out $OUT/train_zero.json       # 2 GPUs: ZeRO-2/3 per-GPU memory

Each case runs in its own process (clean peak-memory counters, a crash or OOM costs only that case) and is
guarded (the error is recorded, the others go on). Each mode fits in 5 minutes on one H200 (the first
torch.compile of the model takes ~40 s; DeepSpeed's cpu_adam compiles ~50 s on first use).
DeepSpeed needs TORCH_CUDA_ARCH_LIST=9.0 on the H200 (set here when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import summarize_kernels  # noqa: E402

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

MICRO_BATCH, SEQ_LEN = 8, 2048
GiB = 1024**3
LLAMA_1B = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5)

# name → (kind, settings). kind "baseline": the plain PyTorch loop; "copt": run_training in this process;
# "copt-dist": run_training under torchrun on 2 GPUs.
CASES: dict[str, tuple[str, dict]] = {
    "baseline_eager": ("baseline", dict(compile=False, checkpointing=False)),
    "baseline_compile": ("baseline", dict(compile=True, checkpointing=False)),
    "copt_default": ("copt", dict()),
    "copt_hf_loss": ("copt", dict(loss_impl="hf")),
    "copt_checkpointing": ("copt", dict(activation_checkpointing=True)),
    "copt_zero3_offload": ("copt", dict(zero=3, offload="cpu", activation_checkpointing=True)),
    "copt_fp8": ("copt", dict(precision="fp8")),
    # ZeRO comparison: the same eager step and the model's own loss everywhere (ZeRO-3 cannot use the fused loss)
    "copt_eager_1gpu": ("copt", dict(compile=False, loss_impl="hf")),
    "copt_zero2_2gpu": ("copt-dist", dict(zero=2, gpus=2, loss_impl="hf")),
    "copt_zero3_2gpu": ("copt-dist", dict(zero=3, gpus=2, loss_impl="hf")),
    # speed experiments on copt's defaults (issue 7): "bench_*" keys are applied by the worker, not by TrainRecipe
    "copt_profile": ("copt", dict(bench_profile=True)),
    "copt_cudnn_attn": ("copt", dict(bench_sdpa="cudnn")),
    "copt_chunk4k": ("copt", dict(loss_chunk_tokens=4096)),
    "copt_chunk8k": ("copt", dict(loss_chunk_tokens=8192)),
    "copt_stock_mask": ("copt", dict(bench_stock_sdpa=True)),  # transformers' own SDPA path (a mask under compile)
    "copt_coord_descent": ("copt", dict(bench_inductor={"coordinate_descent_tuning": True})),
    "copt_max_autotune": ("copt", dict(bench_inductor={"max_autotune": True, "max_autotune_gemm": True})),
    # before the deferred step readout: the host waits for every step's loss/grad norm (and copies batches from
    # pageable memory) before it queues the next step
    "copt_sync_each_step": ("copt", dict(bench_sync_each_step=True)),
}
MODES = {
    "single": ["baseline_eager", "baseline_compile", "copt_default", "copt_hf_loss"],
    "techniques": ["baseline_eager", "copt_checkpointing", "copt_zero3_offload", "copt_fp8"],
    "zero": ["copt_eager_1gpu", "copt_zero2_2gpu", "copt_zero3_2gpu"],
    "inductor-settings": ["copt_default", "copt_profile", "copt_cudnn_attn", "copt_chunk8k", "copt_coord_descent",
                "copt_max_autotune"],
    "final": ["baseline_eager", "copt_default", "copt_fp8"],
    "attention-mask": ["baseline_compile", "copt_default", "copt_stock_mask", "copt_profile", "copt_chunk4k",
                 "copt_chunk8k", "copt_checkpointing", "copt_fp8"],
    "step-readout": ["copt_sync_each_step", "copt_default", "copt_chunk4k", "copt_chunk8k", "copt_max_autotune"],
}
STEPS = {"baseline": 10, "copt": 10, "copt-dist": 8}
WARMUP = 3  # steps left out of the speed figure (compilation, allocator warm-up)


def build_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from clusteropt_cli.modelspec import load_model_spec

        cfg = load_model_spec("llama-3.2-1b").to_hf_config()
        cfg = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "dtype", "architectures")}
    except Exception:  # noqa: BLE001 - the explicit shape is the same model
        cfg = dict(LLAMA_1B)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model


def random_blocks(n_blocks: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (n_blocks, SEQ_LEN), generator=g)


def run_baseline(settings: dict) -> dict:
    """The plain loop: HF forward with labels, bf16 autocast over fp32 weights, fused AdamW (optionally compiled,
    optionally with HF gradient checkpointing)."""
    import torch

    model = build_model().cuda()
    if settings.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    step_model = torch.compile(model) if settings.get("compile") else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = random_blocks(MICRO_BATCH * STEPS["baseline"], model.config.vocab_size)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(STEPS["baseline"]):
        batch = data[step * MICRO_BATCH : (step + 1) * MICRO_BATCH].cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = times[WARMUP:]
    step_time = sum(timed) / len(timed)
    return {"tokens_per_s": MICRO_BATCH * SEQ_LEN / step_time, "step_time_s": step_time,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes":
            torch.cuda.max_memory_reserved(), "first_step_s": times[0], "final_loss": float(loss)}


def run_copt(settings: dict, world: int = 1) -> dict:
    """copt train's loop (run_training) with its defaults plus `settings`."""
    import tempfile

    import torch

    from clusteropt_cli.core.train import PackedDataset, read_metrics, run_training
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    steps = STEPS["copt-dist" if world > 1 else "copt"]
    bench = {k: settings.pop(k) for k in list(settings) if k.startswith("bench_")}
    apply_bench_settings(bench)
    profiler = StepProfiler(first=WARMUP + 2, last=WARMUP + 3) if bench.get("bench_profile") else None
    options = TrainRecipe(model="llama-3.2-1b", micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, max_steps=steps,
                          lr=1e-4, warmup_steps=0, precision=settings.pop("precision", "bf16"), **settings)
    model = build_model()
    dataset = PackedDataset(random_blocks(MICRO_BATCH * steps * world, model.config.vocab_size))
    with tempfile.TemporaryDirectory() as tmp:
        result = run_training(options, model, dataset, tmp, save_final=False,
                              callbacks=[profiler] if profiler else ())
        rows = read_metrics(Path(tmp) / "metrics.jsonl") if int(os.environ.get("RANK", "0")) == 0 else []
    timed = rows[WARMUP:] or rows
    step_time = sum(r["step_time_s"] for r in timed) / max(1, len(timed))
    out = {"engine": result.engine, "world_size": result.world_size,
           "tokens_per_s": (MICRO_BATCH * SEQ_LEN * world / step_time) if rows else None,
           "step_time_s": step_time if rows else None,
           "mfu": (sum(r["mfu"] for r in timed) / len(timed)) if rows and timed[0].get("mfu") is not None else None,
           "peak_mem_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
           "first_step_s": rows[0]["step_time_s"] if rows else None, "final_loss": result.final_loss,
           "losses": result.losses,
           # the dtype the engine computes with: bf16 under ZeRO (DeepSpeed's bf16 mode); fp32 = the pre-fix bug
           "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    if profiler is not None:
        out["profile"] = profiler.summary
    if world > 1:  # every rank's peak: ZeRO's per-GPU memory
        import torch.distributed as dist

        peaks = [None] * world
        if not dist.is_initialized():
            dist.init_process_group("nccl")
        dist.all_gather_object(peaks, out["peak_mem_bytes"])
        out["per_rank_peak_mem_bytes"] = peaks
    return out


def apply_bench_settings(bench: dict) -> None:
    """Process-wide switches of the speed experiments (set before the model is built and compiled)."""
    import torch

    if bench.get("bench_stock_sdpa"):  # what copt train did before the mask-free causal attention
        import clusteropt_cli.core.train.attention as attention

        attention.use_causal_sdpa = lambda model: False
    if bench.get("bench_sdpa") == "cudnn":  # SDPA picks cuDNN attention when flash and mem-efficient are off
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(True)
    if bench.get("bench_sync_each_step"):
        import clusteropt_cli.core.train.engines as engines
        import clusteropt_cli.core.train.loop as loop
        from clusteropt_cli.core.train.metrics import StepValues

        class ReadAtOnce(StepValues):
            deferred = False  # the loop reads (and waits for) every step before queueing the next

        loop.StepValues = ReadAtOnce
        engines._move = lambda batch, device: {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    for key, value in (bench.get("bench_inductor") or {}).items():
        import torch._inductor.config as inductor_config

        setattr(inductor_config, key, value)


class StepProfiler:
    """A run_training callback: torch.profiler over steps first..last, GPU kernel time by category."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.prof, self.summary, self.t0 = first, last, None, {}, 0.0

    def on_start(self, total_steps: int, start_step: int) -> None: ...

    def on_log(self, message: str) -> None: ...

    def on_end(self, result) -> None: ...  # noqa: ANN001

    def on_step(self, row: dict) -> None:
        import torch

        if row["step"] == self.first - 1:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif row["step"] == self.last and self.prof is not None:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.summary = summarize_kernels(self.prof, wall, self.last - self.first + 1)


def advise_prediction(name: str) -> dict | None:
    """What `copt advise` predicts for the case on an H200 (memory per GPU and tokens/s)."""
    try:
        from clusteropt_cli.core.advise.api import evaluate_train, resolve_target
        from clusteropt_cli.core.advise.plan import TrainPlan
        from clusteropt_cli.modelspec import load_model_spec

        kind, settings = CASES[name]
        gpus = settings.get("gpus", 1)
        plan = TrainPlan(micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, precision=settings.get("precision", "bf16"),
                         zero=settings.get("zero", 0), offload=settings.get("offload", "none"),
                         activation_checkpointing=bool(settings.get("activation_checkpointing",
                                                                    settings.get("checkpointing", False))),
                         compile=bool(settings.get("compile", kind != "copt-dist" and not settings.get("zero"))),
                         loss_impl=settings.get("loss_impl", "auto"),
                         loss_chunk_tokens=settings.get("loss_chunk_tokens"))
        target, _ = resolve_target("h200", gpus=gpus)
        result = evaluate_train(load_model_spec("llama-3.2-1b"), plan, target)
        return {"peak_mem_bytes": result["memory"].get("per_gpu_bytes"),
                "tokens_per_s": result["time"].get("tokens_per_s"), "mfu": result["time"].get("mfu")}
    except Exception as exc:  # noqa: BLE001 - a prediction that cannot be made is recorded, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def worker(name: str, out_path: Path) -> None:
    """Run one case in this process and write its JSON (rank 0 only under torchrun)."""
    import torch

    kind, settings = CASES[name]
    settings = dict(settings)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if kind == "baseline":
            result = run_baseline(settings)
        else:
            result = run_copt(settings, world=world)
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        import traceback

        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:],
                  "peak_mem_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
    if int(os.environ.get("RANK", "0")) == 0:
        out_path.write_text(json.dumps(result))


def run_case(name: str, tmp: Path, timeout: float) -> dict:
    kind, settings = CASES[name]
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--worker-out", str(out)]
    if kind == "copt-dist":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(settings.get("gpus", 2)), str(Path(__file__).resolve()), "--worker", name, "--worker-out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        tail = (proc.stdout + proc.stderr)[-2500:]
        result = json.loads(out.read_text()) if out.exists() else {"ok": False, "error": f"exit {proc.returncode}",
                                                                  "log_tail": tail}
        if not result.get("ok"):
            result.setdefault("log_tail", tail)
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    result["wall_s"] = time.time() - t0
    result["advise"] = advise_prediction(name)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "train.json")
    parser.add_argument("--mode", choices=sorted(MODES), default="single")
    parser.add_argument("--zero", action="store_true", help="same as --mode zero (2 GPUs)")
    parser.add_argument("--cases", help="comma-separated case names (overrides --mode)")
    parser.add_argument("--budget-s", type=float, default=285.0, help="wall-clock budget for the whole mode")
    parser.add_argument("--case-timeout-s", type=float, default=240.0,
                        help="limit of one case (max-autotune compiles longer)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.worker_out)
        return

    import tempfile

    import torch

    mode = "zero" if args.zero else args.mode
    names = args.cases.split(",") if args.cases else MODES[mode]
    started = time.time()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    report = {"bench": "gpu_train", "mode": mode, "date": time.strftime("%Y-%m-%d"), "gpu": gpu,
              "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "shape": {"model": "llama-3.2-1b (random weights)", "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN,
                        "precision": "bf16: autocast over fp32 weights (1 GPU), DeepSpeed bf16 mode (ZeRO)"},
              "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            left = args.budget_s - (time.time() - started)
            if left < 30:
                report["cases"][name] = {"ok": False, "error": "skipped: out of the mode's time budget"}
                continue
            if CASES[name][0] == "copt-dist" and torch.cuda.device_count() < CASES[name][1].get("gpus", 2):
                report["cases"][name] = {"ok": False, "error": f"needs {CASES[name][1].get('gpus', 2)} GPUs"}
                continue
            report["cases"][name] = run_case(name, Path(tmp), timeout=min(left, args.case_timeout_s))
            print(f"[{time.time() - started:5.0f}s] {name}: "
                  f"{'ok' if report['cases'][name].get('ok') else report['cases'][name].get('error')}", flush=True)
    base = report["cases"].get("baseline_eager", {})
    single = report["cases"].get("copt_eager_1gpu", {})
    for name, case in report["cases"].items():
        if case.get("ok") and base.get("ok") and case.get("tokens_per_s"):
            case["speed_vs_baseline_eager"] = case["tokens_per_s"] / base["tokens_per_s"]
            case["memory_vs_baseline_eager"] = case["peak_mem_bytes"] / base["peak_mem_bytes"]
        if case.get("ok") and single.get("ok") and name != "copt_eager_1gpu":
            case["memory_vs_single_gpu"] = case["peak_mem_bytes"] / single["peak_mem_bytes"]
        pred = case.get("advise") or {}
        if case.get("ok") and pred.get("peak_mem_bytes"):
            case["measured_over_predicted_memory"] = case["peak_mem_bytes"] / pred["peak_mem_bytes"]
        if case.get("ok") and pred.get("tokens_per_s") and case.get("tokens_per_s"):
            case["measured_over_predicted_tokens_per_s"] = case["tokens_per_s"] / pred["tokens_per_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))

    print(f"\ncopt train bench ({mode}) on {gpu}, Llama-3.2-1B shape, {MICRO_BATCH} x {SEQ_LEN}, {report['date']}")
    print(f"{'case':22} {'tok/s':>9} {'MFU':>6} {'peak GiB':>9} {'x base':>7} {'pred GiB':>9} {'pred tok/s':>10}")
    for name, case in report["cases"].items():
        if not case.get("ok"):
            print(f"{name:22} FAILED: {str(case.get('error'))[:90]}")
            continue
        pred = case.get("advise") or {}
        mfu = case.get("mfu")
        nan = float("nan")
        print(f"{name:22} {case['tokens_per_s'] or 0:9,.0f} {mfu if mfu is not None else nan:6.3f} "
              f"{case['peak_mem_bytes'] / GiB:9.1f} {case.get('speed_vs_baseline_eager', nan):7.2f} "
              f"{(pred.get('peak_mem_bytes') or nan) / GiB:9.1f} {pred.get('tokens_per_s') or nan:10,.0f}")
        if case.get("per_rank_peak_mem_bytes"):
            print(f"{'':22} per-rank peak GiB: {[round(p / GiB, 1) for p in case['per_rank_peak_mem_bytes']]}, "
                  f"weights {case.get('param_dtype')}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
