"""MoE and dense decode steps through copt serve's engine: CUDA graphs over copt's experts (dense below bf16,
transformers' grouped GEMM in bf16) against the engine without graphs, per dtype and batch; dense shapes of one width
over several layer counts separate a step's fixed cost from its cost per layer.

    python3 bench/gpu_moe_decode.py --out moe.json                   (qwen3moe-8l: 5 minutes on one H100)
    python3 bench/gpu_moe_decode.py --cpu-smoke --out /tmp/moe.json  (tiny shapes: checks the script)

Shapes, random weights, fewer layers than the real models (the step's cost per layer is what differs):
  qwen3moe-8l   Qwen3-30B-A3B's width: hidden 2,048, 128 experts of 768, top-8, 8 layers
  mixtral-4l    Mixtral-8x7B's width: hidden 4,096, 8 experts of 14,336, top-2, 4 layers
  mixtral-8l    the same over 8 layers (not run by default)
  qwen3moe-16l  Qwen3-30B-A3B's width on 16 layers, its 152k untied vocabulary (not run by default)
  llama8b-4l, llama8b-16l   Llama-3.1-8B's width (hidden 4,096, MLP 14,336, 128k vocabulary, untied) on 4 / 16
                layers (not run by default)
  llama1b-4l, llama1b-16l   Llama-3.2-1B's width (hidden 2,048, MLP 8,192, tied embeddings) on 4 / 16 layers
Each case: one engine (graphs on or off), `--batches` requests at once of `--prompt-len` prompt tokens (16; several,
comma-separated, one after another in the same engine) and `--new-tokens` new ones, greedy, ignore_eos; per batch
the median of three timed rounds after one warm-up round.
Reports ms per decode step (wall time of the round less its first token, over the new tokens), ms per decode pass of
the engine's steps after the last prompt token (its step trace: no prefill or mixed step; `decode_ms_per_pass`), with
`--kernels` the GPU time per decode step by part (attention, GEMMs, the rest: a profiled round less a profiled
one-token round), the graphs the engine captured, and next to each step with graphs (copt serve's default) the time
`copt advise` predicts for it (the shape's config on the catalog entry of this GPU, the case's dtype and prompt
length).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import host_probe_subprocess, log  # noqa: E402

SHAPES = {
    "qwen3moe-8l": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                           num_experts=128, num_experts_per_tok=8, num_hidden_layers=8,
                                           num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                           vocab_size=32000)),
    "mixtral-4l": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                         num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=32,
                                         num_key_value_heads=8, vocab_size=32000)),
}
# the same width over 8 layers: with the 4-layer shape, it separates a step's fixed cost from its cost per layer
SHAPES["mixtral-8l"] = (SHAPES["mixtral-4l"][0], dict(SHAPES["mixtral-4l"][1], num_hidden_layers=8))
# Qwen3-30B-A3B's width on 16 layers with its own 152k untied vocabulary: the model gpu_serve_models.py serves as
# qwen3moe16l, stepped in-process
SHAPES["qwen3moe-16l"] = (SHAPES["qwen3moe-8l"][0], dict(SHAPES["qwen3moe-8l"][1], num_hidden_layers=16,
                                                        vocab_size=151936, tie_word_embeddings=False))
for layers in (4, 16):
    SHAPES[f"llama8b-{layers}l"] = ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336,
                                                        num_hidden_layers=layers, num_attention_heads=32,
                                                        num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                                        tie_word_embeddings=False, rope_theta=500000.0))
    SHAPES[f"llama1b-{layers}l"] = ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192,
                                                        num_hidden_layers=layers, num_attention_heads=32,
                                                        num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                                        tie_word_embeddings=True, rope_theta=500000.0))
SMOKE = ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=512))


def build(path: Path, cls_name: str, fields: dict) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    # the Llama 3 models' context: --max-model-len may ask for any length up to it
    config = getattr(transformers, cls_name)(**fields, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2,
                                             pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                                         pad_token="t0").save_pretrained(path)


def case_prompts(batch: int, vocab: int, spread: bool, length: int = 16) -> list[list[int]]:
    """`batch` prompts of `length` token ids: ids 3-402 in a fixed pattern, or with `spread` ids drawn at random from
    the whole vocabulary (the "t<id>" words of gpu_serve_models.py's prompts lie across it)."""
    if not spread:
        return [[(7 * i + j) % 400 + 3 for j in range(length)] for i in range(batch)]
    rng = random.Random(batch)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


# sampling modes a case can step its batches with, (temperature, top_p); "greedy" fills per_batch, the others
# per_batch_<mode>
SAMPLING = {"greedy": (0.0, 1.0), "temperature": (1.0, 1.0), "top_p": (1.0, 0.95)}


# a kernel's part of a decode step, by name: the paged attention kernels, the GEMMs (cuBLAS/cuBLASLt's nvjet, CUTLASS
# and their split-K reductions), the rest (norms, rotary, activations, sampling, copies)
ATTENTION_KERNELS = ("paged_decode", "flash", "fmha", "attention")
GEMM_KERNELS = ("nvjet", "gemm", "cutlass", "splitkreduce", "xmma", "cublas", "sm90_", "sm80_")


def kernel_part(name: str) -> str:
    """"attention", "gemm" or "other" for a CUDA kernel's name."""
    lowered = name.lower()
    if any(k in lowered for k in ATTENTION_KERNELS):
        return "attention"
    if any(k in lowered for k in GEMM_KERNELS):
        return "gemm"
    return "other"


def decode_kernels(full: dict, first: dict, steps: int, top: int = 8) -> dict:
    """The kernels of `steps` decode steps: a profiled round of steps + 1 tokens (`full`, profile_summary with every
    name) less one of a single token (`first`: the same prefill and first token). Per step µs by part (attention, GEMM,
    other) and the largest kernels; GPU time is steady enough between rounds for the difference to hold, where the
    rounds' wall clock is not."""
    names = full.get("by_name", {})
    base = first.get("by_name", {})
    per_step = {name: (calls - base.get(name, [0, 0.0])[0], (us - base.get(name, [0, 0.0])[1]) / steps)
                for name, (calls, us) in names.items()}
    parts = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    for name, (_, us) in per_step.items():
        parts[kernel_part(name)] += us
    ranked = sorted(per_step.items(), key=lambda item: -item[1][1])[:top]
    return {**{f"{part}_us": round(us, 1) for part, us in parts.items()},
            "total_us": round(sum(parts.values()), 1),
            "top": [{"name": name[:120], "calls_per_step": round(calls / steps, 2), "us": round(us, 1),
                     "part": kernel_part(name)} for name, (calls, us) in ranked]}


def profile_summary(events: list, device: str, top: int = 12, every_name: bool = False) -> dict:
    """What a profiled round spent its device time on: on CUDA the kernels and copies (a replayed CUDA graph's
    kernels included), on a CPU the top-level ops. Per name the calls and total µs, largest first (`top` of them),
    and over the round the time they kept the device busy (their intervals merged) against its span: a busy share
    near 1 is a step bound by its kernels, well below 1 one that waits on the host. (A CPU run profiles the calling
    thread only, not the engine's: its smoke reads no events.)"""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    chosen = [e for e in events if e.device_type == kind and (kind == DeviceType.CUDA or e.cpu_parent is None)]
    if not chosen:
        return {"events": 0}
    by_name: dict[str, list[float]] = {}
    for event in chosen:
        entry = by_name.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in chosen)
    busy, (start, end) = 0.0, intervals[0]
    for lo, hi in intervals[1:]:
        if lo > end:
            busy, start, end = busy + end - start, lo, hi
        else:
            end = max(end, hi)
    busy += end - start
    span = max(hi for _, hi in intervals) - intervals[0][0]
    total = sum(t for _, t in by_name.values())
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    extra = {"by_name": by_name} if every_name else {}
    return {**extra, "events": len(chosen), "busy_ms": round(busy / 1e3, 3), "span_ms": round(span / 1e3, 3),
            "busy_share": round(busy / span, 3) if span > 0 else None,
            "top": [{"name": name[:120], "calls": int(calls), "total_us": round(us, 1),
                     "share": round(us / total, 3) if total else None} for name, (calls, us) in ranked]}


def decode_pass_seconds(steps: list[tuple], batch: int) -> float | None:
    """Seconds per decode pass of the engine steps (StepTrace records) after a round's last prompt token, while all
    `batch` rows run: the span of those steps over their passes (chained or not). Unlike the round's time less its
    first token, no prefill or mixed step enters it."""
    last_prompt = max((i for i, s in enumerate(steps) if s[6] > 0), default=-1)
    pure = [s for s in steps[last_prompt + 1:] if s[2] == batch and s[4] > 0]
    passes = sum(s[4] for s in pure)
    if passes < 2:
        return None
    return (pure[-1][1] - pure[0][0]) / passes


def traced_round(engine, batch: int, run, passes: list[float]) -> float:
    """run() with the engine recording its steps; appends the round's decode_pass_seconds to `passes`."""
    from clusteropt_cli.core.serve.engine import StepTrace

    engine._trace = StepTrace(tempfile.gettempdir())  # read here, never written
    try:
        seconds = run()
        steps = engine._trace.steps
    finally:
        engine._trace = None
    per_pass = decode_pass_seconds(steps, batch)
    if per_pass is not None:
        passes.append(per_pass)
    return seconds


def time_case(model_dir: Path, dtype: str, graphs: bool, batches: list[int], new_tokens: int, device: str,
              spread: bool = False, sampling: tuple[str, ...] = ("greedy",), kernels: bool = False,
              compile_mode: str = "auto", prompt_lens: tuple[int, ...] = (16,), max_model_len: int = 0,
              kv_cache_gib: float = 4.0) -> list[dict]:
    """One engine, stepped at each prompt length in turn: one result per length (the engine's start in each)."""
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    started = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), device=device, dtype=dtype, max_batch_size=max(batches),
                                 max_model_len=max_model_len or max(256, max(prompt_lens) + new_tokens),
                                 cuda_graphs=graphs, compile=graphs, kv_cache_memory_gib=kv_cache_gib,
                                 compile_mode=compile_mode))
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    results = []
    with engine:
        start = {"start_s": round(time.perf_counter() - started, 1),
                 "graphs_captured": engine.stats.graphs_captured, "moe_layers": engine.runner.moe_layers,
                 "graph_error": getattr(engine.runner, "graph_error", None),  # set only when capture failed
                 "compile_error": engine.runner.compile_error,
                 "prefill_graph_error": engine.runner.prefill_graph_error}
        for prompt_len in prompt_lens:
            log(f"  {prompt_len}-token prompts")
            result = {"dtype": dtype, "graphs": graphs, "spread_prompts": spread, "compile_mode": compile_mode,
                      "prompt_len": prompt_len, "max_model_len": engine.max_model_len, "per_batch": {},
                      **{f"per_batch_{mode}": {} for mode in sampling if mode != "greedy"}, **start}
            results.append(result)
            time_prompt_length(engine, result, batches, new_tokens, device, spread, sampling, kernels, prompt_len,
                               vocab)
    return results


def time_prompt_length(engine, result: dict, batches: list[int], new_tokens: int, device: str, spread: bool,
                 sampling: tuple[str, ...], kernels: bool, prompt_len: int, vocab: int) -> None:
    """Step the engine at each batch of `prompt_len`-token prompts; fills `result`'s per-batch figures."""
    import torch

    from clusteropt_cli.core.serve.engine import GenerationRequest

    dtype, graphs = result["dtype"], result["graphs"]
    for batch in batches:
        prompts = case_prompts(batch, vocab, spread, prompt_len)
        for mode in sampling:
            temperature, top_p = SAMPLING[mode]

            def one_round(n: int, prompts: list[list[int]] = prompts, temperature: float = temperature,
                          top_p: float = top_p) -> float:
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True,
                                                   temperature=temperature, top_p=top_p) for p in prompts])
                if device == "cuda":
                    torch.cuda.synchronize()
                return time.perf_counter() - t0

            one_round(new_tokens)
            first = statistics.median(one_round(1) for _ in range(3))
            passes = []
            full = statistics.median(traced_round(engine, batch, lambda: one_round(new_tokens), passes)
                                     for _ in range(3))
            step = {"ms_per_step": round((full - first) / (new_tokens - 1) * 1e3, 3),
                    "first_token_ms": round(first * 1e3, 2)}
            if passes:
                step["decode_ms_per_pass"] = round(statistics.median(passes) * 1e3, 3)
            result["per_batch" if mode == "greedy" else f"per_batch_{mode}"].setdefault(str(batch), step)
            log(f"  {dtype} graphs={graphs} {mode} batch {batch}: {step}")
            if kernels and mode == sampling[0]:  # one profiled round of new_tokens, the first mode's
                from torch.profiler import ProfilerActivity, profile

                activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
                with profile(activities=[activity]) as prof:
                    one_round(new_tokens)
                summary = profile_summary(prof.events(), device, every_name=True)
                with profile(activities=[activity]) as prof:
                    one_round(1)
                first_summary = profile_summary(prof.events(), device, every_name=True)
                if device == "cuda":
                    summary["decode_per_step"] = decode_kernels(summary, first_summary, new_tokens - 1)
                summary.pop("by_name", None)
                result.setdefault("kernels", {})[str(batch)] = summary
                parts = summary.get("decode_per_step", {})
                log(f"  kernels, batch {batch}: busy {summary.get('busy_ms')} of {summary.get('span_ms')} ms; "
                    + "; ".join(f"{k['name'][:60]} {k['share']}" for k in summary.get("top", [])[:4])
                    + (f"; per decode step µs: attention {parts['attention_us']}, GEMM {parts['gemm_us']}, other "
                       f"{parts['other_us']}" if parts else ""))


def advise_ms_per_step(config: dict, device_name: str, dtype: str, batch: int, new_tokens: int,
                       mode: str = "greedy", prompt_len: int = 16, compile_mode: str = "auto") -> float | None:
    """advise's time of one decode step for this case (`prompt_len` prompt tokens, the sampling `mode`'s temperature and
    top-p, the engine's `compile_mode`): its `decode_step_s`, the step alone, as the script measures it (the round less
    its first token), not the client's TPOT, which also carries a share of the other requests' prefill. None for a GPU
    outside its catalog."""
    from clusteropt_cli.core.advise.api import resolve_target
    from clusteropt_cli.core.advise.plan import InferPlan
    from clusteropt_cli.core.advise.timing import infer_time
    from clusteropt_cli.hardware import match_catalog
    from clusteropt_cli.modelspec import load_model_spec

    gpu = match_catalog(device_name)
    if gpu is None:
        return None
    target, _ = resolve_target(gpu.name)
    temperature, top_p = SAMPLING[mode]
    plan = InferPlan(batch=batch, prompt_len=prompt_len, gen_len=new_tokens, continuous_batching=True, dtype=dtype,
                     temperature=temperature, top_p=top_p, compile_mode=compile_mode)
    return round(infer_time(load_model_spec(config), plan, target).figures["decode_step_s"] * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3moe-8l,mixtral-4l")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--case-timeout", type=float, default=240)
    parser.add_argument("--graphs-only", action="store_true", help="skip the cases without CUDA graphs")
    parser.add_argument("--sampling", default="greedy", help="sampling modes each batch is stepped with, in one "
                        "engine: greedy, temperature (1.0) and top_p (temperature 1.0, top-p 0.95), comma-separated")
    parser.add_argument("--prompts", default="fixed", help="fixed (ids 3-402), spread (random ids over the "
                        "vocabulary) or both: one engine per kind")
    parser.add_argument("--kernels", action="store_true", help="also profile one round per batch (the first "
                        "--sampling mode): each kernel's calls and time, and how busy they kept the GPU")
    parser.add_argument("--compile-mode", default="auto", help="copt serve's --compile-mode for the decode layers "
                        "(auto: batch-1 steps autotuned; max-autotune-no-cudagraphs: every batch bucket)")
    parser.add_argument("--prompt-len", default="16", help="prompt tokens per request (a longer context adds the "
                        "KV cache's reads to each decode step); several, comma-separated, are stepped in turn by "
                        "one engine (with the paged kernel one set of decode graphs serves every length)")
    parser.add_argument("--max-model-len", type=int, default=0, help="the engine's context length (0: the prompt "
                        "and new tokens, at least 256); its decode graphs' context buckets follow it")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="the engine's KV cache (a batch of long "
                        "prompts needs more than the default 4 GiB to run at once)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if args.one:  # one case, in a process of its own: time_case's keyword arguments as JSON
        kwargs = json.loads(args.one)
        try:
            cases = time_case(**{**kwargs, "model_dir": Path(kwargs["model_dir"]),
                                 "sampling": tuple(kwargs["sampling"]), "prompt_lens": tuple(kwargs["prompt_lens"])})
        except Exception as exc:  # noqa: BLE001 - recorded by the parent
            traceback.print_exc()
            cases = [{"dtype": kwargs["dtype"], "graphs": kwargs["graphs"], "error": f"{type(exc).__name__}: {exc}"}]
        print(json.dumps(cases))
        return
    import clusteropt_cli.core.advise.api  # noqa: F401 - advise's side of every case: a missing package fails here

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (use --cpu-smoke to check the script)")
    batches = [int(b) for b in args.batches.split(",")]
    prompt_lens = [int(n) for n in str(args.prompt_len).split(",")]
    sampling = args.sampling.split(",")
    if unknown := set(sampling) - set(SAMPLING):
        parser.error(f"unknown --sampling {sorted(unknown)}: choose from {', '.join(SAMPLING)}")
    plan = {"smoke": SMOKE} if args.cpu_smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
    dtypes = ["fp32"] if args.cpu_smoke else args.dtypes.split(",")
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "torch": torch.__version__, "host": host_probe_subprocess(), "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for shape, (cls_name, fields) in plan.items():
            model_dir = Path(tmp) / shape
            build(model_dir, cls_name, fields)
            config = json.loads((model_dir / "config.json").read_text())
            out.setdefault("configs", {})[shape] = config
            for dtype in dtypes:
                for graphs, spread in itertools.product(
                        (False,) if device == "cpu" else (True,) if args.graphs_only else (True, False),
                        {"fixed": (False,), "spread": (True,), "both": (False, True)}[args.prompts]):
                    log(f"{shape} {dtype} graphs={graphs} spread prompts={spread}")
                    # each engine in a process of its own: one engine's compiled graphs and pool leave the next
                    # no room on the GPU
                    case_args = {"model_dir": str(model_dir), "dtype": dtype, "graphs": graphs, "batches": batches,
                                 "new_tokens": args.new_tokens, "device": device, "spread": spread,
                                 "sampling": sampling, "kernels": args.kernels, "compile_mode": args.compile_mode,
                                 "prompt_lens": prompt_lens, "max_model_len": args.max_model_len,
                                 "kv_cache_gib": args.kv_cache_gib}
                    one = [sys.executable, __file__, "--one", json.dumps(case_args), "--out", "-"]
                    try:
                        proc = subprocess.run(one, capture_output=True, text=True, timeout=args.case_timeout)
                    except subprocess.TimeoutExpired as exc:  # record it and go on with the next case
                        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
                        sys.stderr.write((stderr or "")[-4000:])
                        cases = [{"dtype": dtype, "graphs": graphs, "spread_prompts": spread,
                                  "error": f"timed out after {args.case_timeout:g} s"}]
                    else:
                        sys.stderr.write(proc.stderr[-4000:])
                        try:
                            cases = json.loads(proc.stdout.strip().splitlines()[-1])
                        except (ValueError, IndexError):
                            cases = [{"dtype": dtype, "graphs": graphs, "spread_prompts": spread,
                                      "error": f"exit {proc.returncode}"}]
                    for case in cases:
                        case["shape"] = shape
                        for mode in sampling if graphs else ():  # copt serve's way
                            key = "per_batch" if mode == "greedy" else f"per_batch_{mode}"
                            for batch, step in case.get(key, {}).items():
                                step["advise_ms_per_step"] = advise_ms_per_step(
                                    config, out["device"], dtype, int(batch), args.new_tokens, mode,
                                    case.get("prompt_len", prompt_lens[0]), args.compile_mode)
                        out["cases"].append(case)
                    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'shape':<13} {'dtype':<5} {'graphs':<6} {'sampling':<11} {'captured':>8} "
          + " ".join(f"{'b' + str(b) + ' ms':>9}" for b in batches) + "  (advise ÷ measured; * spread prompts)")
    for case in out["cases"]:
        for mode in sampling:
            steps = case.get("per_batch" if mode == "greedy" else f"per_batch_{mode}", {})
            cells = []
            for b in batches:
                step = steps.get(str(b), {})
                ratio = (f"{step['advise_ms_per_step'] / step['ms_per_step']:.2f}" if step.get("advise_ms_per_step")
                         and step.get("ms_per_step") else "-")
                per_pass = step.get("decode_ms_per_pass")
                cells.append(f"{step.get('ms_per_step', float('nan')):>9.3f} ({ratio})"
                             + (f" pass {per_pass:.3f} ({step['advise_ms_per_step'] / per_pass:.2f})"
                                if per_pass and step.get("advise_ms_per_step") else ""))
            label = case["shape"] + ("*" if case.get("spread_prompts") else "")
            if len(prompt_lens) > 1:
                label += f" p{case.get('prompt_len', '?')}"
            print(f"{label:<13} {case['dtype']:<5} "
                  f"{str(case['graphs']):<6} {mode:<11} {case.get('graphs_captured', '-')!s:>8} " + " ".join(cells)
                  + (f"  {case['error']}" if "error" in case else ""))

if __name__ == "__main__":
    main()
