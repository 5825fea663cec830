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
def running_server(model: Path, *args: str, startup_timeout: float = 90):
    """Start `copt serve MODEL ARGS --port P` and yield (base_url, process); SIGTERM it afterwards."""
    import httpx

    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "clusteropt_cli", "serve", str(model), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + startup_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"copt serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("copt serve did not come up in time")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
