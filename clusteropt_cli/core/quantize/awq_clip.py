"""AWQ's weight-clipping search (llm-awq's and AutoAWQ's `auto_clip`), which llm-compressor's AWQModifier leaves out.

After the activation-aware scaling, for every quantized linear except the attention query/key projections (their
errors are amplified by the softmax; llm-awq skips them too), search per output channel and group the clipping of
the weight range, max|w| × (1, 0.95, …, 0.55), whose quantized weights give the smallest error of that group's
contribution to the layer's output on calibration inputs; clamp the weights there and recompute the group's
scale and zero point from the clamped range. The checkpoint format does not change.

    stats = apply_awq_clip(model, calib_ids)       # after llm-compressor's oneshot, before saving
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

N_GRID = 20  # llm-awq: ratios 1 - i / 20 ...
MAX_SHRINK = 0.5  # ... for i < 0.5 × 20: down to 0.55
SAMPLE_TOKENS = 512  # calibration tokens per layer for the search (llm-awq: n_sample_token=512)
SAMPLE_TEXTS = 8  # calibration samples they are drawn from, evenly spaced (one forward pass each)
OUT_CHANNEL_BATCH = 256  # output channels searched at once (bounds the [channels, tokens, groups] buffers)
SKIP_NAMES = ("q_proj", "k_proj", "query", "key", "qkv_proj", "c_attn", "Wqkv")


def clip_targets(model: Any) -> dict[str, Any]:
    """Quantized integer-weight linears the search applies to (name → module)."""
    import torch

    targets = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        weights = getattr(scheme, "weights", None) if scheme is not None else None
        if not isinstance(module, torch.nn.Linear) or weights is None or weights.type != "int":
            continue
        if any(part in name.split(".")[-1] for part in SKIP_NAMES):
            continue
        targets[name] = module
    return targets


def collect_inputs(model: Any, targets: dict[str, Any], calib_ids: list[list[int]],
                   sample_tokens: int = SAMPLE_TOKENS) -> dict[str, Any]:
    """Every target's input rows at evenly spaced positions of the calibration tokens (about sample_tokens of
    them), from forward passes over up to SAMPLE_TEXTS evenly spaced samples through the model as llm-compressor
    left it (earlier layers quantized, as at inference)."""
    import torch

    if len(calib_ids) > SAMPLE_TEXTS:
        calib_ids = [calib_ids[i * len(calib_ids) // SAMPLE_TEXTS] for i in range(SAMPLE_TEXTS)]
    total = sum(len(ids) for ids in calib_ids)
    stride = max(1, total // sample_tokens)
    rows: dict[str, list[Any]] = {name: [] for name in targets}
    position = {"offset": 0}

    def hook_for(name: str) -> Callable[..., None]:
        def hook(_module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            start = (-position["offset"]) % stride
            rows[name].append(x[start::stride].float().cpu())
        return hook

    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in targets.items()]
    device = _input_device(model)
    try:
        with torch.no_grad():
            for ids in calib_ids:
                model(input_ids=torch.tensor([ids], device=device), use_cache=False)
                position["offset"] += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(parts)[:sample_tokens] for name, parts in rows.items() if parts}


def _input_device(model: Any) -> Any:
    """Where the input ids go (the embedding's execution device, also when llm-compressor offloaded it)."""
    try:
        from compressed_tensors.offload import get_execution_device

        return get_execution_device(model.get_input_embeddings())
    except (ImportError, AttributeError):
        return next(model.parameters()).device


def _fake_quantize(w: Any, args: Any) -> Any:
    """Round-to-nearest of w [channels, groups, group_size] with each group's min/max qparams (as the min/max
    observer and compressed-tensors' quantizer compute them)."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams, calculate_range

    scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
    q_min, q_max = calculate_range(args, w.device)
    scale, zero = scale.unsqueeze(-1), zero.unsqueeze(-1).to(w.dtype)
    q = torch.clamp(torch.round(w / scale) + zero, q_min, q_max)
    return (q - zero) * scale


def search_clip(weight: Any, inputs: Any, args: Any) -> Any:
    """The best max|w| per (output channel, group): [channels, groups, 1]."""
    import torch

    out_features, in_features = weight.shape
    group = args.group_size if args.group_size and args.group_size > 0 else in_features
    n_groups = in_features // group
    x = inputs.to(weight.device, torch.float32).view(-1, n_groups, group)  # [tokens, groups, group]
    best_all = []
    for start in range(0, out_features, OUT_CHANNEL_BATCH):
        w = weight[start : start + OUT_CHANNEL_BATCH].float().view(-1, n_groups, group)
        reference = torch.einsum("tgk,cgk->ctg", x, w)  # each group's share of each output
        max_abs = w.abs().amax(-1, keepdim=True)
        best, best_err = max_abs.clone(), torch.full(max_abs.shape, float("inf"), device=w.device)
        for step in range(int(MAX_SHRINK * N_GRID)):
            limit = max_abs * (1 - step / N_GRID)
            q = _fake_quantize(torch.clamp(w, -limit, limit), args)
            err = (torch.einsum("tgk,cgk->ctg", x, q) - reference).pow(2).mean(1).unsqueeze(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, limit, best)
        best_all.append(best)
    return torch.cat(best_all)


def clip_module(module: Any, inputs: Any) -> float:
    """Search, clamp the weights and rewrite weight_scale/weight_zero_point; returns the mean clip ratio."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils import align_module_device, update_offload_parameter

    args = module.quantization_scheme.weights
    with align_module_device(module):
        weight = module.weight.detach()
        out_features, in_features = weight.shape
        group = args.group_size if args.group_size and args.group_size > 0 else in_features
        limit = search_clip(weight, inputs, args)
        w = weight.float().view(out_features, in_features // group, group)
        ratio = float((limit / w.abs().amax(-1, keepdim=True).clamp(min=1e-12)).mean())
        clamped = torch.clamp(w, -limit, limit)
        scale, zero = calculate_qparams(clamped.amin(-1), clamped.amax(-1), args)
        old_scale, old_zero = module.weight_scale, module.weight_zero_point
        new_weight = clamped.view(out_features, in_features).to(weight.dtype)
        new_scale = scale.to(old_scale.dtype).view(old_scale.shape)
        new_zero = zero.to(old_zero.dtype).view(old_zero.shape)
    update_offload_parameter(module, "weight", new_weight)
    update_offload_parameter(module, "weight_scale", new_scale)
    update_offload_parameter(module, "weight_zero_point", new_zero)
    return ratio


def apply_awq_clip(model: Any, calib_ids: list[list[int]],
                   progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the search on every target of `model` (quantized by llm-compressor, not yet saved)."""
    targets = clip_targets(model)
    if not targets or not calib_ids:
        return {"layers": 0}
    inputs = collect_inputs(model, targets, calib_ids)
    ratios = []
    for i, (name, module) in enumerate(targets.items()):
        if name in inputs:
            ratios.append(clip_module(module, inputs[name]))
        if progress is not None:
            progress("awq: clipping search", i + 1, len(targets))
    return {"layers": len(ratios), "mean_clip_ratio": sum(ratios) / len(ratios) if ratios else None,
            "sample_tokens": min(SAMPLE_TOKENS, sum(len(ids) for ids in calib_ids))}
