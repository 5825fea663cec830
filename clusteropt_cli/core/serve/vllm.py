"""`--engine vllm`: translate copt's serve settings into a `vllm serve` command line the installed vLLM accepts.

What each vLLM release accepts was read from its sources (the flag sets of 0.10.0, 0.11.0, 0.13.0 and 0.33.0 are
recorded under tests/data/vllm_args/, with the script that records them):

- speculative config `"method": "draft_model"`: 0.10-0.14 refuse a draft model at start ("Draft model speculative
  decoding is not supported yet"); 0.16 and later accept it (0.15 ships no source release; copt lets vLLM decide).
- `disable_by_batch_size` (copt's `--speculative-max-batch`): a field up to 0.16 but ignored by the V1 engine
  since 0.10, then removed; from 0.24 `num_speculative_tokens_per_batch_size` (a batch-size → k schedule) does the
  job, so copt maps the limit onto it there and drops it with a warning before.
- `--kv-cache-memory-bytes` (copt's --kv-cache-memory): from 0.11.
- `--async-scheduling` explicitly on: refused with n-gram (CPU) speculation in every release, with a draft model
  before 0.16, and with pipeline parallelism up to 0.14 and again from 0.31 (the V1 model runner).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
KV_DTYPES = {"auto": "auto", "bf16": "auto", "fp8": "fp8", "int8": None}
LATEST_KNOWN = (0, 33)  # the newest release whose arguments copt was checked against
OLDEST_SUPPORTED = (0, 10)  # the V1 engine's command line


@dataclass(frozen=True)
class VllmCaps:
    """What one vLLM release (major, minor) accepts, as far as copt's translation needs to know."""

    version: tuple[int, int]

    @property
    def draft_model(self) -> bool:
        return self.version >= (0, 15)

    @property
    def spec_batch_schedule(self) -> bool:
        return self.version >= (0, 24)

    @property
    def async_with_draft_model(self) -> bool:
        return self.version >= (0, 16)

    @property
    def async_with_pipeline(self) -> bool:
        return (0, 15) <= self.version < (0, 31)


@dataclass
class VllmPlan:
    """The argv, the vLLM version it was built for (and where that came from), and what was changed on the way."""

    argv: list[str]
    version: str
    version_source: str  # "installed" | "--vllm-version" | "assumed (vLLM not installed)"
    warnings: list[str] = field(default_factory=list)


def vllm_available() -> bool:
    """vLLM importable (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its package metadata (no import), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def parse_version(text: str) -> tuple[int, int]:
    """'0.11', '0.11.2', '0.13.0rc1', '0.14.0+cu129' → (0, 11) …; ValueError when it is not X.Y[...]."""
    parts = text.strip().lstrip("v").split(".")
    try:
        major = int(parts[0])
        minor = int("".join(ch for ch in parts[1].split("+")[0] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        raise ValueError(f"'{text}' is not a vLLM version (X.Y or X.Y.Z)") from None
    return major, minor


def resolve_version(override: str | None) -> tuple[str, str]:
    """(version, source): --vllm-version when given, else the installed one, else the newest copt knows."""
    if override:
        parse_version(override)
        return override, "--vllm-version"
    installed = installed_vllm_version()
    if installed:
        return installed, "installed"
    return ".".join(map(str, LATEST_KNOWN)), "assumed (vLLM not installed; pass --vllm-version X.Y)"


def choose_engine(requested: str) -> str:
    """'auto' → vllm when it is installed and a CUDA GPU is present, else copt's own engine."""
    if requested == "transformers":  # the former name of copt's engine
        return "copt"
    if requested != "auto":
        return requested
    if not vllm_available():
        return "copt"
    try:
        import torch

        return "vllm" if torch.cuda.is_available() else "copt"
    except ImportError:
        return "copt"


def _user_set(settings: ServeRecipe, name: str) -> bool:
    return name in getattr(settings, "model_fields_set", set()) and getattr(settings, name) is not None


def plan_vllm_command(settings: ServeRecipe, version: str | None = None) -> VllmPlan:
    """The `vllm serve` argv equivalent to a ServeRecipe for one vLLM version (BadInputError for settings that
    version cannot express). `version` None: settings.vllm_version, the installed vLLM, else the newest known."""
    ver, source = resolve_version(version or getattr(settings, "vllm_version", None))
    caps = VllmCaps(parse_version(ver))
    warnings: list[str] = []
    if caps.version < OLDEST_SUPPORTED:
        raise BadInputError(f"vLLM {ver} predates the V1 engine's command line copt writes (0.10 and later).",
                            hint="Upgrade vLLM (pip install -U vllm), or pass --vllm-version for the one you run.")
    if caps.version > LATEST_KNOWN:
        warnings.append(f"vLLM {ver} is newer than the newest release copt was checked against "
                        f"({'.'.join(map(str, LATEST_KNOWN))}); the command follows that release.")

    if shutil.which("vllm") or not vllm_available():
        cmd = ["vllm", "serve", settings.model]
    else:  # importable but no console script on PATH
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", settings.model]
    cmd += ["--host", settings.host, "--port", str(settings.port), "--dtype", DTYPES[settings.dtype]]
    if settings.served_model_name:
        cmd += ["--served-model-name", settings.served_model_name]
    if settings.tokenizer:
        cmd += ["--tokenizer", settings.tokenizer]
    if settings.api_key and os.environ.get("VLLM_API_KEY") != settings.api_key:  # from the environment: not in argv
        cmd += ["--api-key", settings.api_key]
    if settings.trust_request_chat_template:
        cmd += ["--trust-request-chat-template"]
    # only what the user set: vLLM picks --max-num-seqs (1024 on large GPUs) and the block size per backend
    if _user_set(settings, "max_batch_size"):
        cmd += ["--max-num-seqs", str(settings.max_batch_size)]
    if settings.max_batch_tokens:
        cmd += ["--max-num-batched-tokens", str(settings.max_batch_tokens)]
    if settings.max_model_len:
        cmd += ["--max-model-len", str(settings.max_model_len)]
    if _user_set(settings, "block_size"):
        cmd += ["--block-size", str(settings.block_size)]
    if _user_set(settings, "enable_prefix_caching"):
        cmd += ["--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching"]
    if getattr(settings, "gpu_memory_utilization", None) is not None:
        cmd += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    if settings.kv_cache_blocks:
        cmd += ["--num-gpu-blocks-override", str(settings.kv_cache_blocks)]
    if settings.kv_cache_memory:
        if caps.version < (0, 11):
            raise BadInputError(f"vLLM {ver} has no --kv-cache-memory-bytes (it arrives in 0.11).",
                                hint="Size the cache with --gpu-memory-utilization or --kv-cache-blocks instead.")
        cmd += ["--kv-cache-memory-bytes", str(int(settings.kv_cache_memory * 2**30))]
    kv_dtype = KV_DTYPES[settings.kv_cache_dtype]
    if kv_dtype is None:
        raise BadInputError("kv_cache_dtype int8 has no vLLM equivalent; use fp8 or auto.",
                            hint="Pass --kv-cache-dtype fp8 (or drop it) with --engine vllm.")
    if kv_dtype != "auto":
        cmd += ["--kv-cache-dtype", kv_dtype]
    if settings.quantization:
        cmd += ["--quantization", settings.quantization]
    if settings.tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(settings.tensor_parallel)]
    if settings.pipeline_parallel > 1:
        cmd += ["--pipeline-parallel-size", str(settings.pipeline_parallel)]
    if getattr(settings, "api_server_count", 0):
        cmd += ["--api-server-count", str(settings.api_server_count)]

    spec: dict[str, Any] | None = None
    k = settings.num_speculative_tokens
    if settings.draft_model:
        if not caps.draft_model:
            raise BadInputError(
                f"vLLM {ver} refuses draft-model speculation at start (\"Draft model speculative decoding is not "
                "supported yet\"); vLLM accepts method draft_model from 0.15/0.16 on.",
                hint="Upgrade vLLM, use --prompt-lookup N (n-gram drafting), or serve with --engine copt.")
        spec = {"method": "draft_model", "model": settings.draft_model, "num_speculative_tokens": k}
    elif settings.prompt_lookup:
        spec = {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": settings.prompt_lookup, "prompt_lookup_min": 1}
    if spec is not None and _user_set(settings, "speculative_max_batch"):
        n = settings.speculative_max_batch
        if caps.spec_batch_schedule:  # k drafts while ≤ n run, none above (vLLM carries the last entry forward)
            spec["num_speculative_tokens_per_batch_size"] = [[1, n, k], [n + 1, n + 1, 0]]
        else:
            warnings.append(f"--speculative-max-batch {n} dropped: vLLM {ver} has no batch-size limit for "
                            "speculation (disable_by_batch_size is ignored by its V1 engine; "
                            "num_speculative_tokens_per_batch_size arrives in 0.24).")
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if settings.cuda_graphs is False or settings.compile is False:
        cmd += ["--enforce-eager"]
    if settings.async_scheduling:  # explicitly on: vLLM hard-fails what it cannot combine
        if spec is not None and spec["method"] == "ngram":
            raise BadInputError(f"vLLM {ver} refuses --async-scheduling with n-gram (prompt lookup) speculation.",
                                hint="Drop --async-scheduling (vLLM then turns it off itself) or --prompt-lookup.")
        if spec is not None and not caps.async_with_draft_model:
            raise BadInputError(f"vLLM {ver} refuses --async-scheduling with draft-model speculation.",
                                hint="Drop --async-scheduling, or upgrade vLLM to 0.16 or later.")
        if settings.pipeline_parallel > 1 and not caps.async_with_pipeline:
            raise BadInputError(f"vLLM {ver} refuses --async-scheduling with pipeline parallelism.",
                                hint="Drop --async-scheduling or --pipeline-parallel-size.")
        cmd += ["--async-scheduling"]
    elif settings.async_scheduling is False:
        cmd += ["--no-async-scheduling"]
    return VllmPlan(argv=cmd, version=ver, version_source=source, warnings=warnings)


def build_vllm_command(settings: ServeRecipe, version: str | None = None) -> list[str]:
    """The argv of plan_vllm_command (warnings dropped)."""
    return plan_vllm_command(settings, version).argv


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
