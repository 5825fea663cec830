#!/usr/bin/env python3
"""copt serve on real model sizes, same run: the 1B and 8B Llama shapes against transformers serve and a third-party
load tester, with copt advise's serve predictions next to every measured figure (random bf16 weights).

Run from the repo root (one H200, ~9 minutes; start with the wheel-install line of the GPU machine's notes, wheel
sets `serve guidellm`):
    python3 bench/gpu_serve_models.py --shapes 8b,1b --out $OUT/models.json
    python3 bench/gpu_serve_models.py --smoke --out /tmp/models.json          # any machine: tiny model, few minutes

Workload: prompts of 256 random word tokens (sent as text, so every server tokenizes the same 256 tokens), 128
output tokens, streaming /v1/completions; greedy (temperature 0) and sampled (temperature 1.0, top_p 0.95). N
streaming clients = N requests sent at once, from --client-procs load-generator processes.

Per shape, in --shapes order (cases run most important first; each starts only when --budget-s leaves it time):
  copt        `copt serve DIR` with copt's defaults (no tuning flags), start-up time to /health, then:
    b1          batch-1 decode ms/token of one streaming request (median of 3), greedy and sampled, against the
                weights-over-bandwidth floor (weight bytes / 4.26e12 B/s, the H200's measured device-copy ceiling)
    loads       64 and 256 streaming clients, greedy and sampled: output tok/s, TTFT and TPOT percentiles
    guidellm    guidellm 0.8 (`python3 -m guidellm run`, synthetic English prompts of 256 tokens, 128 output
                tokens, sampled: the server's default temperature) at 64 and 256 streams; its JSON report read by
                copt's own reader (clusteropt_cli/core/profile/external.py). 1B only unless --guidellm-shapes.
    profile     `copt profile endpoint` (copt's tester) at concurrency 1, 64, 256 (sampled as above, --duration-bounded
                levels), the command a user runs against the server
    (--tester-modes sampled,greedy runs guidellm and profile endpoint greedy too: temperature 0 in every request;
    --guidellm-loads 1,64,256 adds guidellm at batch 1; --guidellm-python runs guidellm from its own environment;
    --profile-rates 20,40 adds open-loop levels to the profile endpoint: Poisson arrivals at those requests/s,
    reported as r<rate>)
  tserve      `transformers serve DIR --continuous-batching` on the same directory with the same clients (it
                rejects ignore_eos: the tokens it actually returns are counted, and early stops recorded); each load
                is bounded by --tserve-window seconds, tokens streamed by then count
  engine      copt's Engine in-process with the same settings (copt serve's defaults, and --max-batch-size,
              --max-model-len, --max-batch-tokens, --kv-cache-memory when --copt-args gives them; 64 and 256
              requests at once): the ceiling; the comparison puts each client's tok/s over it (<client>_over_engine).
              advise is asked with the same --max-batch-size. E.g. the front end's configuration measured by a
              third-party tester: --shapes 1b --copt-args="--max-batch-size 256" --skip tserve
  advise      `copt advise -m DIR --task infer --batch N --prompt-len 256 --gen-len 128 --temperature T [--top-p P]
              --json` (the mode's sampling settings) for
              the detected GPU (N = 1, 64, 256): predicted TPOT, TTFT, output tok/s, each next to the measured
              figures with predicted ÷ measured
Order: for each shape, copt (b1, loads, guidellm, profile) then tserve; then advise; then the engines (1B first).
JSON is rewritten after every case (a timeout keeps what finished); a short table is printed last. The servers'
logs and the testers' reports are copied to <out stem>-logs/ next to --out after every case.

JSON (`--out`), per shape key "1b"/"8b" under each case; tok/s are output tokens per second at the clients:
  models.<shape>            weight_bytes, params, build_and_save_s, the config used (shape), tokenizer vocabulary
  copt.<shape>              startup_s (Popen → /health 200); processes (the server's split into API and engine
                            processes, from its log; the run stops before it starts without copt serve's speed
                            packages, launch.SPEED_PACKAGES); b1.{greedy,sampled}.ms_per_token (median), runs_ms,
                            ttft_s, x_floor (÷ b1.floor_ms = weight_bytes / 4.26e12 B/s); c<N>_<mode> per load:
                            output_tokens_per_s, wall_s, ttft_s/tpot_s percentiles (p50/p90/p99, seconds),
                            completed, errors, ended_early (fewer than 128 tokens), cut_at_window; exit_status
  tserve.<shape>            the same loads for transformers serve, plus first_request_s (its batching manager starts
                            on the first request) and first_request (16 tokens alone: ms/token), finish_reasons; a
                            load cut at --tserve-window counts the tokens streamed by then (cut_at_window requests)
  guidellm.<shape>.c<N>     guidellm's report read by copt: output_tokens_per_s, ttft_s, tpot_s (its inter-token
                            latency), e2e_s, completed/errors, the command and its exit status; each run has its
                            own --seed (guidellm's prompts follow it: one seed twice would repeat them);
                            ttft_first_round_s / ttft_later_rounds_s: TTFT percentiles of every stream's first
                            request (sent together) and of the later ones (sent as the stream's previous ended)
  profile_endpoint.<shape>  `copt profile endpoint` per level c1/c64/c256 (sampled): the same figures and how late
                            its client's event loop ran (client_loop_lag_s); r<rate> for --profile-rates (open loop,
                            `rate_command`)
  guidellm_greedy, profile_endpoint_greedy   the same, greedy (--tester-modes greedy)
  engine.<shape>.c<N>_<mode> the in-process engine's tok/s and TTFT percentiles; startup_s
  advise.<shape>.c<N>_<mode> copt advise's tpot_s, tpot_floor_s, ttft_s, output_tokens_per_s, the command
  comparison.<shape>        b1_<mode> and c<N>_<mode>: predicted_<figure>, <tester>_<figure> and
                            pred_over_<tester>_<figure> (predicted ÷ measured; testers copt_client, profile_endpoint,
                            guidellm, each greedy and sampled; their TPOT also against advise's
                            tpot_out_of_step_s: pred_out_of_step_over_<tester>_tpot_s); engine_output_tokens_per_s and
                            <tester>_over_engine (HTTP ÷ in-process, same settings)
  case_seconds, elapsed_s, errors: time per case, total, and any case that failed (with its traceback)
Every copt serve load (copt client, guidellm, profile endpoint) records prefix_cache_hit_rate: the prompt tokens the
server found in its prefix cache over those looked up during the load (its /metrics counters; 0 when no prompt
repeats an earlier one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import (  # noqa: E402
    COPY_BW,
    LLAMA_1B_SHAPE,
    LLAMA_3B_SHAPE,
    LLAMA_8B_SHAPE,
    LLAMA_70B_8L_SHAPE,
    QWEN3_MOE_16L_SHAPE,
    QWEN25_7B_SHAPE,
    free_gpu,
    free_port,
    host_probe_subprocess,
    log,
    percentiles,
    require_serve_speed_packages,
    wait_healthy,
)

from clusteropt_cli.core.advise.timing import uniform_distinct_experts  # noqa: E402
from clusteropt_cli.core.profile.endpoint import hit_rate  # noqa: E402

SMOKE_SHAPE = dict(LLAMA_1B_SHAPE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, vocab_size=8192, max_position_embeddings=2048,
                   bos_token_id=8189, eos_token_id=8190, pad_token_id=8191)
SHAPES = {"1b": LLAMA_1B_SHAPE, "3b": LLAMA_3B_SHAPE, "8b": LLAMA_8B_SHAPE, "70b8l": LLAMA_70B_8L_SHAPE,
          "qwen7b": QWEN25_7B_SHAPE, "qwen3moe16l": QWEN3_MOE_16L_SHAPE}
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "top_p": 0.95}}
CFG = {"prompt_len": 256, "out_tokens": 128, "loads": [64, 256], "b1_requests": 3}
CASES = ("copt", "b1", "loads", "guidellm", "profile", "tserve", "engine", "advise")
# numbers as words, so the unique prefix guidellm puts in front of each prompt gives distinct tokens
NUMBER_WORDS = 4096
FILLER_FROM = 6000  # token ids from here up are the words "t<id>": the benchmark's prompts use only these
PUNCTUATION = ".,;:!?'\"-()"  # words of the tokenizer after <unk>, before the number words


def filler_top(vocab: int) -> int:
    """The end of the "t<id>" ids the benchmark's prompts draw from (below the vocabulary's last ids)."""
    return min(vocab, 128000) - 10


class Budget:
    """Seconds left of --budget-s; a case starts only when at least its minimum is left."""

    def __init__(self, total: float):
        self.t0, self.total = time.perf_counter(), total

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.t0)

    def allows(self, need: float) -> bool:
        return self.left() >= need


# ---- the model directory ---------------------------------------------------------------------------------
def english_words() -> list[str]:
    """The words guidellm's synthetic prompts are made of (Faker's en_US lorem list, lower and capitalized);
    empty where Faker is not installed (then guidellm is not either)."""
    try:
        from faker.providers.lorem.en_US import Provider
    except ImportError:
        return []
    words = sorted({w for w in Provider.word_list if w.isalpha()})
    return words + [w.capitalize() for w in words if w.capitalize() not in words]


def make_tokenizer(path: Path, shape: dict) -> dict:
    """A word-level tokenizer over the whole vocabulary: specials at the config's ids, English words and numbers
    (so guidellm's synthetic text gives distinct prompts, not one unknown token repeated), punctuation, and the
    word "t<id>" for every other id (the benchmark's own prompts, and what the random model generates)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = shape["vocab_size"]
    specials = {shape["bos_token_id"]: "<|begin_of_text|>", shape["eos_token_id"]: "<|end_of_text|>",
                shape["pad_token_id"]: "<|pad|>"}
    known = ["<unk>"] + list(PUNCTUATION) + [str(i) for i in range(NUMBER_WORDS)] + english_words()
    known = known[:FILLER_FROM]
    vocab: dict[str, int] = {}
    for i in range(vocab_size):
        word = specials.get(i) or (known[i] if i < len(known) else f"t{i}")
        vocab.setdefault(word, i)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation apart, as English text needs
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=specials[shape["bos_token_id"]],
                                   eos_token=specials[shape["eos_token_id"]], pad_token=specials[shape["pad_token_id"]])
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return {"english_words": len(english_words()), "vocab": vocab_size}


def tokenizer_beside(model_dir: Path) -> Path:
    """The directory of a shape's tokenizer files alone, for an architecture whose transformers tokenizer class would
    rebuild the word-level tokenizer (Qwen2's: byte-level BPE pieces); no config.json there picks its class."""
    return model_dir.parent / f"{model_dir.name}-tokenizer"


def tokenizer_dir(model_dir: Path) -> Path:
    """Where the shape's tokenizer loads as written: beside the model directory when make_model_dir put it there."""
    beside = tokenizer_beside(model_dir)
    return beside if beside.is_dir() else model_dir


def make_model_dir(path: Path, shape: dict) -> dict:
    """Random-weight bf16 model of `shape` (a Llama unless it names its model_type), built on the GPU in bf16 (no fp32
    copy), saved as safetensors shards."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    fields = dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    build_s = time.perf_counter() - t0
    routing = routing_by_text(model, shape) if moe_experts(shape) else None
    model.save_pretrained(path, max_shard_size="5GB")
    del model
    free_gpu()
    tok = make_tokenizer(path, shape)
    if shape.get("model_type", "llama") != "llama":
        beside = tokenizer_beside(path)
        beside.mkdir(exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (path / name).exists():
                shutil.copy(path / name, beside / name)
    return {"weight_bytes": weight_bytes, "params": weight_bytes // 2, "build_s": round(build_s, 1),
            "build_and_save_s": round(time.perf_counter() - t0, 1), **tok,
            **({"routing": routing} if routing else {})}


def moe_experts(shape: dict) -> tuple[int, int] | None:
    """(experts, experts per token) of a mixture-of-experts shape; None for a dense one."""
    experts = shape.get("num_experts") or shape.get("num_local_experts")
    return (int(experts), int(shape["num_experts_per_tok"])) if experts else None


def routing_spread(model, shape: dict, rows: tuple[int, ...] = (1, 16, 64, 256), prompt_len: int = 64,  # noqa: ANN001
                   ids_from: int = FILLER_FROM, ids_to: int | None = None, decode_steps: int = 4) -> dict:
    """How the built model routes prompts of token ids in [ids_from, ids_to) (default: the benchmark's own "t<id>"
    words): per MoE layer, the distinct experts the last tokens of `rows` prompts pick next to uniform routing's
    E·(1 − (1 − k/E)^rows), and over all prompt tokens the busiest expert's load ÷ the mean (a prefill's
    imbalance); then `decode_steps` decode steps of every prompt at once, each token sampled at temperature 1 as
    the server's default does, and the distinct experts the first `rows` rows of each step pick (what a decode step
    of that many rows reads; mean over the layers and steps). advise prices MoE steps by uniform routing; a
    random-weight model need not route that way."""
    import torch

    experts, k = moe_experts(shape)
    count = max(rows)
    gen = torch.Generator().manual_seed(0)
    top = ids_to or filler_top(shape["vocab_size"])
    device = next(model.parameters()).device
    ids = torch.randint(ids_from, top, (count, prompt_len), generator=gen).to(device)

    def picked(layer, tokens: int):  # noqa: ANN001, ANN202
        return layer.float().view(count, tokens, -1)[..., :experts].topk(k, dim=-1).indices

    with torch.inference_mode():
        out = model(ids, output_router_logits=True, use_cache=decode_steps > 0)
        logits = getattr(out, "router_logits", None)
        if not logits:
            return {"skipped": "the model returned no router logits"}
        decode = {b: [] for b in rows}
        past, sample_gen = out.past_key_values, torch.Generator(device=device).manual_seed(0)
        next_logits = out.logits[:, -1].float()
        for _ in range(decode_steps):
            tokens = torch.multinomial(torch.softmax(next_logits, -1), 1, generator=sample_gen)
            step = model(tokens, past_key_values=past, use_cache=True, output_router_logits=True)
            past, next_logits = step.past_key_values, step.logits[:, -1].float()
            for layer in step.router_logits:
                chosen = picked(layer, 1)[:, 0]
                for b in rows:
                    decode[b].append(int(chosen[:b].unique().numel()))
    per_layer = []
    for layer in logits:
        picks = picked(layer, prompt_len)
        loads = torch.bincount(picks.flatten(), minlength=experts).float()
        per_layer.append({"distinct": {b: int(picks[:b, -1].unique().numel()) for b in rows},
                          "prefill_max_over_mean": round(float(loads.max() / loads.mean()), 2)})
    uniform = {b: round(uniform_distinct_experts(experts, k, b), 1) for b in rows}
    return {"rows": list(rows), "prompt_len": prompt_len, "token_ids": [ids_from, top], "uniform_distinct": uniform,
            "mean_distinct": {b: round(sum(x["distinct"][b] for x in per_layer) / len(per_layer), 1) for b in rows},
            **({"decode_steps": decode_steps,
                "decode_mean_distinct": {b: round(sum(v) / len(v), 1) for b, v in decode.items()}}
               if decode_steps else {}),
            "layers": per_layer}


def routing_by_text(model, shape: dict) -> dict:  # noqa: ANN001
    """routing_spread for the two kinds of prompt the script sends: its own "t<id>" words (copt's client, the
    profile endpoint) and the English words guidellm's synthetic text is made of (ids below FILLER_FROM, where
    make_tokenizer puts them)."""
    first_word = 1 + len(PUNCTUATION) + NUMBER_WORDS  # make_tokenizer's order: <unk>, punctuation, numbers
    words = min(FILLER_FROM, first_word + len(english_words()))
    out = {"t_words": routing_spread(model, shape)}
    if words > first_word + 100:
        out["english_words"] = routing_spread(model, shape, ids_from=first_word, ids_to=words)
    return out


def prompts_text(n: int, length: int, vocab: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    top = filler_top(vocab)
    return [" ".join(f"t{rng.randrange(FILLER_FROM, top)}" for _ in range(length)) for _ in range(n)]


class PromptStream:
    """A new prompt for every request a case sends (`take(n)`): each case (copt serve, transformers serve, the
    engine) starts its own stream at the same first prompt, and no request repeats an earlier one — a repeated
    prompt is served from the prefix cache (the runs after the first would skip their prefill, and sampled runs,
    measured after the greedy ones, looked faster)."""

    def __init__(self, vocab: int, length: int) -> None:
        self.vocab, self.length, self.sent = vocab, length, 0

    def take(self, n: int) -> list[str]:
        out = [prompts_text(1, self.length, self.vocab, seed=1_000_003 + i)[0] for i in range(self.sent, self.sent + n)]
        self.sent += n
        return out


# ---- streaming clients -----------------------------------------------------------------------------------
async def _stream_one(client, url: str, body: dict, rec: dict) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    rec.update(start=time.time(), times=[], words=0, usage=None, finish=None)
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj and not obj.get("choices"):
                rec["error"] = str(obj["error"])[:300]
                return
            if obj.get("usage"):
                rec["usage"] = obj["usage"].get("completion_tokens")
            for choice in obj.get("choices") or []:
                text = choice.get("text") or ""
                if text:
                    rec["times"].append(time.perf_counter() - t0)
                    rec["words"] += len(text.split())
                if choice.get("finish_reason"):
                    rec["finish"] = choice["finish_reason"]
    rec["latency"] = time.perf_counter() - t0
    rec["done"] = True


def _client_proc(url: str, bodies: list[dict], start_at: float, window: float) -> dict:
    """One load-generator process: its share of the clients, started at the same wall-clock time; whatever has not
    finished `window` seconds later is cancelled (the tokens it streamed by then still count)."""
    import httpx

    async def run() -> dict:
        n = len(bodies) + 8
        async with httpx.AsyncClient(timeout=httpx.Timeout(window + 60), limits=httpx.Limits(
                max_connections=n, max_keepalive_connections=n)) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            t0 = time.time()
            recs: list[dict] = [{} for _ in bodies]
            tasks = [asyncio.create_task(_stream_one(client, url, b, rec)) for b, rec in zip(bodies, recs, strict=True)]
            done, pending = await asyncio.wait(tasks, timeout=window)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            end = time.time()
            for task, rec in zip(tasks, recs, strict=True):
                if task in done and task.exception() is not None:
                    rec["error"] = f"{type(task.exception()).__name__}: {task.exception()}"[:300]
            return {"start": t0, "end": end, "recs": recs, "cut": len(pending)}

    return asyncio.run(run())


def request_tokens(rec: dict) -> int:
    """Output tokens of one request: the server's usage count, else the words it streamed (one word a token under
    the benchmark's word-level tokenizer)."""
    return rec["usage"] if rec.get("done") and rec.get("usage") is not None else rec.get("words", 0)


def tpot(rec: dict) -> float | None:
    """Seconds per output token after the first: (last − first text chunk) / (tokens − 1), tokens as the server
    counted them (a chunk may carry several)."""
    times, n = rec.get("times") or [], request_tokens(rec)
    return (times[-1] - times[0]) / (n - 1) if len(times) > 1 and n > 1 else None


def load_run(url: str, bodies: list[dict], procs: int, pool: ProcessPoolExecutor, window: float) -> dict:
    procs = max(1, min(procs, len(bodies)))
    shares = [bodies[i::procs] for i in range(procs)]
    start_at = time.time() + 1.0
    parts = list(pool.map(_client_proc, [url] * procs, shares, [start_at] * procs, [window] * procs))
    start, end = min(p["start"] for p in parts), max(p["end"] for p in parts)
    # the wall ends when the last request ends (or at the window's cut)
    last = max((r["start"] + r["latency"] for p in parts for r in p["recs"] if r.get("done")), default=end)
    cut = sum(p["cut"] for p in parts)
    wall = (end if cut else min(end, last)) - start
    recs = [r for p in parts for r in p["recs"]]
    tokens = sum(request_tokens(r) for r in recs)
    errors = [r["error"] for r in recs if r.get("error")]
    done = [r for r in recs if r.get("done")]
    short = [r for r in done if request_tokens(r) < bodies[0]["max_tokens"]]
    return {"requests": len(recs), "completed": len(done), "cut_at_window": cut, "errors": len(errors),
            "first_errors": errors[:3], "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": tokens / wall if wall > 0 else None,
            "ended_early": len(short), "finish_reasons": sorted({str(r.get("finish")) for r in done}),
            "ttft_s": percentiles([r["times"][0] for r in recs if r.get("times")]),
            "tpot_s": percentiles([tpot(r) for r in done if tpot(r) is not None])}


def bodies_for(model: str, prompts: list[str], mode: str, ignore_eos: bool, seeded: bool,
               max_tokens: int | None = None) -> list[dict]:
    out = []
    for i, p in enumerate(prompts):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens or CFG["out_tokens"], "stream": True,
                **MODES[mode]}
        if ignore_eos:
            body["ignore_eos"] = True
            body["stream_options"] = {"include_usage": True}
        if seeded and MODES[mode]["temperature"]:
            body["seed"] = 7 + i
        out.append(body)
    return out


def batch1(url: str, model: str, prompts: list[str], mode: str, ignore_eos: bool, timeout: float,
           max_tokens: int | None = None) -> dict:
    """One streaming request at a time: decode ms/token = (last − first token) / (tokens − 1), median."""
    import httpx

    async def run() -> list[dict]:
        recs = []
        async with httpx.AsyncClient(timeout=timeout) as client:
            for body in bodies_for(model, prompts, mode, ignore_eos, seeded=ignore_eos, max_tokens=max_tokens):
                rec: dict = {}
                try:  # `timeout` bounds the whole request, not only each read
                    await asyncio.wait_for(_stream_one(client, url, body, rec), timeout)
                except Exception as exc:  # noqa: BLE001 - recorded with the request
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                recs.append(rec)
        return recs

    recs = asyncio.run(run())
    done = [r for r in recs if r.get("done")]
    ms = sorted(1e3 * tpot(r) for r in done if tpot(r) is not None)
    ttft = sorted(r["times"][0] for r in done if r["times"])
    return {"ms_per_token": ms[len(ms) // 2] if ms else None, "runs_ms": [round(x, 3) for x in ms],
            "ttft_s": ttft[len(ttft) // 2] if ttft else None,
            "tokens": [request_tokens(r) for r in recs], "errors": [r["error"] for r in recs if r.get("error")]}


# ---- servers ---------------------------------------------------------------------------------------------
def _env() -> dict:
    """The servers' and testers' environment: the repo's copt importable; the model directories are local, so no
    Hugging Face Hub calls (an offline machine would wait on them) and no CLI update check."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
    return env


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log("starting: " + " ".join(cmd))
    handle = open(log_path, "w")  # noqa: SIM115 - closed by stop()
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    proc.log_handle = handle  # type: ignore[attr-defined]
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def tail(proc: subprocess.Popen, n: int = 3000) -> str:
    handle = proc.log_handle  # type: ignore[attr-defined]
    if not handle.closed:
        handle.flush()
    try:
        return Path(proc.log_path).read_text(errors="replace")[-n:]  # type: ignore[attr-defined]
    except OSError:
        return ""


def stop(proc: subprocess.Popen, grace: float = 60) -> object:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        status: object = proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        status = "killed"
    proc.log_handle.close()  # type: ignore[attr-defined]
    return status


def prefix_cache(url: str) -> tuple[float, float] | None:
    """The server's prefix-cache counters (prompt tokens looked up, found) from its /metrics, or None."""
    import httpx

    from clusteropt_cli.core.profile.endpoint import metrics_url, prefix_cache_counters

    try:
        response = httpx.get(metrics_url(url), timeout=5)
    except httpx.HTTPError:
        return None
    return prefix_cache_counters(response.text) if response.status_code == 200 else None


def run_loads(url: str, model: str, prompts: PromptStream, ignore_eos: bool, args, pool, window: float,
              budget: Budget, out: dict, save) -> None:  # noqa: ANN001
    for n in CFG["loads"]:
        for mode in MODES:
            key = f"c{n}_{mode}"
            if not budget.allows(min(window, 20) + 5):
                out[key] = {"skipped": "time budget"}
                continue
            try:
                before = prefix_cache(url)
                out[key] = load_run(url, bodies_for(model, prompts.take(n), mode, ignore_eos, seeded=ignore_eos),
                                    args.client_procs, pool, window)
                r = out[key]
                r["prefix_cache_hit_rate"] = hit_rate(before, prefix_cache(url))
                log(f"  {n} clients {mode}: {r['output_tokens_per_s'] or 0:,.0f} tok/s, TTFT p50 "
                    f"{r['ttft_s']['p50']}, completed {r['completed']}/{r['requests']}, errors {r['errors']}")
            except Exception as exc:  # noqa: BLE001 - recorded, the next load runs
                out[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            save()


def case_copt(shape: str, model_dir: Path, made: dict, prompts: PromptStream, args, skip: set, budget: Budget,
              results: dict, save, work: Path) -> None:  # noqa: ANN001
    out: dict = results.setdefault("copt", {}).setdefault(shape, {})
    flags = args.copt_args.split()
    if (tokenizer := tokenizer_dir(model_dir)) != model_dir:
        flags += ["--tokenizer", str(tokenizer)]
    out["command"] = f"copt serve {model_dir} --port P " + (" ".join(flags) if flags else " (copt's defaults)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = str(model_dir)
    proc = start([sys.executable, "-m", "clusteropt_cli", "serve", model, "--port", str(port), *flags],
                 work / f"copt-serve-{shape}.log")
    try:
        waited = wait_healthy(url, proc, timeout=min(args.startup_timeout, budget.left()), log_tail=tail)
        out["startup_s"] = round(waited, 1)
        out["processes"] = next((line.strip() for line in (work / f"copt-serve-{shape}.log").read_text(
            errors="replace").splitlines() if "API-server process" in line), "one process (HTTP and engine)")
        log(f"copt serve {shape}: healthy after {out['startup_s']} s; {out['processes']}")
        save()
        if "b1" not in skip:
            floor_ms = 1e3 * made["weight_bytes"] / COPY_BW
            b1: dict = {"floor_ms": round(floor_ms, 3), "weight_bytes": made["weight_bytes"]}
            batch1(url, model, prompts.take(1), "greedy", True, timeout=120, max_tokens=16)  # warm-up, not counted
            for mode in MODES:
                r = batch1(url, model, prompts.take(CFG["b1_requests"]), mode, True, timeout=120)
                r["x_floor"] = round(r["ms_per_token"] / floor_ms, 2) if r["ms_per_token"] else None
                b1[mode] = r
                log(f"  batch-1 {mode}: {r['ms_per_token']} ms/token (floor {floor_ms:.2f} ms)")
            out["b1"] = b1
            save()
        if "loads" not in skip:
            with ProcessPoolExecutor(args.client_procs, mp_context=multiprocessing.get_context("spawn")) as pool:
                load_run(url, bodies_for(model, prompts.take(16), "greedy", True, False), args.client_procs, pool,
                         60)  # warm-up (and the client processes' imports)
                run_loads(url, model, prompts, True, args, pool, args.load_window, budget, out, save)
        for mode in args.tester_modes:  # sampled first (the OpenAI default), then greedy when asked
            if "guidellm" not in skip and shape in args.guidellm_shapes:
                results.setdefault(tester_key("guidellm", mode), {})[shape] = case_guidellm(
                    url, model_dir, args, budget, work, shape, mode)
                save()
            if "profile" not in skip:
                results.setdefault(tester_key("profile_endpoint", mode), {})[shape] = case_profile(
                    url, model_dir, args, budget, work, shape, mode)
                save()
    finally:
        out["exit_status"] = stop(proc)
        if out["exit_status"] != 0:
            out["log_tail"] = tail(proc)
        save()


def tester_key(tester: str, mode: str) -> str:
    """Where a tester's results go: `guidellm` / `profile_endpoint` for sampled requests (the OpenAI default),
    `<tester>_greedy` for temperature 0."""
    return tester if mode == "sampled" else f"{tester}_{mode}"


def guidellm_seed(shape: str, streams: int, mode: str = "sampled") -> int:
    """guidellm's synthetic prompts follow its seed (42 unless given): two runs with one seed send the same prompts,
    and the second finds them in the server's prefix cache. Each run of this benchmark gets its own."""
    return 1000 * (list(SHAPES).index(shape) + 1 if shape in SHAPES else 9) + streams + (500 if mode != "sampled"
                                                                                         else 0)


def guidellm_rounds(data: dict, streams: int) -> dict:
    """TTFT percentiles of guidellm's first round (the first `streams` requests by start: every stream's first
    request, sent together) and of the later ones (each sent when its stream's previous request ended: once the
    streams fall out of step, arrivals spread over the round), from the per-request records of its report."""
    try:
        done = data["benchmarks"][0]["requests"]["successful"]
        rows = sorted((r["info"]["timings"]["request_start"], r["time_to_first_token_ms"] / 1e3) for r in done
                      if r.get("time_to_first_token_ms") is not None)
    except (KeyError, IndexError, TypeError):
        return {}
    if len(rows) <= streams:
        return {}
    first, later = rows[:streams], rows[streams:]
    return {"ttft_first_round_s": percentiles([t for _, t in first]),
            "ttft_later_rounds_s": percentiles([t for _, t in later]),
            "later_rounds_start_spread_s": round(later[-1][0] - later[0][0], 3)}


def case_guidellm(url: str, model_dir: Path, args, budget: Budget, work: Path, shape: str,  # noqa: ANN001
                  mode: str = "sampled") -> dict:
    """guidellm's concurrent profile at each of --guidellm-loads streams. Sampled: guidellm's own requests (no
    temperature: the server's default, 1.0); greedy: temperature 0 added to every request body."""
    import importlib.util

    python = args.guidellm_python or sys.executable
    if python == sys.executable and importlib.util.find_spec("guidellm") is None:
        return {"skipped": "not installed (python3 -m guidellm; or --guidellm-python PATH)"}
    from clusteropt_cli.core.profile.external import external_report

    out: dict = {"temperature": 0.0 if mode == "greedy" else None}
    body = ",extras.body.temperature=0" if mode == "greedy" else ""
    suffix = "" if mode == "sampled" else f"-{mode}"
    for n in args.guidellm_loads:
        key = f"c{n}"
        if not budget.allows(30):
            out[key] = {"skipped": "time budget"}
            continue
        report = work / f"guidellm-{shape}-c{n}{suffix}.json"
        cmd = [python, "-m", "guidellm", "run", "--backend",
               f"kind=openai_http,target={url},model={model_dir},request_format=/v1/completions{body}",
               "--profile", f"kind=concurrent,streams={n}", "--seed",
               f"kind=static,value={guidellm_seed(shape, n, mode)}",
               "--constraint",
               f"kind=max_requests,count={args.guidellm_requests_per_stream * n}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir(model_dir)}", "--data",
               f"kind=synthetic_text,prompt_tokens={CFG['prompt_len']},output_tokens={CFG['out_tokens']}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        log("running: " + " ".join(cmd))
        t0 = time.perf_counter()
        before = prefix_cache(url)
        try:
            done = subprocess.run(cmd, env=_env(), cwd=work, capture_output=True, text=True,
                                  timeout=min(args.guidellm_timeout, max(10.0, budget.left() - 5)))
        except subprocess.TimeoutExpired as exc:
            out[key] = {"error": f"timed out after {exc.timeout:.0f} s", "command": cmd}
            continue
        entry: dict = {"command": " ".join(cmd), "exit_status": done.returncode,
                       "wall_s": round(time.perf_counter() - t0, 1),
                       "prefix_cache_hit_rate": hit_rate(before, prefix_cache(url))}
        if done.returncode != 0 or not report.exists():
            entry["error"] = (done.stderr or done.stdout)[-3000:]
        else:
            try:
                data = json.loads(report.read_text())
                prof = external_report(data, "guidellm")
                lv = prof.levels[-1]
                entry.update(concurrency=lv.concurrency, requests=lv.requests, completed=lv.completed,
                             errors=lv.errors, duration_s=lv.duration_s, output_tokens_per_s=lv.output_tokens_per_s,
                             ttft_s=lv.ttft_s, tpot_s=lv.tpot_s, e2e_s=lv.e2e_s, workload=prof.workload,
                             **guidellm_rounds(data, n))
                log(f"  guidellm {n} streams, {mode}: {lv.output_tokens_per_s:,.0f} tok/s, "
                    f"TTFT p50 {lv.ttft_s.get('p50')}")
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"report not read: {type(exc).__name__}: {exc}"
            entry["report_file"] = report.name
            try:
                entry["report"] = json.loads(report.read_text()) if args.keep_reports else None
            except ValueError:
                pass
        out[key] = entry
    return out


def case_profile(url: str, model_dir: Path, args, budget: Budget, work: Path, shape: str,  # noqa: ANN001
                 mode: str = "sampled") -> dict:
    """`copt profile endpoint` against the running server with the copt client's settings for `mode` (sampled:
    temperature 1.0, top_p 0.95; greedy: temperature 0), levels bounded in time: the concurrency sweep, then (with
    --profile-rates) the open-loop rates in a second command (the profile endpoint takes one or the other)."""
    suffix = "" if mode == "sampled" else f"-{mode}"
    sampling = ["--temperature", str(MODES[mode]["temperature"])]
    if "top_p" in MODES[mode]:
        sampling += ["--top-p", str(MODES[mode]["top_p"])]
    out: dict = {"temperature": MODES[mode]["temperature"]}
    sweeps = [("command", "--concurrency", ",".join(str(c) for c in args.profile_levels), len(args.profile_levels),
               work / f"profile-endpoint-{shape}{suffix}.json")] if args.profile_levels else []
    if args.profile_rates:
        sweeps.append(("rate_command", "--rate", ",".join(f"{r:g}" for r in args.profile_rates),
                       len(args.profile_rates), work / f"profile-endpoint-{shape}{suffix}-rates.json"))
    for key, flag, values, count, report in sweeps:
        if not budget.allows(15):
            out.setdefault("skipped", "time budget")
            break
        cmd = [sys.executable, "-m", "clusteropt_cli", "profile", "endpoint", "--url", url, "--model",
               str(model_dir), flag, values, "--duration", str(args.profile_duration), "--prompt-len",
               str(CFG["prompt_len"]), "--gen-len", str(CFG["out_tokens"]), *sampling, "--tokenizer",
               str(tokenizer_dir(model_dir)),
               "--report", str(report), "--save-requests", str(report.with_suffix(".requests.jsonl")), "--overwrite"]
        log("running: " + " ".join(cmd))
        out[key] = " ".join(cmd)
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True,
                                  timeout=max(10.0, min(args.profile_duration * count + 120, budget.left() - 5)))
        except subprocess.TimeoutExpired as exc:
            out["error"] = f"{flag}: timed out after {exc.timeout:.0f} s"
            continue
        out["exit_status"] = max(out.get("exit_status", 0), done.returncode)
        out["wall_s"] = round(out.get("wall_s", 0.0) + time.perf_counter() - t0, 1)
        if not report.exists():
            out["error"] = (done.stderr or done.stdout)[-3000:]
            continue
        data = json.loads(report.read_text())
        for lv in data.get("levels", []):
            name = f"c{lv['concurrency']}" if lv.get("concurrency") is not None else f"r{lv.get('rate'):g}"
            out[name] = {k: lv.get(k) for k in ("requests", "completed", "errors", "duration_s",
                                                "output_tokens_per_s", "ttft_s", "tpot_s", "prefix_cache_hit_rate",
                                                "send_lag_s", "client_loop_lag_s")}
            lag = (lv.get("client_loop_lag_s") or {}).get("p90")
            if lag is not None:
                log(f"  profile endpoint {name} {mode}: {lv.get('output_tokens_per_s') or 0:,.0f} tok/s, TTFT p50 "
                    f"{(lv.get('ttft_s') or {}).get('p50')}, the client's event loop {lag * 1e3:.1f} ms late (p90)")
        out.setdefault("length_control", (data.get("workload") or {}).get("output_length_control"))
    return out


def case_tserve(shape: str, model_dir: Path, prompts: PromptStream, args, budget: Budget, results: dict, save,
                work: Path) -> None:  # noqa: ANN001
    import importlib.util

    out: dict = results.setdefault("tserve", {}).setdefault(shape, {})
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        out["skipped"] = f"not installed: {', '.join(missing)} (transformers serve needs them)"
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = str(model_dir)
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", model, "--continuous-batching",
           "--host", "127.0.0.1", "--port", str(port), *args.tserve_args.split()]
    out["command"] = "transformers serve " + " ".join(cmd[4:])
    proc = start(cmd, work / f"transformers-serve-{shape}.log")
    try:
        waited = wait_healthy(url, proc, timeout=min(args.startup_timeout, budget.left()), log_tail=tail)
        out["startup_s"] = round(waited, 1)
        log(f"transformers serve {shape}: healthy after {out['startup_s']} s")
        save()
        # the model loads at start (it is pinned); the first request also builds the continuous-batching manager
        # (seen once on a CPU: the first stream closed early; retried, at most 3 tries)
        t0 = time.perf_counter()
        failures: list[str] = []
        first: dict = {"errors": ["not sent"]}
        for _ in range(3):
            if failures and not budget.allows(60):
                break
            try:
                first = batch1(url, model, prompts.take(1), "greedy", False, timeout=max(30.0, min(180, budget.left())),
                               max_tokens=16)
                if not first["errors"]:
                    break
                failures.append(first["errors"][0])
            except Exception as exc:  # noqa: BLE001 - retried
                failures.append(f"{type(exc).__name__}: {exc}")
            if proc.poll() is not None:
                break
        out["first_request_s"] = round(time.perf_counter() - t0, 1)
        if failures:
            out["first_request_failures"] = failures
        if first.get("errors") or proc.poll() is not None:
            out["error"] = f"first request: {failures[-1] if failures else 'server exited'}"
            return
        out["first_request"] = first  # 16 tokens, greedy, alone: a rough batch-1 figure
        log(f"  transformers serve first request: {out['first_request_s']} s, {first['ms_per_token']} ms/token")
        save()
        with ProcessPoolExecutor(args.client_procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            run_loads(url, model, prompts, False, args, pool, args.tserve_window, budget, out, save)
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    finally:
        out["exit_status"] = stop(proc, grace=20)
        if out["exit_status"] not in (0, -signal.SIGTERM):  # uvicorn under transformers exits by the signal
            out["log_tail"] = tail(proc)
        save()


# the copt serve flags (--copt-args) the in-process engine and advise follow too, as ServeRecipe fields
SHARED_FLAGS = {"--max-batch-size": ("max_batch_size", int), "--max-model-len": ("max_model_len", int),
                "--max-batch-tokens": ("max_batch_tokens", int), "--kv-cache-memory": ("kv_cache_memory", float)}


def shared_settings(copt_args: str) -> dict:
    """The SHARED_FLAGS among --copt-args (`--flag value` or `--flag=value`) as ServeRecipe fields."""
    out, words = {}, copt_args.split()
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        if flag in SHARED_FLAGS and (value or i + 1 < len(words)):
            name, kind = SHARED_FLAGS[flag]
            out[name] = kind(value or words[i + 1])
    return out


def case_engine(shape: str, model_dir: Path, prompts: PromptStream, budget: Budget, results: dict, save,
                settings: dict | None = None) -> None:
    """copt's Engine in-process, built from the same ServeRecipe as `copt serve DIR` (with the --copt-args flags
    of SHARED_FLAGS)."""
    from transformers import AutoTokenizer

    from clusteropt_cli.core.serve.engine import Engine, GenerationRequest
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    out: dict = results.setdefault("engine", {}).setdefault(shape, {})
    tok = AutoTokenizer.from_pretrained(model_dir)
    def ids(n: int) -> list[list[int]]:
        return [tok(p, add_special_tokens=False)["input_ids"] for p in prompts.take(n)]

    out["prompt_tokens"] = sorted({len(x) for x in ids(8)})
    t0 = time.perf_counter()
    engine = Engine.from_settings(ServeRecipe(model=str(model_dir), **(settings or {})))
    engine.start()
    out["startup_s"] = round(time.perf_counter() - t0, 1)
    out["settings"] = settings or {}
    try:
        engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=8, ignore_eos=True) for p in ids(16)])
        for n in CFG["loads"]:
            for mode, params in MODES.items():
                if not budget.allows(10):
                    out[f"c{n}_{mode}"] = {"skipped": "time budget"}
                    continue
                seeded = bool(params.get("temperature"))
                reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=CFG["out_tokens"], ignore_eos=True, **params,
                                          **({"seed": 7 + i} if seeded else {})) for i, p in enumerate(ids(n))]
                t = time.perf_counter()
                res = engine.generate(reqs)
                wall = time.perf_counter() - t
                tokens = sum(x.num_output_tokens for x in res)
                out[f"c{n}_{mode}"] = {"output_tokens": tokens, "wall_s": round(wall, 3),
                                       "output_tokens_per_s": tokens / wall,
                                       "ttft_s": percentiles([x.ttft_s for x in res if x.ttft_s is not None])}
                log(f"  engine {shape} {n} requests {mode}: {tokens / wall:,.0f} tok/s")
                save()
    finally:
        engine.stop()
        del engine
        free_gpu()


def advise_predictions(model_dir: Path, gpu_flag: list[str], settings: dict | None = None) -> dict:
    """`copt advise --task infer --json` for batch 1, 64 and 256, greedy and sampled (6 at a time), with the
    server's --max-batch-size when --copt-args sets it."""
    extra = ["--max-batch-size", str(settings["max_batch_size"])] if (settings or {}).get("max_batch_size") else []

    def one(batch: int, mode: str) -> tuple[str, dict]:
        cmd = [sys.executable, "-m", "clusteropt_cli", "advise", "-m", str(model_dir), "--task", "infer", "--batch",
               str(batch), "--prompt-len", str(CFG["prompt_len"]), "--gen-len", str(CFG["out_tokens"]), *extra,
               "--temperature", str(MODES[mode]["temperature"]),
               *(["--top-p", str(MODES[mode]["top_p"])] if "top_p" in MODES[mode] else []), "--json", *gpu_flag]
        done = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
        key = f"c{batch}_{mode}"
        if done.returncode != 0:
            return key, {"error": done.stderr[-2000:], "command": " ".join(cmd[2:])}
        data = json.loads(done.stdout)
        t = data.get("time") or {}
        return key, {"command": "copt " + " ".join(cmd[3:]), "gpu": (data.get("hardware") or {}).get("gpu"),
                     **{k: t.get(k) for k in ("tpot_s", "tpot_out_of_step_s", "tpot_floor_s", "ttft_s",
                                              "output_tokens_per_s", "max_concurrent_seqs")},
                     "max_batch_size": (data.get("workload") or {}).get("max_batch_size")}

    jobs = [(b, m) for b in [1, *CFG["loads"]] for m in MODES]
    with ThreadPoolExecutor(6) as ex:
        return dict(ex.map(lambda job: one(*job), jobs))


def ratio(pred: float | None, meas: float | None) -> float | None:
    return round(pred / meas, 3) if pred and meas else None


def comparisons(results: dict, shape: str) -> dict:
    """advise's prediction ÷ each measurement of the same figure (1.00 = exact; the issue's bar: 0.85–1.15)."""
    adv = (results.get("advise") or {}).get(shape) or {}
    copt = (results.get("copt") or {}).get(shape) or {}
    eng = (results.get("engine") or {}).get(shape) or {}
    rows = {}
    for mode in MODES:
        prof = (results.get(tester_key("profile_endpoint", mode)) or {}).get(shape) or {}
        gl = (results.get(tester_key("guidellm", mode)) or {}).get(shape) or {}
        p = adv.get(f"c1_{mode}") or {}
        m = ((copt.get("b1") or {}).get(mode) or {})
        row = {"predicted_tpot_ms": p.get("tpot_s") and 1e3 * p["tpot_s"], "copt_client_tpot_ms": m.get("ms_per_token")}
        row["pred_over_copt_client"] = ratio(row["predicted_tpot_ms"], row["copt_client_tpot_ms"])
        row["predicted_ttft_s"], row["copt_client_ttft_s"] = p.get("ttft_s"), m.get("ttft_s")
        row["pred_over_copt_client_ttft_s"] = ratio(p.get("ttft_s"), m.get("ttft_s"))
        for name, src in (("profile_endpoint", prof), ("guidellm", gl)):
            one = src.get("c1") or {}
            tpot, ttft = (one.get("tpot_s") or {}).get("p50"), (one.get("ttft_s") or {}).get("p50")
            if tpot:
                row[f"{name}_tpot_ms"] = 1e3 * tpot
                row[f"pred_over_{name}"] = ratio(row["predicted_tpot_ms"], row[f"{name}_tpot_ms"])
            if ttft:
                row[f"{name}_ttft_s"] = ttft
                row[f"pred_over_{name}_ttft_s"] = ratio(p.get("ttft_s"), ttft)
        rows[f"b1_{mode}"] = row
        for n in CFG["loads"]:
            p = adv.get(f"c{n}_{mode}") or {}
            m = copt.get(f"c{n}_{mode}") or {}
            row = {}
            for fig, mkey in (("output_tokens_per_s", None), ("ttft_s", "p50"), ("tpot_s", "p50")):
                meas = m.get(fig) if mkey is None else (m.get(fig) or {}).get(mkey)
                row[f"predicted_{fig}"] = p.get(fig)
                row[f"copt_client_{fig}"] = meas
                row[f"pred_over_copt_client_{fig}"] = ratio(p.get(fig), meas)
                for name, src in (("profile_endpoint", prof), ("guidellm", gl)):
                    lv = src.get(f"c{n}") or {}
                    val = lv.get(fig) if mkey is None else (lv.get(fig) or {}).get(mkey)
                    if val:
                        row[f"{name}_{fig}"] = val
                        row[f"pred_over_{name}_{fig}"] = ratio(p.get(fig), val)
                        if fig == "tpot_s":  # closed-loop testers' streams fall out of step after the first round
                            row[f"pred_out_of_step_over_{name}_tpot_s"] = ratio(p.get("tpot_out_of_step_s"), val)
            rounds = gl.get(f"c{n}") or {}
            for part in ("first_round", "later_rounds"):
                val = (rounds.get(f"ttft_{part}_s") or {}).get("p50")
                if val:
                    row[f"guidellm_ttft_{part}_s"] = val
                    row[f"pred_over_guidellm_ttft_{part}_s"] = ratio(p.get("ttft_s"), val)
            # through HTTP ÷ the in-process engine with the same settings (the front end's cost), per client
            ceiling = ((eng.get(f"c{n}_{mode}") or {}).get("output_tokens_per_s"))
            if ceiling:
                row["engine_output_tokens_per_s"] = ceiling
                for name in ("copt_client", "profile_endpoint", "guidellm"):
                    val = row.get(f"{name}_output_tokens_per_s")
                    if val:
                        row[f"{name}_over_engine"] = round(val / ceiling, 3)
            rows[f"c{n}_{mode}"] = row
    return rows


# ---- main ------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON results path (rewritten after every case)")
    parser.add_argument("--shapes", default="1b", help="comma-separated, run in this order: 1b, 3b, 8b, 70b8l "
                        "(Llama-3.1-70B's width on 8 layers), qwen7b (Qwen2.5-7B's architecture), qwen3moe16l "
                        "(Qwen3-30B-A3B's, a mixture of experts, on 16 of its 48 layers); default 1b")
    parser.add_argument("--skip", default="", help="comma-separated cases to leave out: " + ", ".join(CASES))
    parser.add_argument("--budget-s", type=float, default=540, help="seconds for the whole run; a case that "
                        "would not fit in what is left is recorded as skipped (default 540)")
    parser.add_argument("--client-procs", type=int, default=4, help="load-generator processes")
    parser.add_argument("--load-window", type=float, default=60, help="seconds a copt serve load may take at most")
    parser.add_argument("--tserve-window", type=float, default=12,
                        help="seconds per transformers serve load (tokens streamed by then count)")
    parser.add_argument("--copt-args", default="", help="extra flags for copt serve (default none: its defaults), "
                        "e.g. '--api-server-count 1'")
    parser.add_argument("--tserve-args", default="", help="extra flags for transformers serve, e.g. "
                        "'--cb-use-cuda-graph'")
    parser.add_argument("--startup-timeout", type=float, default=240, help="seconds a server may take to start")
    parser.add_argument("--guidellm-shapes", default="1b", help="shapes guidellm runs on (default 1b)")
    parser.add_argument("--guidellm-requests-per-stream", type=int, default=2)
    parser.add_argument("--guidellm-timeout", type=float, default=120, help="seconds per guidellm run at most")
    parser.add_argument("--guidellm-loads", default=None, help="guidellm's streams per run (default: --loads), "
                        "e.g. 1,64,256")
    parser.add_argument("--guidellm-python", default=None, help="the interpreter that runs guidellm (its own "
                        "virtual environment: guidellm pins click); default this one")
    parser.add_argument("--tester-modes", default="sampled", help="what guidellm and copt profile endpoint send: "
                        "sampled, greedy or both (sampled,greedy; default sampled)")
    parser.add_argument("--profile-levels", default="1,64,256",
                        help="copt profile endpoint concurrencies ('' : none, e.g. with --profile-rates alone)")
    parser.add_argument("--profile-duration", type=float, default=5, help="copt profile endpoint seconds per level")
    parser.add_argument("--profile-rates", default="", help="open-loop levels of copt profile endpoint: Poisson "
                        "arrival rates in requests/s (reported as r<rate>; default none)")
    parser.add_argument("--keep-reports", action="store_true", help="embed guidellm's whole reports in the JSON")
    parser.add_argument("--work-dir", type=Path, default=None, help="model directories and logs (default: a "
                        "temporary folder, removed at the end)")
    parser.add_argument("--prompt-len", type=int, default=CFG["prompt_len"], help="prompt tokens (default 256)")
    parser.add_argument("--out-tokens", type=int, default=CFG["out_tokens"], help="output tokens (default 128)")
    parser.add_argument("--loads", default=",".join(map(str, CFG["loads"])),
                        help="streaming clients of the copt client and guidellm loads (default 64,256)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few clients (checks the script on a CPU)")
    args = parser.parse_args()
    CFG.update(prompt_len=args.prompt_len, out_tokens=args.out_tokens,
               loads=[int(n) for n in args.loads.split(",") if n.strip()])
    shapes = [s.strip().lower() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    skip = set(filter(None, (s.strip() for s in args.skip.split(","))))
    unknown = skip - set(CASES)
    if bad or unknown:
        parser.error(f"unknown shapes {bad} / cases {sorted(unknown)}; shapes: 1b, 8b; cases: {', '.join(CASES)}")
    if "copt" not in skip:  # measure the server users install, not a slower fallback
        require_serve_speed_packages(parser)
    if not args.smoke and not english_words() and not {"copt", "profile"} & skip:
        # the profile endpoint's synthetic prompts are English words: unknown to the shapes' tokenizer without them,
        # every prompt would be the same run of unknown tokens, served from the prefix cache
        parser.error("Faker is not installed: the tokenizer this script builds would not know the profile endpoint's "
                     "English words (install faker, or --skip profile)")
    args.guidellm_shapes = {s.strip().lower() for s in args.guidellm_shapes.split(",") if s.strip()}
    args.profile_levels = [int(c) for c in args.profile_levels.split(",") if c.strip()]
    args.profile_rates = [float(r) for r in args.profile_rates.split(",") if r.strip()]
    args.tester_modes = [m.strip() for m in args.tester_modes.split(",") if m.strip()]
    if not args.tester_modes or set(args.tester_modes) - set(MODES):
        parser.error(f"--tester-modes: one or more of {', '.join(MODES)}")
    if args.smoke:
        CFG.update(prompt_len=16, out_tokens=8, loads=[4, 8], b1_requests=2)
        args.profile_levels = [1, 4]
        args.profile_duration = min(args.profile_duration, 2)
        args.client_procs = min(args.client_procs, 2)
        args.guidellm_shapes = set(shapes)
    args.guidellm_loads = ([int(n) for n in args.guidellm_loads.split(",") if n.strip()] if args.guidellm_loads
                           else list(CFG["loads"]))
    import torch

    cuda = torch.cuda.is_available()
    budget = Budget(args.budget_s)
    results: dict = {"bench": "gpu_serve_models", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "config": dict(CFG), "modes": MODES,
                     "shapes": shapes, "skip": sorted(skip), "smoke": args.smoke, "budget_s": args.budget_s,
                     "host": host_probe_subprocess(),
                     "models": {}, "case_seconds": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def save() -> None:
        with lock:
            results["elapsed_s"] = round(budget.total - budget.left(), 1)
            tmp_out = args.out.with_suffix(args.out.suffix + ".tmp")
            tmp_out.write_text(json.dumps(results, indent=2, default=str))
            os.replace(tmp_out, args.out)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="copt-models-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    logs = args.out.parent / f"{args.out.stem}-logs"

    def timed(name: str, fn, *a) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        try:
            fn(*a)
        except Exception as exc:  # noqa: BLE001 - recorded, the next case runs
            results.setdefault("errors", {})[name] = {"error": f"{type(exc).__name__}: {exc}",
                                                      "traceback": traceback.format_exc()}
            log(f"{name} failed: {exc}")
        results["case_seconds"][name] = round(time.perf_counter() - t0, 1)
        save()
        # the servers' logs and the testers' reports next to --out (the model directories stay in the work dir)
        logs.mkdir(exist_ok=True)
        for f in work.iterdir():
            if f.is_file() and f.suffix in (".log", ".json"):
                shutil.copyfile(f, logs / f.name)

    dirs: dict[str, Path] = {}
    made_by: dict[str, dict] = {}
    vocab_of: dict[str, int] = {}

    def stream(shape: str) -> PromptStream:  # each case its own, from the same first prompt
        return PromptStream(vocab_of[shape], CFG["prompt_len"])

    def build(shape: str) -> None:
        spec = SMOKE_SHAPE if args.smoke else SHAPES[shape]
        dirs[shape] = work / f"{spec.get('model_type', 'llama')}-{shape}-shape"
        if (dirs[shape] / "config.json").exists():  # a --work-dir of an earlier run: the same weights again
            made_by[shape] = {"weight_bytes": sum(f.stat().st_size for f in dirs[shape].glob("*.safetensors")),
                              "build_and_save_s": 0.0, "reused": True, "vocab": spec["vocab_size"]}
        else:
            made_by[shape] = make_model_dir(dirs[shape], spec)
        results["models"][shape] = {**made_by[shape], "shape": spec}
        vocab_of[shape] = spec["vocab_size"]
        log(f"model {shape}: {made_by[shape]['weight_bytes'] / 1e9:.2f} GB of weights, built and saved in "
            f"{made_by[shape]['build_and_save_s']} s")
    # the order (most important first): per shape, copt serve (batch-1, 64/256 clients, guidellm, copt profile
    # endpoint) then transformers serve on the same directory; then advise; the in-process engines last
    for shape in shapes:
        timed(f"build_{shape}", build, shape)
        if shape not in dirs:
            continue
        if "copt" not in skip:
            if budget.allows(45 if shape == "1b" else 90):
                timed(f"copt_{shape}", case_copt, shape, dirs[shape], made_by[shape], stream(shape), args, skip,
                      budget, results, save, work)
            else:
                results.setdefault("copt", {})[shape] = {"skipped": "time budget"}
        if "tserve" not in skip:
            if budget.allows(40 if shape == "1b" else 60):
                timed(f"tserve_{shape}", case_tserve, shape, dirs[shape], stream(shape), args, budget, results,
                      save, work)
            else:
                results.setdefault("tserve", {})[shape] = {"skipped": "time budget"}
    if "advise" not in skip and dirs:
        def adv() -> None:
            for shape in dirs:
                results.setdefault("advise", {})[shape] = advise_predictions(
                    dirs[shape], [] if cuda else ["--gpu", "h200"], shared_settings(args.copt_args))
            if not cuda:
                results["advise_note"] = "no GPU here: predictions for --gpu h200 (checks the plumbing only)"
            results["comparison"] = {shape: comparisons(results, shape) for shape in dirs}

        timed("advise", adv)
    for shape in sorted(dirs, key=lambda x: x != "1b"):  # the 1B engine first: cheaper
        if "engine" not in skip:
            if budget.allows(30 if shape == "1b" else 70):
                timed(f"engine_{shape}", case_engine, shape, dirs[shape], stream(shape), budget, results, save,
                      shared_settings(args.copt_args))
            else:
                results.setdefault("engine", {})[shape] = {"skipped": "time budget"}
    results["comparison"] = {shape: comparisons(results, shape) for shape in dirs}
    save()
    print_table(results, shapes)
    print(f"results: {args.out}")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)


def _f(x: float | None, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def print_table(results: dict, shapes: list[str]) -> None:
    print(f"\ncopt serve on real model sizes — {results['gpu']}, {results['date']}, prompts {CFG['prompt_len']}, "
          f"{CFG['out_tokens']} output tokens; tok/s (TTFT p50 s); pred = copt advise ÷ measured")
    for shape in shapes:
        copt = (results.get("copt") or {}).get(shape) or {}
        ts = (results.get("tserve") or {}).get(shape) or {}
        eng = (results.get("engine") or {}).get(shape) or {}
        gl, prof = ({mode: (results.get(tester_key(name, mode)) or {}).get(shape) or {} for mode in MODES}
                    for name in ("guidellm", "profile_endpoint"))
        cmp_ = (results.get("comparison") or {}).get(shape) or {}
        b1 = copt.get("b1") or {}
        print(f"[{shape}] start-up: copt serve {_f(copt.get('startup_s'), '.1f')} s, transformers serve "
              f"{_f(ts.get('startup_s'), '.1f')} s, engine {_f(eng.get('startup_s'), '.1f')} s; batch-1 ms/token "
              f"greedy {_f((b1.get('greedy') or {}).get('ms_per_token'), '.2f')}, sampled "
              f"{_f((b1.get('sampled') or {}).get('ms_per_token'), '.2f')} (floor {_f(b1.get('floor_ms'), '.2f')}; "
              f"pred {_f((cmp_.get('b1_greedy') or {}).get('pred_over_copt_client'), '.2f')} / "
              f"{_f((cmp_.get('b1_sampled') or {}).get('pred_over_copt_client'), '.2f')})")
        print(f"  {'load':<14}{'engine':>10}{'copt serve':>20}{'transformers':>20}{'copt÷tf':>9}"
              f"{'guidellm':>20}{'profile ep':>20}{'pred tok/s':>11}{'pred TTFT':>10}")
        for n in CFG["loads"]:
            for mode in MODES:
                key = f"c{n}_{mode}"

                def cell(r: dict) -> str:
                    tok = r.get("output_tokens_per_s")
                    ttft = (r.get("ttft_s") or {}).get("p50")
                    return f"{_f(tok, ',.0f')} ({_f(ttft, '.2f')})" if tok else r.get("skipped", "-")[:18]

                c, t = copt.get(key) or {}, ts.get(key) or {}
                gl_r, pr_r = gl[mode].get(f"c{n}") or {}, prof[mode].get(f"c{n}") or {}
                x = ratio(c.get("output_tokens_per_s"), t.get("output_tokens_per_s"))
                row = cmp_.get(key) or {}
                print(f"  {str(n) + ' ' + mode:<14}{_f((eng.get(key) or {}).get('output_tokens_per_s'), ',.0f'):>10}"
                      f"{cell(c):>20}{cell(t):>20}{_f(x, '.2f'):>9}{cell(gl_r) if gl_r else '-':>20}"
                      f"{cell(pr_r) if pr_r else '-':>20}"
                      f"{_f(row.get('pred_over_copt_client_output_tokens_per_s'), '.2f'):>11}"
                      f"{_f(row.get('pred_over_copt_client_ttft_s'), '.2f'):>10}")
        for name, src in (("copt serve", copt), ("transformers serve", ts), ("guidellm", gl["sampled"]),
                          ("guidellm greedy", gl["greedy"]), ("profile endpoint", prof["sampled"]),
                          ("profile endpoint greedy", prof["greedy"])):
            if src.get("skipped") or src.get("error"):
                print(f"  {name}: {src.get('skipped') or str(src.get('error'))[:200]}")
    for name, err in (results.get("errors") or {}).items():
        print(f"error in {name}: {err['error'][:300]}")


if __name__ == "__main__":
    main()
