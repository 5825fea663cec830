"""Causal SDPA without a materialized mask, for packed training batches.

copt trains on packed blocks: every row is one unpadded causal sequence, so SDPA's `is_causal=True` is the exact
attention. transformers only uses that flag when it can prove the mask is purely causal at run time, which it
cannot while torch.compile traces the model: it then builds an explicit [batch, 1, seq, seq] mask, which rules
out the causal flash kernels (on the H200, 1B shape, 8 × 2048, the compiled step spent 67 of its 296 ms in masked
cuDNN attention; docs/benchmarks.md#train). Under the attention implementation registered here
transformers creates no mask at all (it builds none for implementations it does not know) and attention runs
transformers' own SDPA forward with `is_causal=True`.
"""

from __future__ import annotations

from typing import Any

CAUSAL_SDPA = "copt_causal_sdpa"


def _causal_sdpa_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any):
    """transformers' SDPA attention with no mask (so `is_causal` whenever the query has more than one token)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def register_causal_sdpa() -> None:
    """Make `copt_causal_sdpa` a valid transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa_attention)


def plain_causal_model(config: Any) -> bool:
    """Whether every layer attends with a plain causal mask (no sliding window, chunked or bidirectional
    layers): only then is dropping the mask exact."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None):
        return False
    layer_types = getattr(text, "layer_types", None)
    return not (layer_types and any(kind != "full_attention" for kind in layer_types))


def use_causal_sdpa(model: Any) -> bool:
    """Switch an SDPA model whose layers are all plain causal to `copt_causal_sdpa`; returns whether it did."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or not plain_causal_model(config):
        return False
    if not hasattr(model, "set_attn_implementation"):
        return False
    register_causal_sdpa()
    try:
        model.set_attn_implementation(CAUSAL_SDPA)
    except (ValueError, ImportError, KeyError):
        return False
    return getattr(model.config, "_attn_implementation", None) == CAUSAL_SDPA


def check_unpadded(model: Any, batch: dict[str, Any]) -> None:
    """A batch with padding needs the real mask: refuse it under the mask-free implementation."""
    mask = batch.get("attention_mask")
    if mask is not None and getattr(model.config, "_attn_implementation", None) == CAUSAL_SDPA and \
            not bool(mask.bool().all()):
        raise ValueError("copt_causal_sdpa attends without a mask, but this batch is padded; train with attn='sdpa' "
                         "on a model prepared without use_causal_sdpa")
