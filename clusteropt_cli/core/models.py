"""Loading a causal LM for inference-side work (a teacher, a trained student, an evaluation), the dtype names
copt's flags take, and the host-memory check made before a model is built on the host. Never downloads: models are
local Hugging Face directories.

    from clusteropt_cli.core.models import load_causal_lm, pick_device
    model = load_causal_lm("path/to/model", "auto", pick_device(), precision="bf16")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError, OutOfMemoryError

DTYPE_NAMES = ("bf16", "fp16", "fp32")


def dtype_of(name: str) -> Any:
    """A dtype name (bf16 | fp16 | fp32) → the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def pick_device() -> str:
    """cuda:LOCAL_RANK under a launcher, cuda on one GPU, else cpu."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def torch_dtype(name: str, device: str, precision: str = "fp32") -> Any:
    """A dtype name or auto → torch dtype. auto: the training precision's compute dtype on GPU, fp32 on CPU."""
    import torch

    if name == "auto":
        if device == "cpu":
            return torch.float32
        return {"fp16": torch.float16, "fp32": torch.float32}.get(precision, torch.bfloat16)
    return dtype_of(name)


def host_memory_available() -> int:
    """Bytes the host can give this process now without swapping (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_host_memory(models: Sequence[tuple[str, dict[str, Any], int]], hint: str, copies: int = 1) -> None:
    """Refuse (exit 5), before anything is allocated, models whose weights alone exceed the host memory available
    now: each entry (what, its config.json dict, the bytes a weight is built in), held `copies` times (one
    per process of this machine). Past that memory the kernel's out-of-memory killer ends the process (exit 137)
    without a message. A config whose size clusteropt_cli.modelspec cannot tell is not counted."""
    from clusteropt_cli.modelspec import load_model_spec

    needed, parts = 0, []
    for what, config, width in models:
        try:
            params = int(load_model_spec(config).num_params)
        except Exception:  # noqa: BLE001 - an architecture modelspec does not know: loading tells
            continue
        needed += params * width * copies
        count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
        parts.append(f"{what}: {count} parameters × {width} bytes"
                     + (f" × {copies} copies (one a process)" if copies > 1 else ""))
    available = host_memory_available()
    if needed > available:
        gib = 2**30
        raise OutOfMemoryError(f"Not enough host memory: the weights alone need about {needed / gib:.1f} GiB "
                               f"({'; '.join(parts)}); {available / gib:.1f} GiB is available.", hint=hint)


def load_causal_lm(path: str | Path, dtype: str | Any = "auto", device: str = "cpu", precision: str = "fp32"):
    """A local HF causal LM directory, loaded on `device` (never downloads); `dtype` a name, auto or a torch
    dtype."""
    dtype = torch_dtype(dtype, device, precision) if isinstance(dtype, str) else dtype
    model = pretrained_causal_lm(path, dtype=dtype, local_files_only=True)
    return model.to(device)


def pretrained_causal_lm(path: str | Path, flag: str = "MODEL", **kwargs: Any) -> Any:
    """AutoModelForCausalLM.from_pretrained(path, **kwargs), refusing a checkpoint that leaves parameters its
    config.json names uninitialized (a config with one layer more than the weights trained, served or quantized
    that layer from random values, with transformers' warning only)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise BadInputError(f"{flag} {path}: the weights lack {len(missing)} tensor(s) its config.json names "
                            f"({shown}); they would start from random values.",
                            hint="Make config.json match the checkpoint (num_hidden_layers, vocab_size, ...), or pass "
                                 "the directory the weights came with.")
    return model
