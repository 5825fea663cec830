"""Mixture-of-experts layers that CUDA graphs can capture in every dtype.

transformers 5 runs a MoE model's experts through `experts_implementation` (default `grouped_mm`). On CUDA in bf16
its grouped GEMM takes the per-expert offsets as a device tensor (histc/cumsum, written to be captured). In fp32 and
fp16 it falls back to a loop over `offsets.tolist()` (compiled or not): a host sync that graph capture refuses, so
the engine decoded such models without graphs. copt's implementation ("copt") keeps transformers' path for bf16 and
for anything larger than a decode step, and computes the other decode steps densely: every expert on every row, each
row's output weighted by its routing weights (zero for the experts it did not pick). A decode step of a few rows
reads every expert's weights either way once the rows pick most of the experts; the dense form costs E/k times the
routed FLOPs, which a memory-bound decode step of up to a few hundred rows hides.
"""

from __future__ import annotations

from typing import Any

IMPLEMENTATION = "copt"


def dense_experts_forward(experts: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts' output for rows [T, H] routed to top_k_index [T, k] with top_k_weights [T, k], computed for
    every expert with static shapes (no host sync, no data-dependent shapes)."""
    import torch

    num_experts = int(experts.num_experts)
    rows = hidden_states.shape[0]
    picked = top_k_index < num_experts  # expert-parallel sentinels (>= num_experts) contribute nothing
    routing = torch.zeros(rows, num_experts, dtype=torch.float32, device=hidden_states.device)
    routing.scatter_add_(1, top_k_index.clamp(max=num_experts - 1),
                         top_k_weights.float() * picked.to(torch.float32))
    transposed = bool(getattr(experts, "is_transposed", False))
    has_bias = bool(getattr(experts, "has_bias", False))
    has_gate = bool(getattr(experts, "has_gate", True))
    up_weight = experts.gate_up_proj if has_gate else experts.up_proj
    inputs = hidden_states.to(up_weight.dtype).unsqueeze(0).expand(num_experts, rows, hidden_states.shape[-1])
    up = torch.bmm(inputs, up_weight if transposed else up_weight.transpose(1, 2))  # [E, T, 2I] or [E, T, I]
    if has_bias:
        up = up + (experts.gate_up_proj_bias if has_gate else experts.up_proj_bias).unsqueeze(1)
    up = experts._apply_gate(up) if has_gate else experts.act_fn(up)
    down = torch.bmm(up, experts.down_proj if transposed else experts.down_proj.transpose(1, 2))  # [E, T, H]
    if has_bias:
        down = down + experts.down_proj_bias.unsqueeze(1)
    out = torch.einsum("eth,te->th", down.float(), routing)
    return out.to(hidden_states.dtype)


def grouped_gemm_on_device(dtype: Any, device_type: str) -> bool:
    """Whether transformers' grouped GEMM keeps its routing on the device (bf16 on CUDA); otherwise it reads the
    per-expert offsets on the host, which CUDA graph capture refuses."""
    import torch

    return dtype == torch.bfloat16 and device_type == "cuda"


def copt_experts_forward(experts: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """transformers' grouped GEMM in bf16 and for rows beyond `experts.copt_dense_rows` (prefill chunks);
    the dense form for the other steps (decode steps the engine captures in CUDA graphs)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    dense_rows = int(getattr(experts, "copt_dense_rows", 0) or 0)
    weight = experts.gate_up_proj if getattr(experts, "has_gate", True) else experts.up_proj
    if grouped_gemm_on_device(weight.dtype, weight.device.type) or hidden_states.shape[0] > dense_rows:
        return grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
    return dense_experts_forward(experts, hidden_states, top_k_index, top_k_weights)


def experts_modules(model: Any) -> list[Any]:
    """The modules of `model` that dispatch through transformers' experts interface (3-D expert weights)."""
    import torch

    return [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "_apply_gate")
            and isinstance(getattr(m, "down_proj", None), torch.Tensor) and m.down_proj.dim() == 3]


def use_capturable_experts(model: Any, dense_rows: int) -> int:
    """Route `model`'s experts through copt's implementation, dense up to `dense_rows` rows (0: never dense);
    returns how many expert modules it applies to (0: not a MoE model, or experts transformers does not dispatch)."""
    modules = experts_modules(model)
    if not modules:
        return 0
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        type(ALL_EXPERTS_FUNCTIONS).register(IMPLEMENTATION, copt_experts_forward)
    for module in modules:
        module.copt_dense_rows = int(dense_rows)
        config = getattr(module, "config", None)
        if config is not None:
            config._experts_implementation = IMPLEMENTATION
    return len(modules)
