"""Build the model to profile: a local HF model dir (its weights), or a config/preset (random weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM)
    source: str
    random_weights: bool
    config: dict[str, Any]


def check_model_source(source: str) -> Any:
    """Fail fast (before importing torch) when MODEL cannot be resolved (copt train's resolver); the resolved source,
    for load_model."""
    from clusteropt_cli.core.train.model import resolve_model_source

    return resolve_model_source(source)


def load_model(source: str, device: str, dtype: Any, attn: str = "sdpa", seed: int = 0,
               resolved: Any = None) -> LoadedModel:
    """The causal LM on `device` in `dtype`: trained weights when the directory has them, else random init
    (`resolved`: check_model_source's result, so the model's files are checked once)."""
    from clusteropt_cli.core.train.model import load_model as build_model

    resolved = resolved if resolved is not None else check_model_source(source)
    model = build_model(resolved, seed, dtype=dtype, device=device, attn=attn)
    return LoadedModel(model=model, source=source, random_weights=resolved.kind != "pretrained",
                       config=resolved.config)


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
