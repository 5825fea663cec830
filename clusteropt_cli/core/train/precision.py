"""Mixed precision: autocast contexts, fp16 loss scaling, fp8 (torchao float8 training) and hardware checks."""

from __future__ import annotations

import contextlib
from typing import Any

from clusteropt_cli.errors import MissingDependencyError, UnsupportedHardwareError

FP8_MIN_CAPABILITY = (8, 9)


def autocast_dtype(precision: str) -> Any:
    """The autocast dtype for a precision (None for fp32): weights stay fp32, matmuls run in this dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(precision)


def autocast_context(precision: str, device_type: str):
    """torch.autocast for bf16/fp16/fp8 (fp8 linears run through torchao; the rest in bf16), else a no-op."""
    import torch

    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def make_grad_scaler(precision: str, device_type: str) -> Any:
    """A dynamic loss scaler (torch.amp.GradScaler) for fp16, else None."""
    if precision != "fp16":
        return None
    import torch

    return torch.amp.GradScaler(device_type)


def check_precision_supported(precision: str, device_type: str) -> None:
    """Raise UnsupportedHardwareError/MissingDependencyError before any work when the precision cannot run."""
    import torch

    if precision == "fp8":
        if device_type != "cuda":
            raise UnsupportedHardwareError(
                "--precision fp8 needs an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                "this run has no CUDA GPU.", hint="use --precision bf16 (or fp16/fp32) here")
        capability = torch.cuda.get_device_capability()
        if capability < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name()
            raise UnsupportedHardwareError(
                f"--precision fp8 needs compute capability >= 8.9; {name} has {capability[0]}.{capability[1]}.",
                hint="use --precision bf16 on this GPU")
        try:
            import torchao.float8  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError("--precision fp8 trains through torchao's float8 linears; torchao is "
                                         "not installed.", hint="pip install torchao") from exc
    if precision == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UnsupportedHardwareError("This GPU does not support bf16.", hint="use --precision fp16")


def convert_to_fp8(model: Any) -> int:
    """Swap the decoder's nn.Linear layers for torchao Float8Linear (dynamic tensorwise scaling); the LM head and
    layers whose dimensions are not multiples of 16 stay in bf16. Returns the number of converted layers."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    converted = 0

    def keep(module: Any, fqn: str) -> bool:
        nonlocal converted
        if not isinstance(module, torch.nn.Linear) or module is head:
            return False
        ok = module.in_features % 16 == 0 and module.out_features % 16 == 0
        converted += int(ok)
        return ok

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=keep)
    return converted
