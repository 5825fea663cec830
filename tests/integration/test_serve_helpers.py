"""Helpers for the serve tests (no tests here): start `copt serve` on a free port, HF greedy references."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(model: Path, *args: str, startup_timeout: float = 90, wait: bool = True):
    """Start `copt serve MODEL ARGS --port P` and yield (base_url, process); SIGTERM it afterwards.

    wait=False yields as soon as the process is started: the caller does its own work while the server loads and
    then calls wait_healthy(url, proc, startup_timeout)."""
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "clusteropt_cli", "serve", str(model), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_healthy(url, proc, startup_timeout)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until the server at url answers /health with 200 (an error if the process exits first or time runs out)."""
    import httpx

    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"copt serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError("copt serve did not come up in time")
        time.sleep(0.2)


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of the server's Prometheus /metrics."""
    import httpx

    key = f"{name}{{{labels}}}" if labels else name
    response = httpx.get(url + "/metrics", timeout=5)
    response.raise_for_status()  # (behind the API key unless the server runs with --metrics-public)
    for line in response.text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate(), one prompt at a time, EOS stripped."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # tiny model on a shared CPU: one thread is ~20x faster than contended threads
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=model.generation_config.pad_token_id)[0, len(ids):].tolist()
            if eos in gen:
                gen = gen[: gen.index(eos)]
            out.append(gen)
    return out


def eval_prompts(fixtures, count: int, min_len: int = 8, max_len: int = 60, seed: int = 0) -> list[list[int]]:
    """Token-id prompts cut from the held-out text (real code, so the outputs are not degenerate)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures.tokenizer)
    ids = tok.encode(Path(fixtures.eval_text).read_text()[:40_000], add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        n = rng.randrange(min_len, max_len)
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start : start + n])
    return prompts


def assert_greedy_parity(model, prompt: list[int], served: list[int], expected: list[int], *,
                         exact: bool = True, max_gap: float = 0.5) -> int:
    """Served greedy tokens against transformers' greedy tokens for the same checkpoint; returns how many agree.

    exact: the sequences are equal. Otherwise (checkpoints that quantize activations per token at run time, INT8
    and FP8 W8A8: one rounding flip of an int8 activation moves HF's own logits by up to ~2 between a full forward
    and a prefix forward of the same tokens) they agree up to a first divergence where both tokens are within `max_gap`
    nats of the best token of HF's full forward at that position (vLLM's check_logprobs_close idea); after it,
    nothing is compared."""
    import torch

    if exact or served == expected:
        assert served == expected
        return len(served)
    i = next((k for k, (a, b) in enumerate(zip(served, expected, strict=False)) if a != b), None)
    if i is None:  # one is a prefix of the other: an EOS on one side at a near tie
        i = min(len(served), len(expected))
        if i == len(expected) and i == len(served):
            return i
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + expected[:i]])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, -1)
    best = logprobs.max()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]
    a = served[i] if i < len(served) else eos
    b = expected[i] if i < len(expected) else eos
    # both choices within max_gap of the best token of HF's full forward over that prefix: HF's own cached decode
    # can pick a token outside that forward's top two (its int8 activation scales differ between the two paths)
    for who, token in (("served", a), ("HF", b)):
        gap = float(best - logprobs[token])
        assert gap < max_gap, f"diverged at token {i}: {who} token {token} is {gap:.3f} nats below HF's best"
    return i
