"""The engines a training step runs on: plain PyTorch (one process or DDP with comm hooks) and DeepSpeed ZeRO.

Each engine exposes the same small surface to the loop in loop.py:
    micro_step(batch, is_last_micro) -> (loss, metrics)   forward + backward of one micro-batch
    optimizer_step() -> grad_norm | None                   clip, step, schedule, zero grads (norm: float or tensor)
    lr, loss_scale, save(dir), load(dir), final_state_dict() (rank 0 gets the full weights)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from clusteropt_cli.core.train.checkpoint import load_torch_file, save_torch_file
from clusteropt_cli.core.train.deepspeed_config import deepspeed_weight_dtype
from clusteropt_cli.core.train.distributed import DistContext
from clusteropt_cli.core.train.precision import autocast_context, make_grad_scaler
from clusteropt_cli.errors import BadInputError


def lr_lambda(options: Any, total_steps: int):
    """Multiplier of options.lr at a step: linear warm-up, then cosine/linear decay to min_lr_ratio, or constant."""
    warmup = int(options.warmup_steps)
    floor = float(options.min_lr_ratio)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if options.schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        if options.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on norms, biases or 1-D parameters)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = len(p.ds_shape) if hasattr(p, "ds_shape") else p.ndim  # a ZeRO-3 partition is flat: its full shape
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(options: Any, params: Any, device_type: str) -> Any:
    """AdamW (fused kernel on CUDA), 8-bit AdamW (bitsandbytes) or SGD."""
    import torch

    if options.optimizer == "sgd":
        return torch.optim.SGD(params, lr=options.lr, momentum=0.9)
    if options.optimizer == "adamw-8bit":
        from clusteropt_cli.deps import require

        bnb = require("bitsandbytes", "train")
        return bnb.optim.AdamW8bit(params, lr=options.lr, betas=(0.9, 0.95))
    kwargs = {"fused": True} if device_type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


def make_loss_module(model: Any, loss_fn: Any) -> Any:
    """An nn.Module whose forward(batch) is loss_fn(model, batch): DDP and DeepSpeed wrap this, so their
    gradient hooks fire whatever the loss function calls inside the model."""
    import torch

    class _LossModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch: dict[str, Any]) -> Any:
            return loss_fn(self.model, batch)

    return _LossModule()


def _move(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """Host batch → device without waiting for queued work: from pinned memory on CUDA (a copy from pageable
    memory may synchronize with the stream)."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class TorchEngine:
    """One process, or DDP over the launcher's process group (with an optional gradient-compression hook)."""

    name = "torch"

    def __init__(self, options: Any, model: Any, loss_fn: Any, ctx: DistContext, total_steps: int,
                 gradient_compression: str = "none"):
        import torch

        self.options, self.ctx, self.model = options, ctx, model
        self.module = make_loss_module(model, loss_fn)
        if ctx.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            device_ids = [ctx.device.index] if ctx.device_type == "cuda" else None
            self.module = DDP(self.module, device_ids=device_ids)
            self.name = "ddp"
            self._register_comm_hook(gradient_compression)
        self.optimizer = build_optimizer(options, param_groups(model, options.weight_decay), ctx.device_type)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(options, total_steps))
        self.scaler = make_grad_scaler(options.precision, ctx.device_type)

    def _register_comm_hook(self, compression: str) -> None:
        if compression == "none":
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if compression == "fp16":
            self.module.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif compression == "bf16":
            self.module.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2, min_compression_rate=2,
                                                random_seed=int(self.options.seed))
            self.module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        self.name = f"ddp+{compression}"

    def micro_step(self, batch: dict[str, Any], is_last_micro: bool) -> tuple[Any, dict[str, float]]:
        import contextlib

        batch = _move(batch, self.ctx.device)
        sync = contextlib.nullcontext() if is_last_micro or self.ctx.world_size == 1 else self.module.no_sync()
        with sync:
            with autocast_context(self.options.precision, self.ctx.device_type):
                loss, metrics = self.module(batch)
            scaled = loss / self.options.grad_accum
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        return loss.detach(), metrics

    def optimizer_step(self) -> Any:
        """Clip, step, schedule, zero the gradients; returns the pre-clip grad norm as a device tensor (read
        later, so the step is queued without waiting for the GPU)."""
        import torch

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.options.grad_clip if self.options.grad_clip else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def save(self, directory: Path) -> None:
        """Rank 0 writes the training state (ranks hold identical replicas under DDP)."""
        if not self.ctx.is_main:
            return
        save_torch_file({
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }, Path(directory) / "training_state.pt")

    def load(self, directory: Path) -> None:
        state = load_torch_file(Path(directory) / "training_state.pt")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def final_state_dict(self) -> dict[str, Any] | None:
        return None  # the model itself holds the full weights on every rank


def _quiet_deepspeed_logs() -> None:
    """DeepSpeed logs to stdout; send them to stderr (stdout carries copt's results) and keep warnings only."""
    import logging
    import sys

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stdout__:
            handler.setStream(sys.stderr)


def _single_process_rendezvous() -> None:
    import os
    import socket

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)


def _join_deepspeed_group(deepspeed: Any, world_size: int, backend: str) -> None:
    """deepspeed.init_distributed unless a process group exists; ZeRO-Offload and zero.Init on one device still need
    a (1-rank) group."""
    import torch

    if torch.distributed.is_initialized():
        return
    if world_size == 1:
        _single_process_rendezvous()
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def zero3_model_init(options: Any, world_size: int, device_type: str) -> Any:
    """transformers' HfDeepSpeedConfig for the ZeRO-3 config copt writes: while it is alive, from_pretrained and
    from_config build the model under deepspeed.zero.Init, each parameter partitioned as it is created (onto the
    host with offload_param) instead of the whole model on every rank's host and then every GPU, where
    deepspeed.initialize would partition it. Joins the process group first (zero.Init is collective). Keep the
    returned object for the whole run: transformers holds it by a weak reference and asks it during training."""
    import torch

    from clusteropt_cli.core.train.deepspeed_config import deepspeed_config
    from clusteropt_cli.deps import require

    deepspeed = require("deepspeed", "train")
    from transformers.integrations import HfDeepSpeedConfig

    _quiet_deepspeed_logs()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _join_deepspeed_group(deepspeed, world_size, "nccl" if device_type == "cuda" else "gloo")
    return HfDeepSpeedConfig(deepspeed_config(options, world_size))


class DeepSpeedEngine:
    """DeepSpeed ZeRO 1/2/3 (+ CPU/NVMe offload) through deepspeed.initialize with copt's generated config.

    bf16/fp8 and fp16 train in DeepSpeed's own mixed precision: deepspeed.initialize casts the model to 16 bits
    and the ZeRO optimizer keeps the fp32 masters (final_state_dict saves those)."""

    name = "deepspeed"

    def __init__(self, options: Any, model: Any, loss_fn: Any, ctx: DistContext, total_steps: int,
                 config: dict[str, Any], config_path: Path | None = None):
        import torch

        from clusteropt_cli.deps import require

        deepspeed = require("deepspeed", "train")
        self.options, self.ctx, self.model, self.config = options, ctx, model, config
        if config_path is not None and ctx.is_main:
            Path(config_path).write_text(json.dumps(config, indent=2))
        _quiet_deepspeed_logs()
        _join_deepspeed_group(deepspeed, ctx.world_size,
                              ctx.backend or ("nccl" if ctx.device_type == "cuda" else "gloo"))
        module = make_loss_module(model, loss_fn)
        schedule = lr_lambda(options, total_steps)
        client_optimizer = None
        if "optimizer" not in config:  # no offload: the same torch optimizer as the plain path
            client_optimizer = build_optimizer(options, param_groups(model, options.weight_decay), ctx.device_type)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            optimizer=client_optimizer,
            model_parameters=None if client_optimizer is not None else param_groups(model, options.weight_decay),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=config,
        )
        self.name = f"deepspeed-zero{options.zero}" + (f"+{options.offload}-offload" if options.offload != "none"
                                                       else "")

    def micro_step(self, batch: dict[str, Any], is_last_micro: bool) -> tuple[Any, dict[str, float]]:
        # No torch.autocast here: the weights already are bf16/fp16 (DeepSpeed's bf16/fp16 mode, see
        # deepspeed_config.py), and DeepSpeed would turn an outer CUDA autocast off inside its forward anyway.
        batch = _move(batch, self.engine.device)
        loss, metrics = self.engine(batch)
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
        self.engine.step()  # applies the optimizer at the accumulation boundary only
        return loss.detach().float(), metrics

    def optimizer_step(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def loss_scale(self) -> float | None:
        scale = getattr(self.engine.optimizer, "cur_scale", None)
        return float(scale) if self.options.precision == "fp16" and scale is not None else None

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its ZeRO partitions."""
        self.engine.save_checkpoint(str(directory), tag="deepspeed", save_latest=False)

    def load(self, directory: Path) -> None:
        from clusteropt_cli.core.train.checkpoint import check_pickled_globals

        check_pickled_globals(directory)  # DeepSpeed unpickles with weights_only=False: scan first
        path, _ = self.engine.load_checkpoint(str(directory), tag="deepspeed", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise BadInputError(f"DeepSpeed could not load the checkpoint in {directory}.",
                                hint="resume with the same --zero, --gpus and --nodes as the interrupted run")

    def final_state_dict(self) -> dict[str, Any] | None:
        """The full fp32 weights for the final save, on rank 0 (None on the others). Collective.

        Under bf16/fp16 the model's own weights are 16-bit copies; the trained weights are the fp32 masters the
        ZeRO optimizer holds in partitions, gathered here parameter by parameter
        (deepspeed.utils.safe_get_full_fp32_param). fp32 ZeRO-1/2 returns None: the model holds the full weights.
        """
        if self.options.zero != 3 and deepspeed_weight_dtype(self.options.precision) == "fp32":
            return None
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        full: dict[int, Any] = {}
        for param in self.model.parameters():  # the same order on every rank: each call is a collective
            value = safe_get_full_fp32_param(param) if param.requires_grad else None
            if value is None:  # frozen (or not managed by the optimizer): its own weights, gathered under ZeRO-3
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    value = param.detach().float()
                    value = value.cpu().clone() if self.ctx.is_main else None
            elif self.ctx.is_main:
                value = value.detach().cpu().clone()
            full[id(param)] = value
        if not self.ctx.is_main:
            return None
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights: one tensor, two names
        state = {}
        for name, value in self.model.state_dict().items():
            param = params.get(name)
            state[name] = full[id(param)].view(param.ds_shape if hasattr(param, "ds_shape") else param.shape) \
                if param is not None else value.detach().cpu().clone()
        return state
