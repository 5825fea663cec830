"""Measured ceilings of the local CPU (no catalog entry exists for CPUs): a matmul rate and a copy bandwidth.

Used only as evidence for the CPU verdict; `mfu`/`mbu` stay null on CPU because they are defined against the
hardware catalog's peak figures.
"""

from __future__ import annotations

import functools
import time


@functools.lru_cache(maxsize=1)
def cpu_ceilings() -> dict[str, float]:
    """{'matmul_flops': FLOP/s of a 1024³ fp32 matmul, 'copy_bandwidth': bytes/s of a 64 MiB copy} (best of 3)."""
    import torch

    n = 1024
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    matmul_flops = 2 * n**3 / best
    src = torch.empty(16 * 1024 * 1024, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    copy_bandwidth = 2 * src.nbytes / best  # read + write
    return {"matmul_flops": matmul_flops, "copy_bandwidth": copy_bandwidth}
