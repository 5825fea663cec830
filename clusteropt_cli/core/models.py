"""Loading a causal LM for inference-side work (a teacher, a trained student, an evaluation) and the dtype names
copt's flags take. Never downloads: models are local Hugging Face directories.

    from clusteropt_cli.core.models import load_causal_lm, pick_device
    model = load_causal_lm("path/to/model", "auto", pick_device(), precision="bf16")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError

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
