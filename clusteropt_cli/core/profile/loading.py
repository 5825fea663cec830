"""Build the model to profile: a local HF model dir (its weights), or a config/preset (random weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM)
    source: str
    random_weights: bool
    config: dict[str, Any]


def _read_config(source: str) -> tuple[dict[str, Any], Path | None]:
    """config.json dict and the weights directory (None for a config file or a preset)."""
    path = Path(source).expanduser()
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise BadInputError(f"MODEL {path} has no config.json.",
                                hint="Pass a Hugging Face model directory, a config.json or a preset name.")
        has_weights = any(any(path.glob(pattern)) for pattern in WEIGHT_FILES)
        return json.loads(cfg_path.read_text()), path if has_weights else None
    if path.is_file():
        try:
            return json.loads(path.read_text()), None
        except json.JSONDecodeError as exc:
            raise BadInputError(f"MODEL {path} is not a JSON config: {exc}",
                                hint="Pass a config.json, a model directory or a preset name.") from exc
    if "/" in source or source.endswith(".json"):
        raise BadInputError(f"MODEL {source}: no such file or directory.",
                            hint="Pass a local model directory, a config.json or a preset (copt never downloads).")
    from clusteropt_cli.modelspec import load_model_spec

    return load_model_spec(source).to_hf_config(), None


def check_model_source(source: str) -> None:
    """Fail fast (before importing torch) when MODEL cannot be resolved."""
    _read_config(source)


def load_model(source: str, device: str, dtype: Any, attn: str = "sdpa", seed: int = 0) -> LoadedModel:
    """The causal LM on `device` in `dtype`: trained weights when the directory has them, else random init."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict, weights_dir = _read_config(source)
    torch.manual_seed(seed)
    if weights_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype, attn_implementation=attn)
        model.to(device)
    else:
        cfg = dict(config_dict)
        model_type = cfg.pop("model_type", None)
        if model_type is None:
            raise BadInputError(f"MODEL {source}: the config has no model_type.",
                                hint="Use a Hugging Face config.json (it names model_type, e.g. llama).")
        for key in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
            cfg.pop(key, None)
        config = AutoConfig.for_model(model_type, **cfg)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return LoadedModel(model=model, source=source, random_weights=weights_dir is None, config=config_dict)


def model_spec(source: str, config: dict[str, Any]):
    """The shared ModelSpec (clusteropt_cli.modelspec) for FLOPs and bytes; None when it cannot be built."""
    try:
        from clusteropt_cli.modelspec import load_model_spec
    except ImportError:
        return None
    try:
        return load_model_spec(config)
    except Exception:  # noqa: BLE001 - FLOPs are optional evidence; the profile still stands without them
        try:
            return load_model_spec(source)
        except Exception:  # noqa: BLE001
            return None
