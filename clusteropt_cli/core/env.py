"""The environment report behind `copt env` (like ds_report / vLLM's collect-env)."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from clusteropt_cli import __version__
from clusteropt_cli.deps import installed_backends


@dataclass
class EnvReport:
    copt: str
    python: str
    platform: str
    cpu_count: int
    memory_bytes: int | None
    # this host's time for copt's reference Python loop (core/hostspeed.py): `copt advise --host-loop-ms` prices
    # copt serve's host work with it
    host_loop_ms: float
    torch: str | None
    cuda_available: bool
    cuda_version: str | None
    cudnn_version: int | None
    nccl_version: str | None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    backends: dict[str, dict[str, str | None]] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_CUDA_ARCH_LIST", "HF_HUB_OFFLINE",
             "NCCL_NVLS_ENABLE", "COPT_DEBUG", "OMP_NUM_THREADS")


def collect_env() -> EnvReport:
    from clusteropt_cli.core.hostspeed import python_loop_seconds
    from clusteropt_cli.deps import version_of

    report = EnvReport(
        copt=__version__,
        python=sys.version.split()[0],
        platform=platform.platform(),
        cpu_count=os.cpu_count() or 1,
        memory_bytes=_memory_bytes(),
        host_loop_ms=round(python_loop_seconds() * 1e3, 2),
        torch=version_of("torch"),
        cuda_available=False,
        cuda_version=None,
        cudnn_version=None,
        nccl_version=None,
        backends=installed_backends(),
        env_vars={k: os.environ[k] for k in _ENV_VARS if k in os.environ},
    )
    if report.torch is None:
        return report
    import torch

    from clusteropt_cli.hardware import detect_gpus

    report.cuda_version = torch.version.cuda
    report.cuda_available = torch.cuda.is_available()
    if report.cuda_available:
        report.cudnn_version = torch.backends.cudnn.version()
        try:
            report.nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - NCCL is absent on some builds
            report.nccl_version = None
        report.gpus = [asdict(g) for g in detect_gpus()]
    return report
