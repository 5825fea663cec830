"""Which models copt's slot-attention engine serves natively, and what each layer's attention needs.

The engine runs transformers' own model code and replaces only attention (runner.py): projections, q/k norms,
biases, rotary embeddings, MoE routing and the embedding/logit scales stay transformers'. What our attention must
reproduce per layer is the causal mask, a sliding window (`sliding_window`, per layer through `layer_types`) and
Gemma-2's attention-logit soft-capping; after the LM head, Gemma's final-logit soft-capping. Those are derived here
from the config, the way transformers builds its own masks.

Everything else is refused from the native path, never guessed: a model type outside `NATIVE_MODEL_TYPES` (the
families the architecture matrix test checks against `generate`), layer types other than full and sliding
attention (chunked, linear/recurrent, KV-shared layers), non-causal attention, and rotary scalings whose frequencies
change with the sequence length. Those models run through `fallback.TransformersRunner` (transformers' own
attention and KV cache), with a notice on stderr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model types whose greedy output tests/integration/test_serve_architectures.py checks against HF generate
NATIVE_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2",
    "gemma3_text",
})
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# rotary scalings that recompute their frequencies from the largest position in the batch (transformers'
# dynamic_rope_update): a packed or batched step would change them for every row
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class Architecture:
    """What the slot attention must do for one model (or why it cannot serve it)."""

    model_type: str
    native: bool
    reason: str | None = None  # why not native
    windows: list[int | None] = field(default_factory=list)  # per layer: sliding window, None = full attention
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma-2)
    final_softcap: float | None = None  # tanh soft-capping of the logits (Gemma-2/3)

    @property
    def sliding_layers(self) -> int:
        return sum(w is not None for w in self.windows)

    def describe(self) -> str:
        parts = [self.model_type]
        if self.sliding_layers:
            sizes = sorted({w for w in self.windows if w is not None})
            parts.append(f"{self.sliding_layers}/{len(self.windows)} sliding-window layers "
                         f"(window {', '.join(map(str, sizes))})")
        if self.attn_softcap:
            parts.append(f"attention soft-cap {self.attn_softcap:g}")
        return ", ".join(parts)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_windows(config: Any) -> list[int | None]:
    """Per decoder layer, the sliding window transformers' masks apply (None: full causal attention).

    With `layer_types` a layer is windowed when its type is "sliding_attention"; without, `sliding_window` applies
    to every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE build one sliding mask for all layers). Raises ValueError
    on a layer type that is not causal full or sliding attention."""
    config = _text_config(config)
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE stores 0 for "off"
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers for {layers} hidden layers")
        unknown = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer types {', '.join(unknown)}")
        if "sliding_attention" in types and not window:
            raise ValueError("sliding_attention layers without a sliding_window size")
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [int(window) if window else None] * layers


def _rope_types(config: Any) -> set[str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return set()
    if "rope_type" in params or "type" in params:
        return {str(params.get("rope_type", params.get("type")))}
    return {str(p.get("rope_type", p.get("type", "default"))) for p in params.values() if isinstance(p, dict)}


def inspect_architecture(config: Any, max_len: int | None = None) -> Architecture:
    """Classify a transformers config: native (with the per-layer attention settings) or not (with the reason).

    `max_len` is the engine's cache length: a length-dependent rotary scaling is harmless while every position
    (the scratch column included) stays within the model's original context."""
    outer = str(getattr(config, "model_type", "") or "unknown")
    config = _text_config(config)
    model_type = str(getattr(config, "model_type", "") or "unknown")
    arch = Architecture(model_type=model_type, native=False)
    if outer != model_type:
        arch.model_type = outer
        arch.reason = (f"model type '{outer}' wraps its '{model_type}' language model (a multimodal checkpoint); "
                       "copt's slot attention serves text-only checkpoints")
        return arch
    if model_type not in NATIVE_MODEL_TYPES:
        arch.reason = (f"model type '{model_type}' is not one copt's slot attention is verified for "
                       f"({', '.join(sorted(NATIVE_MODEL_TYPES))})")
        return arch
    try:
        arch.windows = layer_windows(config)
    except ValueError as exc:
        arch.reason = f"unsupported attention layout: {exc}"
        return arch
    if getattr(config, "use_bidirectional_attention", False):
        arch.reason = "bidirectional (non-causal) attention"
        return arch
    dynamic = sorted(t for t in _rope_types(config) if any(d in t for d in LENGTH_DEPENDENT_ROPE))
    if dynamic:
        original = getattr(config, "original_max_position_embeddings", None)
        params = getattr(config, "rope_parameters", None) or {}
        if isinstance(params, dict):
            original = params.get("original_max_position_embeddings", original)
        original = original or getattr(config, "max_position_embeddings", None)
        if max_len is None or original is None or max_len + 1 > int(original):
            arch.reason = (f"rotary scaling {', '.join(dynamic)} changes its frequencies with the sequence length "
                           f"(beyond {original} positions)")
            if original:
                arch.reason += (f"; a --max-model-len of at most {int(original) - 1} (less any speculative tokens) "
                                "is served by copt's attention")
            return arch
    arch.attn_softcap = getattr(config, "attn_logit_softcapping", None) or None
    arch.final_softcap = getattr(config, "final_logit_softcapping", None) or None
    arch.native = True
    return arch


def apply_to_model(model: Any, arch: Architecture, max_len: int) -> None:
    """Give every attention module its layer's window and soft-cap: `copt_window` (None where the window cannot
    bite within `max_len` cache positions: plain causal attention then), `copt_window_declared` (the config's) and
    `copt_softcap`.

    Raises RuntimeError when the decoder does not have one `self_attn` per configured layer (the settings could not
    be placed, so the slot attention must not run)."""
    decoder = model.get_decoder()
    layers = list(getattr(decoder, "layers", None) or [])
    if len(layers) != len(arch.windows):
        raise RuntimeError(f"{len(layers)} decoder layers for {len(arch.windows)} configured layers")
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "layer_idx", index) != index:
            raise RuntimeError(f"decoder layer {index} has no self_attn module of its own")
        window = arch.windows[index]
        attn.copt_window_declared = window
        attn.copt_window = window if window is not None and window < max_len else None
        attn.copt_softcap = arch.attn_softcap


def fallback_notice(model_path: str, reason: str) -> str:
    return (f"copt serve: {model_path}: {reason}. Serving it through transformers' own attention and KV cache, "
            "one sequence at a time (correct, but no batching across requests, CUDA graphs or compiled layers); "
            "--engine vllm serves it batched.")


def pages_kv_cache(arch: Architecture, kv_layout: str = "auto") -> bool:
    """Whether copt's engine keeps this model's KV cache paged: a native architecture without sliding-window layers,
    unless --kv-layout slots. The one rule the engine (loading.py) and advise (memory.kv_layout) share."""
    return kv_layout != "slots" and arch.native and not arch.sliding_layers


def make_runner(model_path: str, *, device: str, max_len: int | None, trust_remote_code: bool = False,
                **kwargs: Any) -> Any:
    """The engine's model runner: copt's slot-attention ModelRunner for a native architecture, otherwise
    fallback.TransformersRunner, announced on stderr (never a runner that would serve wrong tokens)."""
    import sys

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    arch = inspect_architecture(config, max_len)
    if arch.native:
        from clusteropt_cli.core.serve.runner import ModelRunner

        return ModelRunner(model_path, device=device, max_len=max_len, trust_remote_code=trust_remote_code, **kwargs)
    from clusteropt_cli.core.serve.fallback import TransformersRunner

    print(fallback_notice(model_path, arch.reason or "not supported"), file=sys.stderr, flush=True)
    return TransformersRunner(model_path, device=device, max_len=max_len, trust_remote_code=trust_remote_code,
                              reason=arch.reason or "", **kwargs)
