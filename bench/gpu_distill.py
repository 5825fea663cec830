"""H200 benchmark for `copt distill logits`: a Llama-3.2-1B-shaped teacher distilled into a smaller student.

Run from the repo root:  python3 bench/gpu_distill.py --out $OUT/distill.json

RANDOM WEIGHTS (built from configs) and random token data: the figures are throughput and memory, not quality.
Everything runs through copt's own code: the distill loss_fn (clusteropt_cli.core.distill.logits) inside copt
train's run_training loop (bf16 autocast over fp32 master weights, AdamW, grad clip), the teacher frozen in bf16.

Cases (same student, data shape and optimizer; each guarded, GPU memory freed in between):
  ce-baseline      the student trained with copt train's default loss (fused chunked CE): the baseline
  kd-forward-kl    alpha 0.5, T 2, full-vocabulary forward KL, 300 steps (logits chunked: copt's default here)
  kd-full-logits   the same with the [tokens, vocab] logits materialised (chunking off)
  kd-top64         forward KL with --top-k 64 (teacher's top 64 tokens + tail bucket)
  kd-ckpt          forward KL with activation checkpointing on the student
  kd-jsd           JSD, alpha 1
Printed: tokens/s, step time, peak allocated/reserved memory, and ratios against the baseline.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # copt from the repo root

TEACHER = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
               max_position_embeddings=131072, rms_norm_eps=1e-5, head_dim=64)
STUDENT = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=4096, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
               max_position_embeddings=131072, rms_norm_eps=1e-5, head_dim=64)
TRAINING_DEFAULTS = dict(precision="bf16", activation_checkpointing=False, attn="sdpa", micro_batch=8, grad_accum=1,
                         seq_len=1024, max_steps=100, epochs=None, lr=1e-4, min_lr_ratio=0.1, schedule="cosine",
                         warmup_steps=10, weight_decay=0.0, grad_clip=1.0, optimizer="adamw", zero=0, offload="none",
                         nvme_path=None, compile=False, gpus=1, nodes=1, hostfile=None, launcher="auto",
                         master_addr=None, master_port=None, save_every=None, resume=False, seed=0, log_every=1)


def options(**overrides):
    """copt's DistillRecipe when pydantic is there (validated), else a namespace with the same fields."""
    values = {**TRAINING_DEFAULTS, **overrides}
    try:
        from clusteropt_cli.recipe.schema.distill import DistillRecipe

        return DistillRecipe(mode="logits", teacher="bench-teacher", student="bench-student", **values)
    except ImportError:
        return SimpleNamespace(**values, loss_impl="auto", pipeline_stages=1, gradient_compression="none")


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def build(config: dict, dtype):
    """Random-weight Llama built directly on the device (fast init), in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device()):
        return LlamaForCausalLM(LlamaConfig(**config)).to(dtype)


def random_dataset(num_blocks: int, seq_len: int, vocab: int):
    import torch

    from clusteropt_cli.core.train.data import PackedDataset

    g = torch.Generator().manual_seed(0)
    return PackedDataset(torch.randint(0, vocab, (num_blocks, seq_len), generator=g))


def run_case(name: str, *, steps: int, alpha: float | None, loss: str = "forward-kl", temperature: float = 2.0,
             top_k: int | None = None, checkpointing: bool = False, micro_batch: int, seq_len: int,
             chunk_tokens: int | None = None) -> dict:
    import torch

    from clusteropt_cli.core.distill.logits import make_distill_loss_fn
    from clusteropt_cli.core.distill.losses import DistillLossConfig
    from clusteropt_cli.core.train import run_training

    free_memory()
    teacher = None
    loss_fn = None
    opts = options(max_steps=steps, micro_batch=micro_batch, seq_len=seq_len, activation_checkpointing=checkpointing,
                   **({} if alpha is None else dict(alpha=alpha, loss=loss, temperature=temperature, top_k=top_k)))
    if alpha is not None:
        teacher = build(TEACHER, torch.bfloat16).eval()
        loss_fn = make_distill_loss_fn(teacher, DistillLossConfig(loss, temperature, alpha, top_k),
                                       chunk_tokens=chunk_tokens)
    student = build(STUDENT, torch.float32)  # fp32 master weights (bf16 autocast in the loop)
    dataset = random_dataset(max(64, steps * micro_batch), seq_len, STUDENT["vocab_size"])
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = run_training(opts, student, dataset, out, loss_fn=loss_fn, save_final=False)
        wall = time.perf_counter() - started
    row = {
        "case": name, "steps": result.steps, "micro_batch": micro_batch, "seq_len": seq_len,
        "tokens_per_step": micro_batch * seq_len, "tokens_per_s": result.tokens_per_s,
        "step_time_s": result.step_time_s, "peak_mem_bytes": result.peak_mem_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes, "first_loss": result.first_loss,
        "final_loss": result.final_loss, "wall_s": wall, "engine": result.engine, "precision": result.precision,
        "loss": None if alpha is None else loss, "alpha": alpha, "temperature": None if alpha is None else temperature,
        "top_k": top_k, "activation_checkpointing": checkpointing,
        "kd_logits": None if alpha is None else
        ("full" if chunk_tokens == 0 else f"chunked ({chunk_tokens or 'auto'})"),
        "teacher_params": sum(p.numel() for p in teacher.parameters()) if teacher is not None else None,
        "student_params": sum(p.numel() for p in student.parameters()),
    }
    del teacher, student, loss_fn, result
    free_memory()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("distill.json"))
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip remaining cases after this many seconds")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the code path only")
    args = parser.parse_args()

    import torch
    import transformers

    if args.smoke:
        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=512, head_dim=16)
        TEACHER.update(small)
        STUDENT.update({**small, "num_hidden_layers": 1})
        TRAINING_DEFAULTS["precision"] = "fp32"
        args.micro_batch, args.seq_len = 2, 32
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke for a CPU check of the code path)")
    cases = [
        ("ce-baseline", dict(steps=100, alpha=None)),
        ("kd-forward-kl", dict(steps=300, alpha=0.5, loss="forward-kl", temperature=2.0)),
        ("kd-full-logits", dict(steps=100, alpha=0.5, loss="forward-kl", temperature=2.0, chunk_tokens=0)),
        ("kd-top64", dict(steps=100, alpha=0.5, loss="forward-kl", temperature=2.0, top_k=64)),
        ("kd-ckpt", dict(steps=100, alpha=0.5, loss="forward-kl", temperature=2.0, checkpointing=True)),
        ("kd-jsd", dict(steps=100, alpha=1.0, loss="jsd", temperature=1.0)),
    ]
    report = {
        "benchmark": "copt distill logits", "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "weights": "random (configs): throughput and memory only", "teacher": TEACHER, "student": STUDENT,
        "teacher_dtype": "bf16", "precision": "bf16 autocast, fp32 master weights, AdamW",
        "data": f"random token ids, micro-batch {args.micro_batch} x {args.seq_len}", "cases": [],
    }
    start = time.perf_counter()
    if args.smoke:
        # tiny logits stay below the automatic chunking threshold: force small chunks to run that path too
        cases = [(name, {"chunk_tokens": 16, **spec, "steps": 3}) for name, spec in cases]
    for name, spec in cases:
        if time.perf_counter() - start > args.budget_s:
            report["cases"].append({"case": name, "skipped": "time budget"})
            continue
        try:
            row = run_case(name, micro_batch=args.micro_batch, seq_len=args.seq_len, **spec)
        except Exception as exc:  # noqa: BLE001 - record and go on
            row = {"case": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            free_memory()
        report["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))

    base = next((c for c in report["cases"] if c["case"] == "ce-baseline" and c.get("tokens_per_s")), None)
    for c in report["cases"]:
        if base and c.get("tokens_per_s"):
            c["throughput_vs_ce"] = c["tokens_per_s"] / base["tokens_per_s"]
            c["peak_mem_vs_ce"] = c["peak_mem_bytes"] / base["peak_mem_bytes"]
    report["total_s"] = time.perf_counter() - start
    args.out.write_text(json.dumps(report, indent=2))
    gib = 2**30
    print(f"\n{'case':<16}{'steps':>6}{'tok/s':>10}{'step ms':>9}{'peak GiB':>10}{'resv GiB':>10}"
          f"{'x CE tok/s':>11}{'x CE mem':>9}")
    for c in report["cases"]:
        if not c.get("tokens_per_s"):
            print(f"{c['case']:<16}  {c.get('error') or c.get('skipped')}")
            continue
        print(f"{c['case']:<16}{c['steps']:>6}{c['tokens_per_s']:>10,.0f}{c['step_time_s'] * 1e3:>9.1f}"
              f"{c['peak_mem_bytes'] / gib:>10.1f}{(c['peak_reserved_bytes'] or 0) / gib:>10.1f}"
              f"{c.get('throughput_vs_ce', float('nan')):>11.2f}{c.get('peak_mem_vs_ce', float('nan')):>9.2f}")
    print(f"\nwrote {args.out} ({report['total_s']:.0f} s; random weights: throughput/memory only)")


if __name__ == "__main__":
    main()
