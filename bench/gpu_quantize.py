"""copt quantize on the H200: wall time and size per method on a Llama-3.2-1B shape, FP8 matmuls, FP8 vs bf16 speed,
and (with trained weights) held-out perplexity per method at 4 and 3 bits.

Run from the repo root (with the quantize extra installed):
    python3 bench/gpu_quantize.py --out $OUT/quantize.json [--only speed|quality] [--budget-s 280] [--train-s 90]
    python3 bench/gpu_quantize.py --only quality --cpu-smoke --out /tmp/q_smoke.json   # CPU check, ~15 s
Parts (each case guarded; a case that would start after the time budget is recorded as skipped):
  speed:   1B shape, random bf16 weights → copt quantize fp8, rtn, gptq, awq, int8 (W4A16 g128 for the int4 ones):
           wall time, size on disk. Then the FP8 checkpoint: (a) loaded by transformers (compressed-tensors) and
           profiled — which kernels run; (b) its FP8 weights + per-channel scales driven through torch._scaled_mm
           (dynamic per-token activation scales, as vLLM runs it): kernel names, prefill and decode time vs bf16.
  quality: a small Llama (512 hidden, 8 layers, BPE 8192) trained here on all of the stdlib's .py sources (no test
           directories, no EVAL_FILES; ~3 M tokens; the BPE learns from a spread ~4 MB subset) for --train-s seconds
           or --max-epochs passes, whichever first: blocks in a seeded random order each pass, warmup + cosine lr,
           bf16 autocast; held-out perplexity (EVAL_FILES) every 10% of training and on the saved bf16 weights
           (results["small_model"]). Then copt quantize rtn, gptq, awq at W4 g128 and W3 g128, fp8 and int8, each
           scored on the held-out files before and after; results["quality_summary"] has the perplexity increase
           per method per width and whether GPTQ/AWQ beat RTN (the AWQ paper's ordering: RTN > GPTQ > AWQ).
  --quality-model medium --corpus python: the same with a ~150 M-parameter model trained on the stdlib and the
           installed packages' sources (~200 M characters, no held-out-named files, no exact duplicates), for the
           question whether AWQ's W4 advantage shows on a larger model than the 33.6 M one.
  --cpu-smoke runs the quality part on the CPU with tiny sizes (13 files, 0.6 M-param model, 3 s of training,
           rtn W4/W3 and gptq W4) to check the script end to end without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quality_model import (  # noqa: E402
    EVAL_FILES,
    MEDIUM,
    SMALL,
    TINY,
    QualitySetup,
    stdlib_corpus,
    stdlib_text,
    tokenize_docs,
    train_small,
    train_tokenizer,
    write_calib_ids,
)

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=8192, rms_norm_eps=1e-5, head_dim=64)
# calibration text of the speed part (the 1B shape has random weights; any code text will do)
SPEED_CALIB_FILES = ["argparse.py", "json/decoder.py", "json/encoder.py", "collections/__init__.py", "functools.py",
               "difflib.py", "dataclasses.py", "enum.py", "random.py", "tokenize.py", "typing.py", "inspect.py",
               "pathlib.py", "subprocess.py", "threading.py", "logging/__init__.py", "email/message.py",
               "http/client.py", "urllib/parse.py", "unittest/case.py", "ast.py", "pickle.py", "tarfile.py",
               "zipfile/__init__.py", "shutil.py", "os.py", "socket.py", "datetime.py", "decimal.py", "pydoc.py"]
METHODS = ["fp8", "rtn", "gptq", "awq", "int8"]
QUALITY_CASES = [("rtn", 4), ("gptq", 4), ("awq", 4), ("rtn", 3), ("gptq", 3), ("awq", 3), ("fp8", 8), ("int8", 8)]


def write_calib(tokenizer, text: str, path: Path, n: int, seq_len: int) -> Path:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    step = max(seq_len, (len(ids) - seq_len) // n)
    chunks = [ids[i : i + seq_len + 16] for i in range(0, len(ids) - seq_len, step)][:n]
    path.write_text("".join(json.dumps({"text": tokenizer.decode(c)}) + "\n" for c in chunks))
    return path


SAVE_TO: list[Path] = []


def save(results: dict) -> None:
    """Write the results so far (a run cut short still leaves its finished cases)."""
    if SAVE_TO:
        SAVE_TO[0].parent.mkdir(parents=True, exist_ok=True)
        SAVE_TO[0].write_text(json.dumps(results, indent=2, default=str))


def free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def quantize_case(model_dir: Path, out: Path, method: str, calib: Path, bits: int | None = None, **fields) -> dict:
    from clusteropt_cli.core.quantize import plan, run
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

    bits = bits or (8 if method in ("fp8", "int8") else 4)
    settings = QuantizeRecipe(model=str(model_dir), output=str(out), method=method, bits=bits, group_size=128,
                              calib=str(calib), **fields)
    report = run(plan(settings, overwrite=True))
    free()
    return {k: getattr(report, k) for k in ("method", "scheme", "backend_version", "size_before_bytes",
                                           "size_after_bytes", "compression_ratio", "quantize_time_s",
                                           "total_time_s", "calib_samples", "calib_tokens", "ppl_before",
                                           "ppl_after", "ppl_rtn", "ppl_increase", "ppl_rtn_increase",
                                           "sample_generation", "device", "warnings")}


# ---------------------------------------------------------------------------------------------------------------
# FP8: the checkpoint's e4m3 weights through torch._scaled_mm
# ---------------------------------------------------------------------------------------------------------------
def fp8_linear_class():
    import torch

    class Fp8Linear(torch.nn.Module):
        """W8A8 FP8: e4m3 weight with a per-output-channel scale; activations quantized per token on the fly."""

        def __init__(self, weight_fp8, weight_scale, bias=None):
            super().__init__()
            self.weight = torch.nn.Parameter(weight_fp8, requires_grad=False)  # [out, in] e4m3
            self.scale_b = torch.nn.Parameter(weight_scale.float().reshape(1, -1), requires_grad=False)  # [1, out]
            self.bias = bias

        def forward(self, x):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            amax = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
            scale_a = amax / 448.0
            xq = (x2.float() / scale_a).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=scale_a, scale_b=self.scale_b, out_dtype=x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], y.shape[-1])

    return Fp8Linear


def build_fp8_model(bf16_dir: Path, fp8_dir: Path):
    """The bf16 model with every quantized Linear replaced by Fp8Linear fed from the FP8 checkpoint's tensors."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    Fp8Linear = fp8_linear_class()
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map="cuda").eval()
    tensors = {}
    for file in sorted(fp8_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cuda") as f:
            for key in f.keys():
                if key.endswith(".weight_scale") or (key.endswith(".weight") and f.get_slice(key).get_dtype()
                                                     in ("F8_E4M3", "float8_e4m3fn")):
                    tensors[key] = f.get_tensor(key)
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and f"{name}.weight_scale" in tensors:
            w = tensors[f"{name}.weight"]
            assert w.dtype == torch.float8_e4m3fn, (name, w.dtype)
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, name.rsplit(".", 1)[1], Fp8Linear(w, tensors[f"{name}.weight_scale"], module.bias))
            replaced += 1
    free()
    return model, replaced


def kernel_names(fn) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {}
    for event in prof.key_averages():
        if event.device_type is not None and "CUDA" in str(event.device_type):
            names[event.key] = names.get(event.key, 0) + event.count
    return sorted(names, key=lambda k: -names[k])


def is_fp8_kernel(name: str) -> bool:
    low = name.lower()
    return any(tag in low for tag in ("fp8", "e4m3", "scaled_mm", "f8f8", "sm90_xmma_gemm_e4m3", "cutlass3x_sm90"))


def time_ms(fn, iters: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def speed(model, prompt_len: int, batch: int, new_tokens: int) -> dict:
    """Prefill (one forward over batch×prompt_len) and decode (per-step time of a cached greedy decode)."""
    import torch

    ids = torch.randint(10, 8000, (batch, prompt_len), device="cuda")
    with torch.no_grad():
        prefill = time_ms(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), iters=10)

        def decode():
            model.generate(input_ids=ids[:, :32], attention_mask=torch.ones_like(ids[:, :32]),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=1)

        total = time_ms(decode, iters=3)
        first = time_ms(lambda: model(input_ids=ids[:, :32], use_cache=True), iters=5)
    return {"batch": batch, "prompt_len": prompt_len, "prefill_ms": prefill,
            "prefill_tokens_per_s": batch * prompt_len / prefill * 1e3,
            "decode_ms_per_step": (total - first) / new_tokens,
            "decode_tokens_per_s": batch * new_tokens / max(total - first, 1e-9) * 1e3}


def linear_stack_ms(model, tokens: int) -> float:
    """Only the decoder's Linear layers (no attention, norms or Python of the HF loop), M=tokens rows."""
    import torch

    linears = [m for n, m in model.named_modules() if ".layers." in n and hasattr(m, "weight")
               and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Fp8Linear")]
    xs = {}
    for m in linears:
        k = m.weight.shape[1]
        xs.setdefault(k, torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16))

    def run():
        for m in linears:
            m(xs[m.weight.shape[1]])

    with torch.no_grad():
        return time_ms(run, iters=20)


def fp8_part(results: dict, bf16_dir: Path, fp8_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out: dict = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    results["fp8"] = out
    # (a) transformers + compressed-tensors, as a user loads it
    try:
        model = AutoModelForCausalLM.from_pretrained(fp8_dir, device_map="cuda").eval()
        q = model.model.layers[0].self_attn.q_proj
        out["hf_q_proj_module"] = type(q).__name__
        out["hf_q_proj_weight_dtype"] = str(getattr(q, "weight", torch.empty(0)).dtype)
        ids = torch.randint(10, 8000, (1, 512), device="cuda")
        with torch.no_grad():
            names = kernel_names(lambda m=model: m(input_ids=ids))
        out["hf_fp8_kernels"] = [n for n in names if is_fp8_kernel(n)][:8]
        out["hf_top_kernels"] = names[:8]
        out["hf_runs_fp8_matmuls"] = bool(out["hf_fp8_kernels"])
        out["hf_speed_b1"] = speed(model, 2048, 1, 32)
        del model
        free()
    except Exception as exc:  # noqa: BLE001
        out["hf_error"] = f"{type(exc).__name__}: {exc}"
        free()
    # (b) the checkpoint's FP8 tensors through torch._scaled_mm vs the bf16 model
    try:
        model, replaced = build_fp8_model(bf16_dir, fp8_dir)
        out["scaled_mm_linears"] = replaced
        ids = torch.randint(10, 8000, (1, 512), device="cuda")
        with torch.no_grad():
            names = kernel_names(lambda m=model: m(input_ids=ids))
        out["scaled_mm_fp8_kernels"] = [n for n in names if is_fp8_kernel(n)][:8]
        out["scaled_mm_runs_fp8_matmuls"] = bool(out["scaled_mm_fp8_kernels"])
        fp8_speed = [speed(model, 2048, b, 32) for b in (1, 16)]
        fp8_lin = {t: linear_stack_ms(model, t) for t in (1, 64, 4096)}
        del model
        free()
        bf16 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map="cuda").eval()
        bf16_speed = [speed(bf16, 2048, b, 32) for b in (1, 16)]
        bf16_lin = {t: linear_stack_ms(bf16, t) for t in (1, 64, 4096)}
        with torch.no_grad():
            ref = bf16(input_ids=ids).logits.float()
        del bf16
        free()
        model, _ = build_fp8_model(bf16_dir, fp8_dir)
        with torch.no_grad():
            got = model(input_ids=ids).logits.float()
        out["fp8_vs_bf16_logit_cosine"] = torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(),
                                                                                  dim=0).item()
        del model
        free()
        out["speed"] = []
        for f, b in zip(fp8_speed, bf16_speed, strict=True):
            out["speed"].append({"batch": f["batch"], "prompt_len": f["prompt_len"],
                                 "prefill_ms_bf16": b["prefill_ms"], "prefill_ms_fp8": f["prefill_ms"],
                                 "prefill_speedup": b["prefill_ms"] / f["prefill_ms"],
                                 "decode_ms_step_bf16": b["decode_ms_per_step"],
                                 "decode_ms_step_fp8": f["decode_ms_per_step"],
                                 "decode_speedup": b["decode_ms_per_step"] / f["decode_ms_per_step"]})
        out["linear_stack"] = [{"tokens": t, "bf16_ms": bf16_lin[t], "fp8_ms": fp8_lin[t],
                                "speedup": bf16_lin[t] / fp8_lin[t]} for t in fp8_lin]
    except Exception as exc:  # noqa: BLE001
        out["scaled_mm_error"] = f"{type(exc).__name__}: {exc}"
        out["scaled_mm_traceback"] = traceback.format_exc()[-2000:]
        free()


# ---------------------------------------------------------------------------------------------------------------
def speed_part(results: dict, work: Path, tokenizer, calib_text: str, deadline: float) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_1B, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    for p in model.parameters():  # matrices ~N(0, 0.02) like a trained model's; norms stay at 1
        if p.dim() == 2:
            p.data.normal_(0, 0.02)
    bf16_dir = work / "llama1b-bf16"
    model.save_pretrained(bf16_dir)
    tokenizer.save_pretrained(bf16_dir)
    del model
    free()
    results["llama_1b_build_s"] = time.perf_counter() - t0
    calib = write_calib(tokenizer, calib_text, work / "calib_1b.jsonl", n=16, seq_len=512)
    cases = results.setdefault("llama_1b", {})
    for method in METHODS:
        if time.perf_counter() > deadline - 40:
            cases[method] = {"skipped": "time budget"}
            continue
        try:
            cases[method] = quantize_case(bf16_dir, work / f"llama1b-{method}", method, calib, num_samples=16,
                                          seq_len=512)
        except Exception as exc:  # noqa: BLE001
            cases[method] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            free()
        save(results)
        keys = ("quantize_time_s", "size_after_bytes", "error", "skipped")
        print(f"  1B {method}: {json.dumps({k: cases[method].get(k) for k in keys})}", flush=True)
        if method == "fp8" and "error" not in cases[method]:
            fp8_part(results, bf16_dir, work / "llama1b-fp8")


# ---------------------------------------------------------------------------------------------------------------
# Quality: a small Llama trained here on the stdlib (held-out files excluded), then every method at W4 and W3
# ---------------------------------------------------------------------------------------------------------------
def gpu_setup(train_s: float, max_epochs: float) -> QualitySetup:
    return QualitySetup(device="cuda", model=SMALL, vocab=8192, corpus_chars=40_000_000, tokenizer_chars=4_000_000,
                        train_s=train_s, max_epochs=max_epochs, batch=32, seq=256, peak_lr=1e-3, warmup_steps=100,
                        eval_tokens=65536, curve_tokens=16384, curve_points=10, calib_samples=64,
                        cases=QUALITY_CASES)


def smoke_setup(train_s: float, max_epochs: float) -> QualitySetup:
    return QualitySetup(device="cpu", model=TINY, vocab=1024, corpus_chars=400_000, tokenizer_chars=150_000,
                        train_s=train_s, max_epochs=max_epochs, batch=8, seq=128, peak_lr=2e-3, warmup_steps=5,
                        eval_tokens=2048, curve_tokens=1024, curve_points=3, calib_samples=8,
                        cases=[("rtn", 4), ("gptq", 4), ("awq", 4), ("rtn", 3)])


def quality_part(results: dict, work: Path, setup: QualitySetup, deadline: float) -> None:
    t0 = time.perf_counter()
    names, docs = stdlib_corpus(setup.corpus_chars, with_packages=setup.corpus == "python")
    chars = sum(map(len, docs))
    subset = docs[:: max(1, math.ceil(chars / setup.tokenizer_chars))]
    tokenizer = train_tokenizer(subset, work / "tokenizer-quality", setup.vocab)
    ids = tokenize_docs(tokenizer, docs)
    eval_text = stdlib_text(EVAL_FILES)
    eval_path = work / "eval.txt"
    eval_path.write_text(eval_text)
    small_model = results["small_model"] = {
        **setup.model, "vocab_size": len(tokenizer), "device": setup.device, "corpus": setup.corpus,
        "corpus_files": len(names),
        "corpus_chars": chars, "corpus_tokens": len(ids), "tokenizer_train_chars": sum(map(len, subset)),
        "eval_files": EVAL_FILES, "max_epochs": setup.max_epochs, "train_s_budget": setup.train_s,
        "data_prep_s": time.perf_counter() - t0}
    print(f"  corpus: {len(names)} stdlib files, {chars / 1e6:.1f} M chars, {len(ids) / 1e6:.2f} M tokens "
          f"(vocab {len(tokenizer)}), prepared in {small_model['data_prep_s']:.0f} s", flush=True)
    save(results)
    small, info = train_small(work, tokenizer, ids, eval_text, setup)
    small_model.update(info)
    save(results)
    print(f"  small model: {info['train_steps']} steps, {info['tokens_seen'] / 1e6:.1f} M tokens "
          f"({info['epochs']:.2f} epochs, stopped by {info['stopped_by']}), train loss {info['final_train_loss']:.3f}, "
          f"held-out ppl {info['heldout_ppl']:.2f} (train-text ppl {info['train_text_ppl']:.2f})", flush=True)
    calib = write_calib_ids(tokenizer, ids, work / "calib_small.jsonl", n=setup.calib_samples, seq_len=setup.seq)
    cases = results.setdefault("quality", {})
    results["quality_settings"] = {"symmetric": setup.symmetric, "awq_duo_scaling": setup.awq_duo_scaling,
                                   "awq_also": [suffix for suffix, _ in setup.awq_also],
                                   "calib_samples": setup.calib_samples,
                                   "calib_seq_len": setup.seq, "group_size": 128}
    runs = []
    for method, bits in setup.cases:
        runs.append((f"w{bits}-{method}", method, bits, {}))
        if method == "awq":
            runs += [(f"w{bits}-awq[{suffix}]", method, bits, extra) for suffix, extra in setup.awq_also]
    for name, method, bits, extra in runs:
        if time.perf_counter() > deadline - 15:
            cases[name] = {"skipped": "time budget"}
            continue
        try:
            cases[name] = quantize_case(small, work / f"small-{name}", method, calib, bits=bits,
                                        num_samples=setup.calib_samples, seq_len=setup.seq, eval=str(eval_path),
                                        eval_tokens=setup.eval_tokens,
                                        **({} if setup.symmetric or bits == 8 else {"symmetric": False}),
                                        **({"awq_duo_scaling": setup.awq_duo_scaling} if method == "awq" else {})
                                        | extra)
        except Exception as exc:  # noqa: BLE001
            cases[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            free()
        results["quality_summary"] = quality_summary(cases)
        save(results)
        keys = ("ppl_before", "ppl_after", "quantize_time_s", "error", "skipped")
        print(f"  small {name}: {json.dumps({k: cases[name].get(k) for k in keys})}", flush=True)


def quality_summary(cases: dict) -> dict:
    """Perplexity increase per method per weight width, and whether AWQ/GPTQ beat RTN at each width (the AWQ
    paper's ordering is RTN > GPTQ > AWQ in increase)."""
    summary: dict = {}
    for bits in (4, 3, 8):
        row: dict = {}
        extra = sorted(k.split("-", 1)[1] for k in cases if k.startswith(f"w{bits}-awq["))
        for method in ("rtn", "gptq", "awq", *extra, "fp8", "int8"):
            r = cases.get(f"w{bits}-{method}", {})
            if r.get("ppl_after") is not None and r.get("ppl_before") is not None:
                increase = r["ppl_after"] - r["ppl_before"]
                row[method] = {"ppl_before": r["ppl_before"], "ppl_after": r["ppl_after"], "increase": increase,
                               "increase_pct": 100 * increase / r["ppl_before"]}
        if not row:
            continue
        if "rtn" in row:
            for method in ("gptq", "awq", *extra):
                if method in row:
                    row[f"{method}_beats_rtn"] = row[method]["increase"] < row["rtn"]["increase"]
        if all(m in row for m in ("rtn", "gptq", "awq")):
            row["awq_paper_ordering_holds"] = (row["rtn"]["increase"] > row["gptq"]["increase"]
                                               > row["awq"]["increase"])
        summary["w8a8" if bits == 8 else f"w{bits}g128"] = row
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="quantize.json")
    parser.add_argument("--only", choices=["speed", "quality"], default=None)
    parser.add_argument("--budget-s", type=float, default=280.0)
    parser.add_argument("--train-s", type=float, default=None,
                        help="training time of the quality part's small model (default 90; 3 with --cpu-smoke)")
    parser.add_argument("--max-epochs", type=float, default=4.0,
                        help="the small model's training also stops after this many passes over its corpus")
    parser.add_argument("--asymmetric", action="store_true",
                        help="quality part: integer weights with zero points (the AWQ paper's INT3/INT4 setting); "
                             "rtn, gptq and awq only")
    parser.add_argument("--calib-samples", type=int, default=None,
                        help="quality part: calibration samples of --seq tokens (default 64; 8 with --cpu-smoke)")
    parser.add_argument("--awq-duo-scaling", default="true",
                        help="quality part: AWQ's scale search (the recipe's awq_duo_scaling: true, false or both); "
                             "a comma list (false,true) also runs the others as extra awq[duo=…] cases")
    parser.add_argument("--awq-no-clip", action="store_true",
                        help="quality part: also run AWQ without the clipping search (awq[clip=false])")
    parser.add_argument("--awq-observers", default="",
                        help="quality part: extra AWQ cases with these weight observers (the recipe's observer: mse, "
                             "imatrix_mse), comma-separated")
    parser.add_argument("--bits", default="4,3,8",
                        help="quality part: weight widths to run (4 and 3: rtn/gptq/awq; 8: fp8/int8), comma-separated")
    parser.add_argument("--quality-model", choices=["small", "medium"], default="small",
                        help="quality part: the 33.6 M-parameter model (default) or a ~150 M one (MEDIUM)")
    parser.add_argument("--corpus", choices=["stdlib", "python"], default="stdlib",
                        help="quality part: train on the stdlib's sources, or on them and the installed packages'")
    parser.add_argument("--corpus-chars", type=int, default=None,
                        help="quality part: training text cap in characters (default 40 M; --corpus python: 200 M)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run only the quality part, on the CPU, with tiny sizes (checks the script end to end)")
    args = parser.parse_args()
    train_s = args.train_s if args.train_s is not None else (3.0 if args.cpu_smoke else 90.0)
    start = time.perf_counter()
    deadline = start + args.budget_s
    SAVE_TO.append(Path(args.out))

    import torch

    device_name = "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name()
    results: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": device_name, "torch": torch.__version__}
    try:
        from importlib.metadata import version

        results["versions"] = {d: version(d) for d in ("transformers", "llmcompressor", "compressed-tensors")}
    except Exception as exc:  # noqa: BLE001
        results["versions"] = str(exc)
    work = Path(tempfile.mkdtemp(prefix="copt-quant-bench-"))
    parts = ["quality"] if args.cpu_smoke else [args.only] if args.only else ["speed", "quality"]
    for part in parts:
        try:
            if part == "speed":
                calib_text = stdlib_text(SPEED_CALIB_FILES)
                tokenizer = train_tokenizer(calib_text.split("\n\n"), work / "tokenizer")
                # leave time for the quality part when both run (training + ~100 s of data and quantization)
                speed_deadline = deadline - (train_s + 100 if "quality" in parts else 0)
                speed_part(results, work, tokenizer, calib_text, speed_deadline)
            else:
                setup = (smoke_setup if args.cpu_smoke else gpu_setup)(train_s, args.max_epochs)
                if args.asymmetric:
                    setup.symmetric = False
                    setup.cases = [c for c in setup.cases if c[1] < 8]
                if args.calib_samples:
                    setup.calib_samples = args.calib_samples
                setup.corpus = args.corpus
                if args.corpus_chars or args.corpus == "python":
                    setup.corpus_chars = args.corpus_chars or (200_000_000 if not args.cpu_smoke else 1_000_000)
                if args.quality_model == "medium" and not args.cpu_smoke:
                    setup.model = MEDIUM
                widths = {int(b) for b in args.bits.split(",")}
                setup.cases = [c for c in setup.cases if c[1] in widths]
                duo = [{"true": True, "false": False, "both": "both"}[v] for v in args.awq_duo_scaling.split(",")]
                setup.awq_duo_scaling = duo[0]
                setup.awq_also = tuple((f"duo={str(v).lower()}", {"awq_duo_scaling": v}) for v in duo[1:]) + tuple(
                    (f"observer={o}", {"observer": o}) for o in args.awq_observers.split(",") if o) + (
                    (("clip=false", {"awq_clip": False}),) if args.awq_no_clip else ())
                quality_part(results, work, setup, deadline)
        except Exception as exc:  # noqa: BLE001
            results[f"{part}_error"] = f"{type(exc).__name__}: {exc}"
            results[f"{part}_traceback"] = traceback.format_exc()[-3000:]
            free()
    results["total_s"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print_table(results)


def print_table(results: dict) -> None:
    gib = 1024**3
    print(f"\ncopt quantize on {results.get('gpu')} ({results.get('date')}), total {results['total_s']:.0f} s")
    if "llama_1b" in results:
        print("Llama-3.2-1B shape (random weights)   method  quantize_s  size_GiB  ratio")
        for method, r in results["llama_1b"].items():
            if "quantize_time_s" in r:
                print(f"  {method:>6}  {r['quantize_time_s']:9.1f}  {r['size_after_bytes'] / gib:8.2f}  "
                      f"{r['compression_ratio']:5.2f}  (bf16 {r['size_before_bytes'] / gib:.2f} GiB)")
            else:
                print(f"  {method:>6}  {r.get('error') or r.get('skipped')}")
    fp8 = results.get("fp8", {})
    if fp8:
        print(f"FP8: transformers path runs fp8 kernels: {fp8.get('hf_runs_fp8_matmuls')} "
              f"({fp8.get('hf_q_proj_module')}); torch._scaled_mm path: {fp8.get('scaled_mm_runs_fp8_matmuls')} "
              f"{fp8.get('scaled_mm_fp8_kernels', [])[:1]}; logit cosine vs bf16 {fp8.get('fp8_vs_bf16_logit_cosine')}")
        for s in fp8.get("speed", []):
            print(f"  batch {s['batch']:>2} prefill {s['prompt_len']}: bf16 {s['prefill_ms_bf16']:.1f} ms, fp8 "
                  f"{s['prefill_ms_fp8']:.1f} ms (x{s['prefill_speedup']:.2f}); decode step bf16 "
                  f"{s['decode_ms_step_bf16']:.2f} ms, fp8 {s['decode_ms_step_fp8']:.2f} ms "
                  f"(x{s['decode_speedup']:.2f})")
        for s in fp8.get("linear_stack", []):
            print(f"  linear layers only, {s['tokens']:>4} tokens: bf16 {s['bf16_ms']:.2f} ms, "
                  f"fp8 {s['fp8_ms']:.2f} ms (x{s['speedup']:.2f})")
    if "quality" in results:
        m = results.get("small_model", {})
        if "heldout_ppl" in m:
            print(f"Llama ({m['params'] / 1e6:.1f} M params, corpus {m.get('corpus', 'stdlib')}) trained "
                  f"{m['train_seconds']:.0f} s: "
                  f"{m['train_steps']} steps, {m['tokens_seen'] / 1e6:.1f} M tokens = {m['epochs']:.2f} epochs of "
                  f"{m['corpus_tokens'] / 1e6:.2f} M; train loss {m['final_train_loss']:.3f}, held-out ppl "
                  f"{m['heldout_ppl']:.2f} ({m['heldout_tokens']} tokens; train-text ppl {m['train_text_ppl']:.2f})")
        print("  case                          ppl_before  ppl_after  increase      %   beats RTN")
        summary = results.get("quality_summary", {})
        for name, r in results["quality"].items():
            if r.get("ppl_after") is None:
                print(f"  {name:<28}  {r.get('error') or r.get('skipped')}")
                continue
            bits, method = name.split("-", 1)
            row = summary.get("w8a8" if bits == "w8" else f"{bits}g128", {})
            beats = row.get(f"{method}_beats_rtn")
            increase = r["ppl_after"] - r["ppl_before"]
            print(f"  {name:<28}  {r['ppl_before']:10.3f}  {r['ppl_after']:9.3f}  {increase:+8.3f}  "
                  f"{100 * increase / r['ppl_before']:+5.1f}%  {'' if beats is None else beats}")
        for width, row in summary.items():
            if "awq_paper_ordering_holds" in row:
                print(f"  {width}: AWQ paper ordering (increase RTN > GPTQ > AWQ) holds: "
                      f"{row['awq_paper_ordering_holds']}")

if __name__ == "__main__":
    main()
