"""Optional backends: which extra brings which package, what is installed, and a guarded import."""

from __future__ import annotations

import importlib
from importlib import metadata

from clusteropt_cli.errors import missing_extra

# extra → distributions it installs (distribution names as pip knows them)
EXTRAS: dict[str, list[str]] = {
    "core": ["torch", "transformers", "accelerate", "safetensors", "tokenizers", "typer", "rich", "pydantic"],
    "quantize": ["llmcompressor", "compressed-tensors"],
    "gptq": ["gptqmodel", "optimum"],
    "train": ["deepspeed"],
    "serve": ["fastapi", "uvicorn"],
    "distill": ["trl", "math-verify"],
    "profile": ["matplotlib", "aiohttp"],
    "dev": ["pytest", "ruff", "openai"],
}
# Backends copt can use but does not install (deprecated or too large for the extras).
OPTIONAL_BACKENDS = ["vllm", "auto-gptq", "autoawq", "flash-attn", "transformer-engine", "torchao", "bitsandbytes"]


def version_of(distribution: str) -> str | None:
    """Installed version of a distribution, without importing it (None when absent)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_backends() -> dict[str, dict[str, str | None]]:
    """{extra: {distribution: version or None}} plus the optional backends under 'optional'."""
    report = {extra: {dist: version_of(dist) for dist in dists} for extra, dists in EXTRAS.items()}
    report["optional"] = {dist: version_of(dist) for dist in OPTIONAL_BACKENDS}
    return report


def require(module: str, extra: str):
    """Import an optional module or raise MissingDependencyError with the install hint."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        root = (exc.name or module).split(".")[0]
        if root != module.split(".")[0] and version_of(module.split(".")[0].replace("_", "-")):
            raise  # the package is there but one of its own imports failed: a real error, show it
        raise missing_extra(extra, module) from exc
