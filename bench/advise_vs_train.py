"""copt advise's prediction next to copt train running exactly that plan, on one GPU.

For each case advise predicts the plan (in-process API: memory per GPU, tokens/s, fits) and ranks what to change
when it does not fit; then copt train's loop (run_training, with copt train's defaults: compiled decoder, fused
chunked loss, mask-free causal SDPA, fused AdamW, deferred step readout) runs the plan advise emitted, built from the
same recipe dict `copt advise --emit-recipe` writes, for a few steps on a random-weight model of the config's shape
and random token blocks. Measured peak (torch.cuda.max_memory_allocated) and tokens/s sit next to the prediction.

    python3 bench/advise_vs_train.py --out $OUT/advise_vs_train.json            # all cases, ~8 min on one H200
    python3 bench/advise_vs_train.py --cases 1b,1b-ckpt --out $OUT/a.json        # a subset
    python3 bench/advise_vs_train.py --list                                     # predictions only (any machine)

Cases: Llama-3.2-1B shape 8 × 2048, 3B 4 × 2048, Llama-3.1-8B 2 × 2048 (the plan advise ranks first if the given
one does not fit), each with and without activation checkpointing, the 1B with --precision fp8, and `8b-oom`: the 8B
at 4 × 2048 without checkpointing run as given, which advise says does not fit (it must OOM). The offload cases
run DeepSpeed ZeRO-3 (`1b-offload`, `3b-offload`, `3b-offload-ckpt`, `8b-offload`) and ZeRO-2 (`1b-zero2-offload`,
`3b-zero2-offload`) with CPU offload as given; besides the GPU's peak, every case records the host memory in use
beyond the idle machine (/proc/meminfo, which counts DeepSpeed's pinned buffers) against advise's host RAM figure,
and a case the kernel kills for memory is recorded as a host out-of-memory (`8b-offload` on a 128 GiB host). The
default run is the first eight cases; name the offload cases with --cases. Each case runs
in its own process (clean peak counters; an OOM costs only that case and is recorded: a plan predicted not to fit
should OOM). The first step of each case includes torch.compile (~40-100 s): it and the next two steps are left out
of tokens/s. A wall-clock budget (--budget-s, default 530 s) skips what no longer fits (recorded as skipped: run those
with --cases in a second call).
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
from common import host_probe_subprocess  # noqa: E402 - bench/ is on sys.path when run as a script

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's ops on the H200, if advise picks ZeRO

GiB = 1024**3
WARMUP = 3  # steps left out of tokens/s (compilation, allocator warm-up)
# name → (model preset, micro-batch, plan overrides); seq_len 2048 everywhere
# (in the order they run: the plain plans first, so a tight budget skips variants, not shapes)
CASES: dict[str, tuple[str, int, dict]] = {
    "1b": ("llama-3.2-1b", 8, {}),
    "3b": ("llama-3.2-3b", 4, {}),
    "8b": ("llama-3.1-8b", 2, {}),
    "1b-ckpt": ("llama-3.2-1b", 8, {"activation_checkpointing": True}),
    "3b-ckpt": ("llama-3.2-3b", 4, {"activation_checkpointing": True}),
    "8b-ckpt": ("llama-3.1-8b", 2, {"activation_checkpointing": True}),
    "1b-fp8": ("llama-3.2-1b", 8, {"precision": "fp8"}),
    # the plan as given, which advise says does not fit one H200 (no checkpointing at micro-batch 4): run anyway,
    # it must run out of memory (the verdict is checked, not the figures)
    "8b-oom": ("llama-3.1-8b", 4, {"as_given": True}),
    # ZeRO-3 with parameters and optimizer offloaded to the host, run as given: the host memory it takes (DeepSpeed's
    # pinned fp32 masters, Adam moments, fp32 gradient partitions and 16-bit parameters) against advise's figure; the
    # 8B's needs more than a 128 GiB host holds
    "3b-offload": ("llama-3.2-3b", 4, {"zero": 3, "offload": "cpu", "as_given": True}),
    "1b-offload": ("llama-3.2-1b", 8, {"zero": 3, "offload": "cpu", "activation_checkpointing": True,
                                       "as_given": True}),
    "3b-zero2-offload": ("llama-3.2-3b", 4, {"zero": 2, "offload": "cpu", "activation_checkpointing": True,
                                             "as_given": True}),
    "3b-offload-ckpt": ("llama-3.2-3b", 4, {"zero": 3, "offload": "cpu", "activation_checkpointing": True,
                                            "as_given": True}),
    "1b-zero2-offload": ("llama-3.2-1b", 8, {"zero": 2, "offload": "cpu", "as_given": True}),
    "8b-offload": ("llama-3.1-8b", 2, {"zero": 3, "offload": "cpu", "activation_checkpointing": True,
                                       "as_given": True}),
}
SEQ_LEN = 2048


def predict(name: str, gpu: str | None) -> dict:
    """advise's plan for the case (the top plan: the given one, or what advise stacks until it fits) and its
    prediction, with the copt train recipe dict that runs it."""
    from clusteropt_cli.core.advise import api
    from clusteropt_cli.core.advise.plan import TrainPlan
    from clusteropt_cli.core.advise.recipes import train_recipe_data
    from clusteropt_cli.modelspec import load_model_spec

    model, micro_batch, overrides = CASES[name]
    overrides = dict(overrides)
    as_given = overrides.pop("as_given", False)
    target, _notes = api.resolve_target(gpu)
    spec = load_model_spec(model)
    given = TrainPlan(micro_batch=micro_batch, seq_len=SEQ_LEN, **overrides)
    result = api.advise(spec, target, given, model_arg=model)
    if as_given:  # the plan the user gave, whatever advise says of it
        top, applies, mem, tm = given, [], result["memory"], result["time"]
    else:
        top, applies = TrainPlan(**result["top_plan"]["workload"]), result["top_plan"]["applies"]
        mem, tm = result["top_plan"]["memory"], result["top_plan"]["time"]
    recipe = train_recipe_data(top, model, target.gpus_per_node, target.nodes)
    return {"model": model, "gpu": target.name, "applies": applies,
            "given_fits": result["memory"]["fits"], "recipe": recipe,
            "peak_mem_bytes": mem["per_gpu_bytes"], "required_bytes": mem["required_bytes"], "fits": mem["fits"],
            "peak_phase": mem["peak_phase"], "tokens_per_s": tm.get("tokens_per_s"),
            "host_peak_bytes": (mem.get("host") or {}).get("peak_bytes"),
            "host_fits": (mem.get("host") or {}).get("fits"),
            "runs_compiled": top.runs_compiled(target.device), "loss": top.loss(spec)}


def build_model(model: str, on_host: bool = False, partitioned: bool = False):
    """A random-weight model of the preset's shape, initialized on the GPU (an 8B fp32 init on the host is slow);
    `on_host` then moves it to the host, where copt train loads a model before DeepSpeed takes it. `partitioned`:
    built under the live ZeRO-3 config's deepspeed.zero.Init, which places the partitions itself."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from clusteropt_cli.modelspec import load_model_spec

    cfg = load_model_spec(model).to_hf_config()
    cfg = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "dtype", "architectures")}
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    if partitioned:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if on_host:
        model = model.cpu()
        torch.cuda.empty_cache()
    return model


class HostMemorySampler:
    """Peak resident memory of this process and peak memory in use on the host (MemTotal − MemAvailable, which
    counts DeepSpeed's pinned buffers wherever the kernel accounts them), sampled every 0.2 s and written to
    `path` each second so a process the kernel kills for memory still leaves its figures."""

    def __init__(self, path: Path):
        import threading

        self.path, self.stop = path, threading.Event()
        self.peak_rss = self.peak_used = 0
        info = self._meminfo()
        self.total, self.start_used = info["MemTotal"], info["MemTotal"] - info["MemAvailable"]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _meminfo() -> dict[str, int]:
        values = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, rest = line.split(":", 1)
            values[key] = int(rest.split()[0]) * 1024
        return values

    @staticmethod
    def _rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def figures(self) -> dict:
        return {"host_total_bytes": self.total, "host_used_at_start_bytes": self.start_used,
                "host_peak_used_bytes": self.peak_used, "host_peak_rss_bytes": self.peak_rss}

    def _run(self) -> None:
        tick = 0
        while not self.stop.wait(0.2):
            info = self._meminfo()
            self.peak_used = max(self.peak_used, info["MemTotal"] - info["MemAvailable"])
            self.peak_rss = max(self.peak_rss, self._rss())
            tick += 1
            if tick % 5 == 0:
                self.path.write_text(json.dumps(self.figures()))

    def close(self) -> dict:
        self.stop.set()
        self.thread.join()
        return self.figures()


def run_plan(recipe: dict, steps: int) -> dict:
    """copt train's loop on the recipe advise emitted (data and output supplied here), `steps` optimizer steps."""
    import tempfile

    import torch

    from clusteropt_cli.core.train import PackedDataset, read_metrics, run_training
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    values = {k: v for k, v in recipe.items() if k not in ("data", "prediction")}
    options = TrainRecipe.model_validate({**values, "max_steps": steps, "lr": 1e-4, "warmup_steps": 0})
    # ZeRO-3 as copt train builds it: partitioned under deepspeed.zero.Init (onto the host with offload)
    zero3 = None
    if options.zero == 3 and not os.environ.get("COPT_BENCH_ZERO3_LOADED_WHOLE"):
        from clusteropt_cli.core.train.engines import zero3_model_init

        zero3 = zero3_model_init(options, 1, "cuda")
    model = build_model(recipe["model"], on_host=options.offload != "none", partitioned=zero3 is not None)
    blocks = options.micro_batch * options.grad_accum * steps
    g = torch.Generator().manual_seed(0)
    dataset = PackedDataset(torch.randint(0, model.config.vocab_size, (blocks, options.seq_len), generator=g))
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_training(options, model, dataset, tmp, save_final=False)
        rows = read_metrics(Path(tmp) / "metrics.jsonl")
    zero3_built = zero3 is not None
    del zero3
    timed = rows[WARMUP:] or rows[1:] or rows
    step_time = sum(r["step_time_s"] for r in timed) / max(1, len(timed))
    tokens = options.micro_batch * options.grad_accum * options.seq_len
    return {"engine": result.engine, "zero3_built_partitioned": zero3_built,
            "tokens_per_s": tokens / step_time if rows else None,
            "step_times_s": [r["step_time_s"] for r in rows],
            "step_time_s": step_time if rows else None, "first_step_s": rows[0]["step_time_s"] if rows else None,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "final_loss": result.final_loss,
            "steps_timed": len(timed)}


def worker(name: str, gpu: str | None, steps: int, out: Path) -> None:
    import torch

    pred = predict(name, gpu)
    sampler = HostMemorySampler(out.with_suffix(".host.json"))
    try:
        measured = {"ok": True, **run_plan(pred["recipe"], steps)}
    except Exception as exc:  # noqa: BLE001 - recorded: an OOM is a result when advise said it does not fit
        measured = {"ok": False, "oom": isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc),
                    "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                    "peak_mem_bytes": torch.cuda.max_memory_allocated()}
    out.write_text(json.dumps({**measured, **sampler.close()}))


def _err(pred: float | None, meas: float | None) -> float | None:
    return None if not pred or not meas else 100.0 * (pred - meas) / meas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--cases", default=",".join(list(CASES)[:8]),
                        help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--gpu", help="catalog GPU advise plans for (default: the detected GPU)")
    parser.add_argument("--steps", type=int, default=6, help=f"optimizer steps per case (first {WARMUP} untimed)")
    parser.add_argument("--budget-s", type=float, default=530.0, help="wall-clock budget for all cases")
    parser.add_argument("--case-timeout-s", type=float, default=200.0)
    parser.add_argument("--zero3-loaded-whole", action="store_true",
                        help="ZeRO-3 cases: build the model whole and let deepspeed.initialize partition it (copt "
                             "train before it built under zero.Init), for an A/B on one machine")
    parser.add_argument("--list", action="store_true", help="print advise's predictions and exit (no GPU needed)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.worker:
        worker(args.worker, args.gpu, args.steps, args.worker_out)
        return
    gpu = args.gpu or ("h200" if args.list else None)
    if args.list:
        for name in names:
            p = predict(name, gpu)
            print(f"{name:8} {p['model']:13} applies={'+'.join(p['applies']) or '-':24} "
                  f"peak {p['peak_mem_bytes'] / GiB:6.1f} GiB  required {p['required_bytes'] / GiB:6.1f} GiB  "
                  f"fits={p['fits']}  {p['tokens_per_s'] or 0:9,.0f} tok/s  compiled={p['runs_compiled']} "
                  f"loss={p['loss']}")
        return
    if args.out is None:
        parser.error("--out is required (or --list)")

    import tempfile

    import torch

    started = time.time()
    report = {"bench": "advise_vs_train", "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "host_cpu": host_probe_subprocess(), "seq_len": SEQ_LEN,
              "steps": args.steps,
              "warmup_steps": WARMUP,
              "cases": {}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if args.zero3_loaded_whole:
        env["COPT_BENCH_ZERO3_LOADED_WHOLE"] = "1"
        report["zero3_loaded_whole"] = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            pred = predict(name, gpu)
            case: dict = {"predicted": pred}
            left = args.budget_s - (time.time() - started)
            if left < 45:
                case["measured"] = {"ok": False, "error": "skipped: out of the time budget"}
            else:
                out = Path(tmp) / f"{name}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--worker-out", str(out),
                       "--steps", str(args.steps), *(["--gpu", args.gpu] if args.gpu else [])]
                t0 = time.time()
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                                          timeout=min(left, args.case_timeout_s))
                    tail = (proc.stdout + proc.stderr)[-2000:]
                    host = out.with_suffix(".host.json")
                    case["measured"] = json.loads(out.read_text()) if out.exists() else {
                        "ok": False, "error": f"exit {proc.returncode}", "log_tail": tail,
                        # SIGKILL with no result: the kernel's out-of-memory killer (the host ran out)
                        **({"oom": "host"} if proc.returncode == -9 else {}),
                        **(json.loads(host.read_text()) if host.exists() else {})}
                except subprocess.TimeoutExpired:
                    case["measured"] = {"ok": False, "error": "timed out"}
                case["measured"]["wall_s"] = time.time() - t0
            m = case["measured"]
            case["peak_error_pct"] = _err(pred["peak_mem_bytes"], m.get("peak_mem_bytes")) if m.get("ok") else None
            case["tokens_per_s_error_pct"] = _err(pred["tokens_per_s"], m.get("tokens_per_s")) if m.get("ok") else None
            case["fit_verdict_right"] = (m.get("ok") is True) == bool(pred["fits"]) if (m.get("ok") or m.get("oom")) \
                else None
            report["cases"][name] = case
            print(f"[{time.time() - started:5.0f}s] {name}: {'ok' if m.get('ok') else m.get('error')}", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))  # after every case: a timeout keeps what ran

    print(f"\nadvise vs copt train on {report['gpu']}, seq {SEQ_LEN}, {args.steps} steps ({WARMUP} untimed), "
          f"{report['date']}")
    print(f"{'case':8} {'plan':26} {'pred GiB':>8} {'meas GiB':>8} {'err':>7} {'pred tok/s':>10} {'meas tok/s':>10} "
          f"{'err':>7}  fits(pred/ran)")
    nan = float("nan")
    for name, case in report["cases"].items():
        p, m = case["predicted"], case["measured"]
        plan = f"mb{p['recipe']['micro_batch']} " + ("+".join(p["applies"]) or "as given")
        if p["recipe"].get("activation_checkpointing"):
            plan += " ckpt"
        if p["recipe"].get("precision") == "fp8":
            plan += " fp8"
        ran = "ran" if m.get("ok") else ("OOM" if m.get("oom") else "failed")
        print(f"{name:8} {plan[:26]:26} {p['peak_mem_bytes'] / GiB:8.1f} "
              f"{(m.get('peak_mem_bytes') or nan) / GiB if m.get('ok') else nan:8.1f} "
              f"{case['peak_error_pct'] if case['peak_error_pct'] is not None else nan:+6.1f}% "
              f"{p['tokens_per_s'] or nan:10,.0f} {m.get('tokens_per_s') or nan:10,.0f} "
              f"{case['tokens_per_s_error_pct'] if case['tokens_per_s_error_pct'] is not None else nan:+6.1f}%  "
              f"{p['fits']}/{ran}" + ("" if m.get("ok") or m.get("oom") else f"  {str(m.get('error'))[:60]}"))
        if m.get("host_total_bytes"):
            used = (m["host_peak_used_bytes"] - m["host_used_at_start_bytes"]) / GiB
            if p.get("host_peak_bytes"):
                print(f"{'':8} host beyond idle: predicted {p['host_peak_bytes'] / GiB:.1f} GiB (fits "
                      f"{p['host_fits']}), measured {used:.1f} GiB")
            print(f"{'':8} host: peak in use {m['host_peak_used_bytes'] / GiB:.1f} GiB (at start "
                  f"{m['host_used_at_start_bytes'] / GiB:.1f}) of {m['host_total_bytes'] / GiB:.1f}; peak RSS "
                  f"{m['host_peak_rss_bytes'] / GiB:.1f} GiB")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
