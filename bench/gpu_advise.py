"""Calibrate copt advise against real peaks on the GPU (issue 3).

Single GPU (≤ 5 min on an H200):
    python3 bench/gpu_advise.py --out $OUT/advise.json
measures torch.cuda.max_memory_allocated (and reserved) of HF Llama models built from configs with random weights:
  * training steps: torch AdamW (fused) + bf16 autocast over fp32 weights, sdpa, with and without gradient
    checkpointing, several shapes / micro-batches / sequence lengths (one eager-attention case); the anchor case is
    run twice, keeping and dropping the forward's logits during backward (calibration.LOGITS_HELD_IN_BACKWARD);
  * HF generate (bf16 weights): peak during generate at several batch × context sizes, plus TTFT and TPOT;
and compares each with advise's prediction (error % = (predicted − measured) / measured).

ZeRO on 2 GPUs (nvidia-h200-x2; DeepSpeed wheel on PYTHONPATH, TORCH_CUDA_ARCH_LIST=9.0), one process per stage
(an engine of an earlier stage left in the process inflated the 2026-11-30 peaks of ZeRO-1/2/3):
    for s in 0 1 2 3; do torchrun --nproc-per-node 2 bench/gpu_advise.py --zero --stages $s --out $OUT/zero$s.json; done
runs DeepSpeed ZeRO 0/1/2/3 steps (bf16, config from copt's own --emit-ds-config builder) and records per-GPU peaks.

`--cpu-smoke` runs every code path on the CPU with tiny shapes (no memory figures) to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder cannot parse '9.0a'
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1024**3

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=131072, head_dim=64)
LLAMA_SMALL = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                   intermediate_size=4096, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=8192)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, tie_word_embeddings=True, max_position_embeddings=512)

# (shape, micro_batch, seq_len, checkpointing, attn, logits_held)
TRAIN_CASES = [
    ("llama-1b", 8, 2048, False, "sdpa", True),   # the README anchor (73.8 GiB)
    ("llama-1b", 8, 2048, False, "sdpa", False),  # same, logits dropped before backward
    ("llama-1b", 8, 2048, True, "sdpa", True),    # anchor with checkpointing (42.5 GiB)
    ("llama-1b", 4, 2048, False, "sdpa", True),
    ("llama-1b", 4, 1024, False, "sdpa", True),
    ("llama-1b", 1, 2048, False, "sdpa", True),
    ("llama-1b", 8, 1024, True, "sdpa", True),
    ("llama-1b", 1, 1024, False, "eager", True),
    ("llama-small", 8, 2048, False, "sdpa", True),
    ("llama-small", 16, 1024, True, "sdpa", True),
]
# (shape, batch, prompt_len, gen_len)
GENERATE_CASES = [("llama-1b", 1, 512, 64), ("llama-1b", 16, 1024, 64), ("llama-1b", 64, 512, 32),
                  ("llama-small", 32, 2048, 32)]
ZERO_CASES = [0, 1, 2, 3]


def shapes(smoke: bool) -> dict[str, dict]:
    if smoke:
        return {"llama-1b": TINY, "llama-small": TINY}
    return {"llama-1b": LLAMA_1B, "llama-small": LLAMA_SMALL}


def llama_config(shape: dict, attn: str):
    from transformers import LlamaConfig

    return LlamaConfig(**shape, attn_implementation=attn, use_cache=False)


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def predict_train(shape: dict, micro_batch: int, seq_len: int, ckpt: bool, attn: str, world: int = 1,
                  zero: int = 0, logits_held: bool = True) -> dict:
    from clusteropt_cli.core.advise import calibration as cal
    from clusteropt_cli.core.advise.memory import train_memory
    from clusteropt_cli.core.advise.plan import Target, TrainPlan
    from clusteropt_cli.core.advise.timing import train_time
    from clusteropt_cli.hardware import get_gpu
    from clusteropt_cli.modelspec import load_model_spec

    spec = load_model_spec({"model_type": "llama", **shape})
    # the loop measured here: eager HF forward with the model's own loss (not copt train's compiled defaults)
    plan = TrainPlan(micro_batch=micro_batch, seq_len=seq_len, activation_checkpointing=ckpt, attn=attn, zero=zero,
                     compile=False, loss_impl="hf")
    target = Target(get_gpu("h200"), gpus_per_node=world)
    saved = cal.LOGITS_HELD_IN_BACKWARD
    cal.LOGITS_HELD_IN_BACKWARD = logits_held
    try:
        mem = train_memory(spec, plan, target)
    finally:
        cal.LOGITS_HELD_IN_BACKWARD = saved
    tm = train_time(spec, plan, target).figures
    return {"peak_mem_bytes": mem.per_gpu_bytes, "peak_phase": mem.peak_phase, "required_bytes": mem.required_bytes,
            "breakdown": mem.breakdown, "tokens_per_s": tm["tokens_per_s"], "step_time_s": tm["step_time_s"]}


def run_train_case(shape: dict, micro_batch: int, seq_len: int, ckpt: bool, attn: str, logits_held: bool,
                   device: str, steps: int = 3) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    free(device)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(shape, attn))
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    vocab = shape["vocab_size"]
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    times = []
    for step in range(steps):
        if step == 1 and device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # steady state: optimizer states exist from here on
        start = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        loss = out.loss
        if not logits_held:
            del out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del loss
        out = None  # noqa: F841 - release the logits of this step
    result = {"step_time_s": min(times[1:]) if len(times) > 1 else times[0]}
    result["tokens_per_s"] = micro_batch * seq_len / result["step_time_s"]
    if device == "cuda":
        result["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    del model, opt, ids
    free(device)
    return result


def predict_generate(shape: dict, batch: int, prompt_len: int, gen_len: int) -> dict:
    from clusteropt_cli.core.advise.memory import infer_memory
    from clusteropt_cli.core.advise.plan import InferPlan, Target
    from clusteropt_cli.core.advise.timing import infer_time
    from clusteropt_cli.hardware import get_gpu
    from clusteropt_cli.modelspec import load_model_spec

    spec = load_model_spec({"model_type": "llama", **shape})
    plan = InferPlan(batch=batch, prompt_len=prompt_len, gen_len=gen_len)
    target = Target(get_gpu("h200"))
    mem = infer_memory(spec, plan, target)
    tm = infer_time(spec, plan, target).figures
    return {"peak_mem_bytes": mem.per_gpu_bytes, "peak_phase": mem.peak_phase, "breakdown": mem.breakdown,
            "ttft_s": tm["ttft_s"], "tpot_s": tm["tpot_s"], "tpot_floor_s": tm["tpot_floor_s"]}


def run_generate_case(shape: dict, batch: int, prompt_len: int, gen_len: int, device: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    free(device)
    config = llama_config(shape, "sdpa")
    config.use_cache = True
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    ids = torch.randint(0, shape["vocab_size"], (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, attention_mask=mask[:, :8], do_sample=False,
                       pad_token_id=0, eos_token_id=None)  # warm-up
        free(device)
        sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        sync()
        ttft = time.perf_counter() - start
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, **kwargs)
        sync()
        total = time.perf_counter() - start
    result = {"ttft_s": ttft, "tpot_s": max(0.0, total - ttft) / max(1, gen_len - 1),
              "generated": int(out.shape[1] - prompt_len)}
    if device == "cuda":
        result["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    del model, ids, out
    free(device)
    return result


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def single_gpu(args: argparse.Namespace) -> dict:
    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    sizes = shapes(args.cpu_smoke)
    results = {"mode": "single", "device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "torch": torch.__version__, "cases": []}
    began = time.time()
    cases = TRAIN_CASES[:3] if args.cpu_smoke else TRAIN_CASES
    for shape_name, mb, seq, ckpt, attn, held in cases:
        if args.cpu_smoke:
            mb, seq = 2, 32
        case = {"kind": "train", "shape": shape_name, "micro_batch": mb, "seq_len": seq, "checkpointing": ckpt,
                "attn": attn, "logits_held": held}
        try:
            case["predicted"] = predict_train(sizes[shape_name], mb, seq, ckpt, attn, logits_held=held)
            if device == "cuda":
                total = torch.cuda.get_device_properties(0).total_memory
                case["predicted_fits"] = case["predicted"]["required_bytes"] <= total
            case["measured"] = run_train_case(sizes[shape_name], mb, seq, ckpt, attn, held, device)
            case["error_pct"] = {k: error_pct(case["predicted"].get(k), case["measured"].get(k))
                                 for k in ("peak_mem_bytes", "tokens_per_s")}
            case["measured_fits"] = True
        except Exception as exc:  # noqa: BLE001 - record and go on
            case["error"] = f"{type(exc).__name__}: {exc}"
            if "OutOfMemory" in type(exc).__name__:
                case["measured_fits"] = False
            case["traceback"] = traceback.format_exc(limit=4)
            free(device)
        results["cases"].append(case)
        print(_line(case), flush=True)
        if time.time() - began > args.budget_s * 0.7:
            results["skipped"] = "time budget"
            break
    gen_cases = GENERATE_CASES[:1] if args.cpu_smoke else GENERATE_CASES
    for shape_name, batch, prompt, gen in gen_cases:
        if args.cpu_smoke:
            batch, prompt, gen = 2, 16, 4
        case = {"kind": "generate", "shape": shape_name, "batch": batch, "prompt_len": prompt, "gen_len": gen}
        try:
            case["predicted"] = predict_generate(sizes[shape_name], batch, prompt, gen)
            case["measured"] = run_generate_case(sizes[shape_name], batch, prompt, gen, device)
            case["error_pct"] = {k: error_pct(case["predicted"].get(k), case["measured"].get(k))
                                 for k in ("peak_mem_bytes", "ttft_s", "tpot_s")}
        except Exception as exc:  # noqa: BLE001
            case["error"] = f"{type(exc).__name__}: {exc}"
            case["traceback"] = traceback.format_exc(limit=4)
            free(device)
        results["cases"].append(case)
        print(_line(case), flush=True)
        if time.time() - began > args.budget_s:
            results["skipped"] = "time budget"
            break
    results["elapsed_s"] = time.time() - began
    return results


def zero_mode(args: argparse.Namespace) -> dict:
    """DeepSpeed ZeRO 0–3 under torchrun: per-rank peaks vs advise's per-GPU prediction."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from clusteropt_cli.core.advise.api import advise, deepspeed_config
    from clusteropt_cli.core.advise.plan import Target, TrainPlan
    from clusteropt_cli.hardware import get_gpu
    from clusteropt_cli.modelspec import load_model_spec

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    shape = shapes(args.cpu_smoke)["llama-1b"]
    mb, seq, ckpt = (2, 32, True) if args.cpu_smoke else (4, 2048, True)
    spec = load_model_spec({"model_type": "llama", **shape})
    results = {"mode": "zero", "world": world, "micro_batch": mb, "seq_len": seq, "checkpointing": ckpt,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": []}
    for stage in args.stages:
        case: dict = {"kind": "zero", "zero": stage}
        # memory still held from an earlier case in this process inflates its peak: record it (and prefer one
        # process per stage: --stages N)
        case["allocated_before_bytes"] = torch.cuda.memory_allocated() if device == "cuda" else 0
        try:
            plan = TrainPlan(micro_batch=mb, seq_len=seq, activation_checkpointing=ckpt, zero=stage, loss_impl="hf")
            target = Target(get_gpu("h200"), gpus_per_node=world)
            advice = advise(spec, target, plan, [], model_arg="llama-1b-shape")
            config = deepspeed_config(advice)
            config.pop("optimizer", None)  # use torch AdamW (no op build)
            config["zero_allow_untested_optimizer"] = True
            case["ds_config"] = config
            case["predicted"] = {"peak_mem_bytes": advice["memory"]["per_gpu_bytes"],
                                 "breakdown": advice["memory"]["breakdown"]}
            free(device)
            with torch.device(device):
                model = LlamaForCausalLM(llama_config(shape, "sdpa"))
            model.gradient_checkpointing_enable()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            ids = torch.randint(0, shape["vocab_size"], (mb, seq), device=engine.device)
            times = []
            for step in range(3):
                if step == 1 and device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
            peaks = [None] * world
            dist.all_gather_object(peaks, peak)
            case["measured"] = {"peak_mem_bytes_per_rank": peaks, "peak_mem_bytes": max(peaks),
                                "step_time_s": min(times[1:])}
            case["error_pct"] = {"peak_mem_bytes": error_pct(case["predicted"]["peak_mem_bytes"], max(peaks))}
            engine.destroy() if hasattr(engine, "destroy") else None
            del engine, model, optimizer, ids
        except Exception as exc:  # noqa: BLE001
            case["error"] = f"{type(exc).__name__}: {exc}"
            case["traceback"] = traceback.format_exc(limit=4)
        free(device)
        results["cases"].append(case)
        if local_rank == 0:
            print(_line(case), flush=True)
    return results


def _line(case: dict) -> str:
    if "error" in case:
        return f"{case['kind']:8s} {case.get('shape', '')} ERROR {case['error'][:120]}"
    m, p, e = case["measured"], case["predicted"], case.get("error_pct", {})
    label = {"train": lambda c: f"{c['shape']} mb{c['micro_batch']}x{c['seq_len']} ckpt={int(c['checkpointing'])} "
                                f"{c['attn']} held={int(c['logits_held'])}",
             "generate": lambda c: f"{c['shape']} b{c['batch']} p{c['prompt_len']} g{c['gen_len']}",
             "zero": lambda c: f"zero-{c['zero']}"}[case["kind"]](case)
    mem = m.get("peak_mem_bytes")
    err = e.get("peak_mem_bytes")
    return (f"{case['kind']:8s} {label:48s} measured {(mem or 0) / GiB:7.2f} GiB  predicted "
            f"{p['peak_mem_bytes'] / GiB:7.2f} GiB  error {'-' if err is None else f'{err:+.1f}%'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("advise.json"))
    parser.add_argument("--zero", action="store_true", help="DeepSpeed ZeRO 0-3 under torchrun (2 GPUs)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--budget-s", type=float, default=270.0)
    parser.add_argument("--stages", default=",".join(map(str, ZERO_CASES)),
                        help="ZeRO stages to run with --zero (run one per process for clean peaks)")
    args = parser.parse_args()
    args.stages = [int(x) for x in str(args.stages).split(",") if x.strip()]
    results = zero_mode(args) if args.zero else single_gpu(args)
    if int(os.environ.get("RANK", "0")) == 0:
        from clusteropt_cli.core.advise import calibration as cal

        results["calibration"] = {k: v for k, v in vars(cal).items() if k.isupper() and not k.startswith("_")}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        errors = [abs(c["error_pct"]["peak_mem_bytes"]) for c in results["cases"]
                  if c.get("error_pct", {}).get("peak_mem_bytes") is not None]
        if errors:
            print(f"peak memory: {len(errors)} cases, max |error| {max(errors):.1f}%, "
                  f"within ±10%: {sum(e <= 10 for e in errors)}/{len(errors)}")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
