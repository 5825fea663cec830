"""Process-group setup for runs started by torchrun or the deepspeed launcher (which set RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). copt never spawns workers itself: see launch.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from clusteropt_cli.errors import BadInputError


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    backend: str | None  # None when single-process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type


def launched_world_size() -> int:
    """WORLD_SIZE set by a launcher (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_distributed(expected_world_size: int) -> DistContext:
    """Join the process group the launcher prepared (gloo on CPU, nccl on CUDA) and pick this rank's device."""
    import torch
    import torch.distributed as dist

    world_size = launched_world_size()
    if world_size != expected_world_size:
        raise BadInputError(
            f"This run asks for {expected_world_size} processes (--gpus × --nodes) but was started with "
            f"WORLD_SIZE={world_size}.",
            hint="run 'copt train ...' directly: it starts torchrun/deepspeed itself with the right process count")
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = None
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend=backend, **kwargs)
    return DistContext(rank, world_size, local_rank, device, backend)


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_mean(value: Any, ctx: DistContext) -> Any:
    """Mean of a scalar tensor over all ranks (a copy; identity when single-process)."""
    if ctx.world_size == 1:
        return value
    import torch.distributed as dist

    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / ctx.world_size


def teardown_distributed(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
