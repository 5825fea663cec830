"""`--engine vllm`: translate copt's serve settings into a `vllm serve` command line and run it."""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import sys
from typing import Any

DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
KV_DTYPES = {"auto": "auto", "bf16": "auto", "fp8": "fp8", "int8": None}


def vllm_available() -> bool:
    """vLLM importable (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def choose_engine(requested: str) -> str:
    """'auto' → vllm when it is installed and a CUDA GPU is present, else the embedded transformers engine."""
    if requested != "auto":
        return requested
    if not vllm_available():
        return "transformers"
    try:
        import torch

        return "vllm" if torch.cuda.is_available() else "transformers"
    except ImportError:
        return "transformers"


def build_vllm_command(settings: Any) -> list[str]:
    """The `vllm serve` argv equivalent to a ServeRecipe (raises ValueError for settings vLLM cannot express)."""
    if shutil.which("vllm") or not vllm_available():
        cmd = ["vllm", "serve", settings.model]
    else:  # importable but no console script on PATH
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", settings.model]
    cmd += ["--host", settings.host, "--port", str(settings.port), "--dtype", DTYPES[settings.dtype]]
    if settings.served_model_name:
        cmd += ["--served-model-name", settings.served_model_name]
    if settings.api_key:
        cmd += ["--api-key", settings.api_key]
    cmd += ["--max-num-seqs", str(settings.max_batch_size), "--enable-chunked-prefill"]
    if settings.max_batch_tokens:
        cmd += ["--max-num-batched-tokens", str(settings.max_batch_tokens)]
    if settings.max_model_len:
        cmd += ["--max-model-len", str(settings.max_model_len)]
    cmd += ["--block-size", str(settings.block_size)]
    if settings.kv_cache_blocks:
        cmd += ["--num-gpu-blocks-override", str(settings.kv_cache_blocks)]
    if settings.kv_cache_memory:
        cmd += ["--kv-cache-memory-bytes", str(int(settings.kv_cache_memory * 2**30))]
    kv_dtype = KV_DTYPES[settings.kv_cache_dtype]
    if kv_dtype is None:
        raise ValueError("kv_cache_dtype int8 has no vLLM equivalent; use fp8 or auto")
    if kv_dtype != "auto":
        cmd += ["--kv-cache-dtype", kv_dtype]
    if settings.quantization:
        cmd += ["--quantization", settings.quantization]
    if settings.tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(settings.tensor_parallel)]
    if settings.pipeline_parallel > 1:
        cmd += ["--pipeline-parallel-size", str(settings.pipeline_parallel)]
    spec: dict[str, Any] | None = None
    if settings.draft_model:
        spec = {"model": settings.draft_model, "num_speculative_tokens": settings.num_speculative_tokens}
    elif settings.prompt_lookup:
        spec = {"method": "ngram", "num_speculative_tokens": settings.num_speculative_tokens,
                "prompt_lookup_max": settings.prompt_lookup, "prompt_lookup_min": 1}
    if spec is not None:
        spec["disable_by_batch_size"] = settings.speculative_max_batch + 1
        cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if settings.cuda_graphs is False or settings.compile is False:
        cmd += ["--enforce-eager"]
    if settings.async_scheduling is not None:  # unset: vLLM's own default
        cmd += ["--async-scheduling" if settings.async_scheduling else "--no-async-scheduling"]
    return cmd


def format_command(cmd: list[str]) -> str:
    return shlex.join(cmd)


def run_vllm(cmd: list[str]) -> int:
    """Run vLLM in the foreground; its exit status becomes ours (SIGTERM is forwarded for a graceful drain)."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd)

    def forward(signum: int, frame: Any) -> None:
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
