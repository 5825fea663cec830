"""copt profile on the H200 (issue 6): the Llama-3.2-1B shape (random weights) in infer and train modes.

    python3 bench/gpu_profile.py --out $OUT/profile.json        # on the GPU machine, from the repo root (≤ 5 min)
    python3 bench/gpu_profile.py --cpu-smoke --out /tmp/p.json  # every code path on CPU with a tiny config

Runs the same core function as `copt profile model` (clusteropt_cli.core.profile.model.profile_model) for each case,
writes each ProfileReport next to --out (profile_<case>.json, schema copt.profile/1), one Chrome trace of a small
inference case, and a summary JSON with ratios measured in the same run:
  * train: the fused chunked loss (copt train's default) against the model's own HF loss (baseline), and activation
    checkpointing against none; compared with the plain-PyTorch baselines of docs/benchmarks.md#h200-baselines
    (46.6k tok/s / 73.8 GiB without, 38.2k / 42.5 GiB with checkpointing, HF loss, micro-batch 8 × 2048);
  * infer: batch 1 (decode against the bandwidth floor: weights bytes / 4.26 TB/s measured copy bandwidth) and
    batch 32 (output tokens/s ratio against batch 1).
Needs copt's dependencies (pydantic) installed.
Endpoint mode against copt serve is run separately (copt serve + copt profile endpoint).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1024**3
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
        "tie_word_embeddings": True}
# plain-PyTorch baselines on the H200 (docs/benchmarks.md#h200-baselines): the references the ratios are read against
README_TRAIN = {"no_ckpt": {"tokens_per_s": 46600, "peak_gib": 73.8}, "ckpt": {"tokens_per_s": 38200, "peak_gib": 42.5}}
COPY_BANDWIDTH = 4.26e12


def cases(smoke: bool, model: str) -> list[tuple[str, dict]]:
    if smoke:
        train = dict(mode="train", micro_batch=2, seq_len=64, warmup=1, repeats=2)
        infer = dict(mode="infer", prompt_len=32, gen_len=8, warmup=1, repeats=2)
    else:
        train = dict(mode="train", micro_batch=8, seq_len=2048, precision="bf16", warmup=2, repeats=5)
        infer = dict(mode="infer", prompt_len=512, gen_len=64, dtype="bf16", warmup=1, repeats=3)
    return [
        ("infer_b1", dict(model=model, batch=1, **infer)),
        ("infer_b32", dict(model=model, batch=32, **infer)),
        ("infer_b1_trace", dict(model=model, batch=1, **{**infer, "prompt_len": 128 if not smoke else 16,
                                                          "gen_len": 16 if not smoke else 4, "repeats": 1})),
        ("train_hf_loss", dict(model=model, loss_impl="hf", **train)),
        ("train_fused_loss", dict(model=model, loss_impl="fused", **train)),
        ("train_hf_loss_ckpt", dict(model=model, loss_impl="hf", activation_checkpointing=True, **train)),
        ("train_fused_loss_ckpt", dict(model=model, loss_impl="fused", activation_checkpointing=True, **train)),
    ]


def free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_case(name: str, kwargs: dict, out_dir: Path, smoke: bool) -> dict:
    from clusteropt_cli.core.profile.model import profile_model
    from clusteropt_cli.core.profile.settings import ModelProfileSettings

    if name.endswith("_trace"):
        kwargs = {**kwargs, "trace": out_dir / f"profile_trace_{name}.json"}
    settings = ModelProfileSettings(device="cpu" if smoke else "cuda", **kwargs)
    t0 = time.perf_counter()
    report = profile_model(settings, log=lambda msg: print(f"  [{name}] {msg}", flush=True))
    path = out_dir / f"profile_{name}.json"
    path.write_text(report.model_dump_json(indent=2) + "\n")
    return {"name": name, "ok": True, "wall_s": time.perf_counter() - t0, "report_file": path.name,
            "metrics": report.metrics, "verdict": report.verdict.model_dump(), "hardware": report.hardware.model_dump(),
            "top_ops": [op.model_dump() for op in report.top_ops[:5]]}


def ratios(results: dict[str, dict]) -> dict:
    """Ratios between cases of this run (baseline named first)."""
    out: dict[str, float | None] = {}

    def m(case: str, key: str):
        r = results.get(case)
        return r["metrics"].get(key) if r and r.get("ok") else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    out["fused_vs_hf_tokens_per_s"] = ratio(m("train_fused_loss", "tokens_per_s"), m("train_hf_loss", "tokens_per_s"))
    out["fused_vs_hf_peak"] = ratio(m("train_fused_loss", "peak_mem_bytes"), m("train_hf_loss", "peak_mem_bytes"))
    out["ckpt_vs_none_tokens_per_s"] = ratio(m("train_hf_loss_ckpt", "tokens_per_s"),
                                             m("train_hf_loss", "tokens_per_s"))
    out["ckpt_vs_none_peak"] = ratio(m("train_hf_loss_ckpt", "peak_mem_bytes"), m("train_hf_loss", "peak_mem_bytes"))
    out["hf_tokens_per_s_vs_readme"] = ratio(m("train_hf_loss", "tokens_per_s"),
                                             README_TRAIN["no_ckpt"]["tokens_per_s"])
    out["hf_peak_vs_readme"] = ratio(m("train_hf_loss", "peak_mem_bytes"), README_TRAIN["no_ckpt"]["peak_gib"] * GiB)
    out["hf_ckpt_tokens_per_s_vs_readme"] = ratio(m("train_hf_loss_ckpt", "tokens_per_s"),
                                                  README_TRAIN["ckpt"]["tokens_per_s"])
    out["hf_ckpt_peak_vs_readme"] = ratio(m("train_hf_loss_ckpt", "peak_mem_bytes"),
                                          README_TRAIN["ckpt"]["peak_gib"] * GiB)
    out["b32_vs_b1_output_tokens_per_s"] = ratio(m("infer_b32", "output_tokens_per_s"),
                                                 m("infer_b1", "output_tokens_per_s"))
    weights = m("infer_b1", "weights_bytes")
    tpot = m("infer_b1", "tpot_s")
    out["b1_tpot_vs_bandwidth_floor"] = ratio(tpot, weights / COPY_BANDWIDTH if weights else None)
    return out


def fmt(v, scale=1.0, digits=2, suffix=""):
    return "-" if v is None else f"{v * scale:.{digits}f}{suffix}"


def print_table(results: list[dict]) -> None:
    print(f"\n{'case':24} {'step/ttft':>10} {'tpot':>8} {'tok/s':>10} {'MFU':>6} {'MBU':>6} {'peak GiB':>9} "
          f"{'busy':>6}  verdict (symptoms)")
    for r in results:
        if not r.get("ok"):
            print(f"{r['name']:24} ERROR {r.get('error', '')[:90]}")
            continue
        m = r["metrics"]
        first = m.get("step_time_s") or m.get("ttft_s")
        print(f"{r['name']:24} {fmt(first, 1e3, 1, 'ms'):>10} {fmt(m.get('tpot_s'), 1e3, 2, 'ms'):>8} "
              f"{fmt(m.get('tokens_per_s'), 1, 0):>10} {fmt(m.get('mfu'), 100, 1):>6} {fmt(m.get('mbu'), 100, 1):>6} "
              f"{fmt(m.get('peak_mem_bytes'), 1 / GiB, 2):>9} {fmt(m.get('device_busy_frac'), 100, 0):>6}  "
              f"{r['verdict']['bottleneck']} ({', '.join(r['verdict']['symptoms'])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny config on CPU: check the script itself")
    parser.add_argument("--model", default="llama-3.2-1b", help="preset, config.json or model dir")
    args = parser.parse_args()
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.cpu_smoke:
        model = str(out_dir / "tiny_config.json")
        Path(model).write_text(json.dumps(TINY))
    results = []
    started = time.perf_counter()
    for name, kwargs in cases(args.cpu_smoke, model):
        if time.perf_counter() - started > 240:
            results.append({"name": name, "ok": False, "error": "skipped: time budget (240 s) spent"})
            continue
        print(f"== {name}", flush=True)
        try:
            results.append(run_case(name, kwargs, out_dir, args.cpu_smoke))
        except Exception as exc:  # noqa: BLE001 - record and go on
            traceback.print_exc()
            results.append({"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        free_memory()
    by_name = {r["name"]: r for r in results}
    summary = {"benchmark": "copt profile model (issue 6)", "date": datetime.now(UTC).isoformat(timespec="seconds"),
               "model": model, "smoke": args.cpu_smoke, "cases": results, "ratios": ratios(by_name),
               "references": {"readme_train": README_TRAIN, "copy_bandwidth": COPY_BANDWIDTH}}
    try:
        import torch

        summary["torch"] = torch.__version__
        summary["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print_table(results)
    print("\nratios (same run):")
    for key, value in summary["ratios"].items():
        print(f"  {key:34} {fmt(value, 1, 3)}")
    print(f"\nwrote {args.out} and {len(results)} profile_<case>.json")


if __name__ == "__main__":
    main()
