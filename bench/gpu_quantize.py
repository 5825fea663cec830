"""copt quantize on the H200: wall time and size per method on a Llama-3.2-1B shape, FP8 matmuls, FP8 vs bf16 speed,
and (with trained weights) perplexity per method at 4 bits.

Run from the repo root (llm-compressor/compressed-tensors wheels on PYTHONPATH, see /work/shared/gpu/README.md):
    python3 bench/gpu_quantize.py --out $OUT/quantize.json [--only speed|quality] [--budget-s 280]
Parts (each case guarded; a case that would start after the time budget is recorded as skipped):
  speed:   1B shape, random bf16 weights → copt quantize fp8, rtn, gptq, awq, int8 (W4A16 g128 for the int4 ones):
           wall time, size on disk. Then the FP8 checkpoint: (a) loaded by transformers (compressed-tensors) and
           profiled — which kernels run; (b) its FP8 weights + per-channel scales driven through torch._scaled_mm
           (dynamic per-token activation scales, as vLLM runs it): kernel names, prefill and decode time vs bf16.
  quality: a small Llama trained here for ~60 s on Python stdlib text; every method at 4 bits g128, perplexity
           on held-out stdlib files, with RTN as the baseline.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=8192, rms_norm_eps=1e-5, head_dim=64)
SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1536, tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5)
TRAIN_FILES = ["argparse.py", "json/decoder.py", "json/encoder.py", "collections/__init__.py", "functools.py",
               "difflib.py", "dataclasses.py", "enum.py", "random.py", "tokenize.py", "typing.py", "inspect.py",
               "pathlib.py", "subprocess.py", "threading.py", "logging/__init__.py", "email/message.py",
               "http/client.py", "urllib/parse.py", "unittest/case.py", "ast.py", "pickle.py", "tarfile.py",
               "zipfile/__init__.py", "shutil.py", "os.py", "socket.py", "datetime.py", "decimal.py", "pydoc.py"]
EVAL_FILES = ["statistics.py", "shlex.py", "textwrap.py", "string.py"]
METHODS = ["fp8", "rtn", "gptq", "awq", "int8"]


def stdlib_text(files: list[str]) -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((lib / f).read_text(encoding="utf-8") for f in files if (lib / f).is_file())


def train_tokenizer(text: str, out: Path, vocab: int = 8192):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    fast.model_max_length = 8192
    fast.save_pretrained(out)
    return fast


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


def quantize_case(model_dir: Path, out: Path, method: str, calib: Path, **fields) -> dict:
    from clusteropt_cli.core.quantize import plan, run
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

    bits = 8 if method in ("fp8", "int8") else 4
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


def train_small(work: Path, tokenizer, text: str, seconds: float) -> tuple[Path, int, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    seq = 256
    blocks = ids[: len(ids) // seq * seq].view(-1, seq).cuda()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=0, pad_token_id=1, **SMALL)
    model = LlamaForCausalLM(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        batch = blocks[torch.randint(0, len(blocks), (32,), device="cuda")]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    out = work / "small-trained"
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model, opt
    free()
    return out, steps, loss.item()


def quality_part(results: dict, work: Path, tokenizer, train_text: str, eval_path: Path, deadline: float,
                 train_s: float) -> None:
    small, steps, loss = train_small(work, tokenizer, train_text, train_s)
    results["small_model"] = {**SMALL, "vocab_size": len(tokenizer), "train_steps": steps, "final_train_loss": loss,
                              "train_seconds": train_s}
    save(results)
    calib = write_calib(tokenizer, train_text, work / "calib_small.jsonl", n=64, seq_len=256)
    cases = results.setdefault("quality_4bit", {})
    for method in ["rtn", "gptq", "awq", "fp8", "int8"]:
        if time.perf_counter() > deadline - 15:
            cases[method] = {"skipped": "time budget"}
            continue
        try:
            cases[method] = quantize_case(small, work / f"small-{method}", method, calib, num_samples=64,
                                          seq_len=256, eval=str(eval_path), eval_tokens=65536)
        except Exception as exc:  # noqa: BLE001
            cases[method] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            free()
        save(results)
        keys = ("ppl_before", "ppl_after", "error", "skipped")
        print(f"  small {method}: {json.dumps({k: cases[method].get(k) for k in keys})}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="quantize.json")
    parser.add_argument("--only", choices=["speed", "quality"], default=None)
    parser.add_argument("--budget-s", type=float, default=280.0)
    parser.add_argument("--train-s", type=float, default=45.0)
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    SAVE_TO.append(Path(args.out))

    import torch

    results: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                     "torch": torch.__version__}
    try:
        from importlib.metadata import version

        results["versions"] = {d: version(d) for d in ("transformers", "llmcompressor", "compressed-tensors")}
    except Exception as exc:  # noqa: BLE001
        results["versions"] = str(exc)
    work = Path(tempfile.mkdtemp(prefix="copt-quant-bench-"))
    train_text, eval_text = stdlib_text(TRAIN_FILES), stdlib_text(EVAL_FILES)
    tokenizer = train_tokenizer(train_text, work / "tokenizer")
    eval_path = work / "eval.txt"
    eval_path.write_text(eval_text)
    parts = [args.only] if args.only else ["speed", "quality"]
    for part in parts:
        try:
            if part == "speed":
                # leave time for the quality part when both run
                speed_deadline = deadline - (args.train_s + 60 if "quality" in parts else 0)
                speed_part(results, work, tokenizer, train_text, speed_deadline)
            else:
                quality_part(results, work, tokenizer, train_text, eval_path, deadline, args.train_s)
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
    if "quality_4bit" in results:
        steps = results.get("small_model", {}).get("train_steps")
        print(f"Trained small model ({steps} steps), 4-bit g128 perplexity:")
        for method, r in results["quality_4bit"].items():
            if r.get("ppl_after") is not None:
                print(f"  {method:>6}: {r['ppl_before']:.3f} → {r['ppl_after']:.3f} ({r['ppl_increase']:+.3f})")
            else:
                print(f"  {method:>6}: {r.get('error') or r.get('skipped')}")


if __name__ == "__main__":
    main()
