"""Helpers shared by the benchmark scripts (import as `from common import ...`: a script's own folder is on
sys.path when it runs as `python3 bench/<script>.py`)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COPY_BW = 4.26e12  # measured device-to-device copy bandwidth of the H200 (docs/benchmarks.md#h200-baselines)
# serving workload of the serve benchmarks: prompts of PROMPT_MIN..PROMPT_MAX random tokens
PROMPT_MIN, PROMPT_MAX = 32, 256
NUM_REQUESTS, OUT_TOKENS = 256, 128  # requests and output tokens per request
MAX_MODEL_LEN, KV_GIB = 512, 16.0  # the server of the serve benchmarks: context length, KV cache GiB

# the Llama-3.2-1B architecture (random weights in the benchmarks)
LLAMA_1B_SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                      rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
                      pad_token_id=128004)
# Llama-3.1-8B's architecture (random weights)
LLAMA_8B_SHAPE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                      rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
                      pad_token_id=128004)

# Llama-3.2-3B's architecture (random weights): the 1B's family, wider and deeper
LLAMA_3B_SHAPE = dict(LLAMA_1B_SHAPE, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128,
                      intermediate_size=8192)
# Llama-3.1-70B's layer width on 8 of its 80 layers (random weights, 17.9 GB): a shape as heavy as the 8B whose
# prefill runs GEMMs of twice the hidden size, to check how advise's prefill efficiency scales with the width
LLAMA_70B_8L_SHAPE = dict(LLAMA_8B_SHAPE, hidden_size=8192, num_hidden_layers=8, num_attention_heads=64,
                          intermediate_size=28672)
# Qwen2.5-7B's architecture (random weights, 15.2 GB): another family — biases on q/k/v, 4 KV heads of 28, a
# 152k vocabulary, untied embeddings
QWEN25_7B_SHAPE = dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                       rope_theta=1000000.0, max_position_embeddings=32768, bos_token_id=151643,
                       eos_token_id=151645, pad_token_id=151662)

# Qwen3-30B-A3B's architecture on 16 of its 48 layers (random weights, 21.2 GB): a mixture of experts — 128 experts of
# width 768 per layer, 8 routed per token, 4 KV heads of 32, a 152k vocabulary, untied embeddings
QWEN3_MOE_16L_SHAPE = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                           num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                           norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0,
                           max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
                           pad_token_id=151662)


def host_probe() -> dict:
    """The host a benchmark ran on: CPU model and cores, and how fast it runs the kinds of work a serving engine's
    and an offloaded optimizer's host side do (median of 5 each): a fixed pure-Python loop (µs), a small CPU tensor op
    (µs), a torch AdamW step on the CPU (ns per parameter), and on CUDA a kernel launch queued without waiting (µs) and
    a launch read back at once (µs). Recorded so figures measured on different machines can be told apart by their
    host."""
    import statistics

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    out: dict = {"model": names[0] if names else None, "logical_cores": os.cpu_count(),
                 "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}

    def median_us(fn, reps: int = 5) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1e6 * statistics.median(times), 2)

    from clusteropt_cli.core.hostspeed import python_loop_seconds

    out["python_loop_us"] = round(1e6 * python_loop_seconds(repeats=5), 2)  # what advise --host-loop-ms takes (ms)
    try:
        import torch
    except ImportError:
        return out
    a = torch.ones(256)
    out["cpu_tensor_op_us"] = round(median_us(lambda: [a.add_(1.0) for _ in range(1000)]) / 1000, 3)
    out["cpu_adamw_ns_per_param"] = cpu_adamw_ns_per_param()
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()

        def launches() -> None:
            for _ in range(1000):
                x.add_(1.0)
            torch.cuda.synchronize()

        def round_trips() -> None:
            for _ in range(200):
                x.add_(1.0).item()

        launches()
        out["cuda_launch_us"] = round(median_us(launches) / 1000, 3)
        out["cuda_round_trip_us"] = round(median_us(round_trips) / 200, 3)
    return out


ADAMW_PROBE_PARAMS = 8 * 2**20


def cpu_adamw_ns_per_param(params: int = ADAMW_PROBE_PARAMS, reps: int = 5) -> float:
    """ns per parameter of one torch AdamW step over `params` fp32 parameters on the host's CPU, all its threads
    (median of `reps` after one untimed step): the kind of work ZeRO-Offload's CPU Adam does each step, which sets an
    offloaded step's time on hosts whose cores differ (calibration.CPU_ADAM_S_PER_PARAM)."""
    import statistics

    import torch

    weight = torch.nn.Parameter(torch.zeros(params))
    weight.grad = torch.full((params,), 1e-3)
    optimizer = torch.optim.AdamW([weight], lr=1e-4)
    optimizer.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) / params * 1e9, 4)


def host_probe_subprocess(timeout_s: float = 120.0) -> dict:
    """host_probe() run in a child process, so the benchmark's own process holds no CUDA context for it."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from common import host_probe; "
            "print(json.dumps(host_probe()))")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent)],
                              capture_output=True, text=True, timeout=timeout_s, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_gpu() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_graph(fn, device: str, iters: int, warmup: int = 3) -> tuple[float, str]:
    """Seconds per call of fn, replayed as a CUDA graph (timed eagerly where capture fails, or on a CPU), and how it
    was timed."""
    import torch

    for _ in range(warmup):
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters, "eager-cpu"
    torch.cuda.synchronize()
    mode = "cuda-graph"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - time it eagerly instead
        mode, run = f"eager ({type(exc).__name__}: {str(exc)[:80]})", fn
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, mode


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in ps}
    s = sorted(values)
    return {f"p{p}": s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] for p in ps}


def make_model_dir(path: Path, small: bool = False) -> dict:
    """Random-weight bf16 Llama (1B shape) + a word-level tokenizer covering its vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = dict(LLAMA_1B_SHAPE)
    if small:  # --smoke on a CPU: same code path, tiny sizes
        shape.update(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=256, vocab_size=1024, bos_token_id=1000, eos_token_id=1001, pad_token_id=1004)
    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f"t{shape['bos_token_id']}",
                                   eos_token=f"t{shape['eos_token_id']}", pad_token=f"t{shape['pad_token_id']}")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"model": model, "weight_bytes": weight_bytes, "vocab": config.vocab_size}


def workload(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 128000)) for _ in range(rng.randint(PROMPT_MIN, PROMPT_MAX))]
            for _ in range(n)]


def missing_serve_speed_packages() -> list[str]:
    """On a CUDA machine, the speed packages of copt serve's serve extra that are not installed (launch.SPEED_PACKAGES:
    without pyzmq/msgpack the server runs in one process, without uvloop/httptools on asyncio's loop and h11). A GPU
    serving benchmark stops when this is not empty: it would measure a slower server than users install. [] on a
    CPU, where the single process is copt serve's default anyway."""
    import torch

    from clusteropt_cli.core.serve.launch import missing_speed_packages

    return missing_speed_packages() if torch.cuda.is_available() else []


def require_serve_speed_packages(parser) -> None:  # noqa: ANN001 - an argparse.ArgumentParser
    """parser.error (exit 2) naming what missing_serve_speed_packages() found, if anything."""
    missing = missing_serve_speed_packages()
    if missing:
        parser.error(f"{', '.join(missing)} not installed: copt serve would run slower than its defaults (one "
                     "process without pyzmq/msgpack); install copt's serve extra (on a GPU machine without an index: "
                     "their wheels)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, *, max_batch_size: int = NUM_REQUESTS,
                 max_model_len: int = MAX_MODEL_LEN, kv_gib: float = KV_GIB, extra_args: list[str] | tuple = ()
                 ) -> subprocess.Popen:
    """`copt serve` of the repo's copt on the benchmark model (served as "llama-1b-shape"), in a subprocess whose
    stdout and stderr are pipes (wait_healthy reads the stderr of one that exits)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    cmd = [sys.executable, "-m", "clusteropt_cli", "serve", str(model_dir), "--port", str(port),
           "--max-batch-size", str(max_batch_size), "--max-model-len", str(max_model_len), "--kv-cache-memory",
           str(kv_gib), "--max-batch-tokens", "4096", "--served-model-name", "llama-1b-shape",
           "--max-queue", "4096", *extra_args]
    log("starting: " + " ".join(cmd))
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_tail=None) -> float:
    """Poll GET /health until 200; seconds it took. Raises when the server exits or the timeout passes, with the end
    of its log: `log_tail(proc)` when given (a server logging to a file), else its stderr pipe."""
    import httpx

    def ending() -> str:
        if log_tail is not None:
            return log_tail(proc)
        return proc.stderr.read()[-4000:] if proc.stderr and proc.poll() is not None else ""

    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} before it was healthy: {ending()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"server not healthy within {timeout:.0f} s: {ending()}")
        time.sleep(0.25)


async def http_request(client, url: str, prompt: list[int], max_tokens: int, stream: bool,
                       params: dict | None = None) -> dict:
    """One completion request (greedy unless `params` sets sampling fields): output tokens, latency and, when
    streamed, the arrival time of each text chunk."""
    body = {"model": "llama-1b-shape", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **(params or {})}
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        data = r.json()
        return {"tokens": data["usage"]["completion_tokens"], "latency": time.perf_counter() - t0, "times": []}
    body["stream_options"] = {"include_usage": True}
    times, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            if obj["choices"] and obj["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {"tokens": tokens, "latency": time.perf_counter() - t0, "times": [t - t0 for t in times], "start": t0}


async def http_load(url: str, prompts: list[list[int]], max_tokens: int, stream: bool) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*[http_request(client, url, p, max_tokens, stream) for p in prompts])
        wall = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in out)
    res = {"requests": len(out), "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}
    if stream:
        ttft = [o["times"][0] for o in out if o["times"]]
        itl = [b - a for o in out for a, b in zip(o["times"], o["times"][1:], strict=False)]
        res["ttft_s"] = percentiles(ttft)
        res["itl_s"] = percentiles(itl)
        res["tpot_s"] = percentiles([t for t in map(per_token_tpot, out) if t is not None])
    return res


def per_token_tpot(result: dict) -> float | None:
    """A streamed request's TPOT per output token: first to last text chunk over the tokens between them (its
    usage's count). A chunk can carry several tokens (text held back until it decodes, deltas that queued in the
    server), so chunk gaps over-state it."""
    times, tokens = result["times"], result["tokens"]
    if len(times) < 2 or tokens < 2:
        return None
    return (times[-1] - times[0]) / (tokens - 1)


KERNEL_CATEGORIES = [  # first match wins; matched against the lower-cased kernel name
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul", "triton_tem")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("triton fused (compiled elementwise/norms/loss)", ("triton_",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("reduction/elementwise (eager)", ("reduce", "elementwise", "vectorized", "unrolled", "kernel")),
]


def summarize_kernels(prof, wall_s: float, steps: int) -> dict:  # noqa: ANN001
    """Per step: wall ms, GPU kernel ms by category, the 25 costliest kernels."""
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        # kernels only: user annotations (e.g. "Optimizer.step#AdamW.step") span kernels already counted
        if getattr(event, "device_type", None) is not None and str(event.device_type).endswith("CUDA") \
                and event.device_time_total and not getattr(event, "is_user_annotation", False):
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total / 1e3
            entry[1] += 1
    by_cat: dict[str, float] = {}
    for name, (ms, _n) in kernels.items():
        lower = name.lower()
        cat = next((c for c, keys in KERNEL_CATEGORIES if any(k in lower for k in keys)), "other")
        by_cat[cat] = by_cat.get(cat, 0.0) + ms / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall_s / steps,
            "gpu_kernel_ms_per_step": sum(by_cat.values()),
            "kernels_per_step": sum(count for _ms, count in kernels.values()) / steps,
            "by_category_ms_per_step": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:140], "ms_per_step": ms / steps, "calls_per_step": c / steps}
                            for n, (ms, c) in top]}
