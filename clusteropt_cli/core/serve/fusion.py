"""Merged projections for serving: q/k/v and gate/up each run as one GEMM, as vLLM's QKVParallelLinear and
MergedColumnParallelLinear do.

The model code stays transformers': each projection module is replaced by a slice of a group that holds the
concatenated weight. The first projection of a group called in a forward runs the single GEMM over the shared
input; the others return their columns of that output (the output is keyed by the input object, so a call on
another input recomputes). Every layer of the Llama family calls q, k and v (and gate and up) on the same input,
one after another, which is what makes this exact.

Why: a batch-1 decode step is a chain of matrix-vector products bound by memory bandwidth, and small ones reach
less of it. On the H200 the 112 GEMVs + LM head of the Llama-3.2-1B shape took 1.060 ms as a CUDA graph (55% of
the copy bandwidth) and the 64 merged ones 0.835 ms (70%), the same bytes (bench/gpu_decode_b1.py, 2026-11-30).
"""

from __future__ import annotations

from typing import Any

# (submodule of a decoder layer, the projections that read the same input, in call order)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
# architectures whose every layer calls each group's projections once per forward on one input (a layer that
# skipped one, e.g. KV-sharing layers, would leave a stale output behind)
# (MoE layers have no gate_proj/up_proj of their own: only their attention merges; Phi-3 ships merged projections)
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral",
                         "qwen2_moe", "qwen3_moe"})


def _group_class():
    import torch
    import torch.nn.functional as F

    class ProjectionGroup(torch.nn.Module):
        """Concatenated weights of linears that share their input; `take(i, x)` returns linear i's output."""

        def __init__(self, linears: list[Any]) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.cat([m.weight.data for m in linears]), requires_grad=False)
            biases = [m.bias for m in linears]
            self.bias = None if biases[0] is None else torch.nn.Parameter(torch.cat([b.data for b in biases]),
                                                                          requires_grad=False)
            bounds, start = [], 0
            for m in linears:
                bounds.append((start, start + m.out_features))
                start += m.out_features
            self.bounds = bounds
            self.members = len(linears)
            self.pending = 0  # members still to read the last output
            self.input = self.output = None

        def take(self, index: int, x: Any) -> Any:
            # keyed by the input object: a forward that stopped half-way (an exception) or skipped a member can
            # never hand a stale output to the next one
            if self.output is None or self.input is not x:
                self.output = F.linear(x, self.weight, self.bias)
                self.input = x
                self.pending = self.members
            out = self.output
            self.pending -= 1
            if self.pending == 0:
                self.input = self.output = None  # keep no activation alive between forwards
            start, end = self.bounds[index]
            return out[..., start:end]

    class ProjectionSlice(torch.nn.Module):
        """Stands in for one projection of a group (same call signature as the nn.Linear it replaces)."""

        def __init__(self, group: ProjectionGroup, index: int, in_features: int, out_features: int) -> None:
            super().__init__()
            self.group = group
            self.index = index
            self.in_features, self.out_features = in_features, out_features

        def forward(self, x: Any) -> Any:
            return self.group.take(self.index, x)

    return ProjectionGroup, ProjectionSlice


def mergeable(module: Any) -> bool:
    """A plain nn.Linear whose forward is F.linear on a dense floating-point weight: not an FP8 layer, not a
    compressed-tensors layer that still holds packed/int weights, quantizes its weight in the forward (fake-quant
    checkpoints) or quantizes its input activations (INT8 W8A8): merging those would skip that work."""
    import torch

    if type(module) is not torch.nn.Linear:
        return False
    weight = getattr(module, "weight", None)  # packed compressed-tensors layers have none
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.element_size() < 2:
        return False
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is None:
        return True
    status = getattr(module, "quantization_status", None)
    return (str(getattr(status, "value", status)) == "decompressed" and scheme.input_activations is None
            and scheme.output_activations is None)


def fuse_projections(model: Any) -> int:
    """Merge q/k/v and gate/up of every decoder layer where all of them are `mergeable` with one input size,
    dtype and device (FP8 and activation-quantized layers stay as they are). Returns the number of groups merged."""

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return 0
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None) or []
    group_cls, slice_cls = _group_class()
    merged = 0
    for layer in layers:
        for parent_name, names in GROUPS:
            parent = getattr(layer, parent_name, None)
            linears = [getattr(parent, name, None) for name in names] if parent is not None else []
            if not linears or not all(mergeable(m) for m in linears):
                continue
            if len({(m.in_features, m.weight.dtype, m.weight.device) for m in linears}) != 1:
                continue
            if len({m.bias is None for m in linears}) != 1:
                continue
            group = group_cls(linears)
            for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
                setattr(parent, name, slice_cls(group, index, linear.in_features, linear.out_features))
            merged += 1
    return merged
