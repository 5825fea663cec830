"""Run FP8 (W8A8) checkpoints with FP8 matmuls.

transformers loads a compressed-tensors FP8 checkpoint (`copt quantize --method fp8`, llm-compressor's FP8_DYNAMIC:
e4m3 weights with one scale per output channel, activations quantized per token at run time) as `nn.Linear`
modules whose forward is wrapped to *fake*-quantize: the weight is dequantized to bf16 on every call and the matmul
runs in bf16 — slower than the bf16 model. `swap_fp8_linears` replaces those modules with `Fp8Linear`, which keeps
the e4m3 weight and calls `torch._scaled_mm` (cuBLASLt FP8 GEMM, row-wise scales) on GPUs with FP8 tensor cores
(compute capability ≥ 8.9), as vLLM's W8A8 path does. On other devices it computes the same quantized product in
fp32 (an exact emulation, for tests and CPUs).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_matmul_supported(device: Any) -> bool:
    """True where torch._scaled_mm runs FP8 GEMMs: CUDA with compute capability ≥ 8.9."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_per_token(x2):
    """[tokens, K] → (e4m3 values, fp32 scales [tokens, 1]): symmetric, one scale per row (FP8_DYNAMIC)."""
    import torch

    scale = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x2.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@lru_cache(maxsize=1)
def _compiled_quantize_per_token():
    """The per-token quantization as one fused kernel (eager it is ~7 kernels and fp32 copies per linear: measured
    on the H200 to make the FP8 linears 2–3.4× slower than bf16 even inside CUDA graphs)."""
    import torch

    return torch.compile(quantize_per_token, dynamic=True)


@lru_cache(maxsize=1)  # one class: a new class per layer would make torch.compile specialize on each layer's type
def _fp8_linear_class():
    import torch

    class Fp8Linear(torch.nn.Module):
        """y = dequant(q(x)) @ dequant(W)ᵀ with e4m3 weights (per-channel scale) and per-token e4m3 activations."""

        def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                     use_scaled_mm: bool):
            super().__init__()
            if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
                raise ValueError(f"Fp8Linear needs a 2-D float8_e4m3fn weight, got {weight.dtype} "
                                 f"{tuple(weight.shape)}")
            self.out_features, self.in_features = weight.shape
            self.register_buffer("weight", weight.contiguous())  # [out, in]; .t() is the column-major B operand
            self.register_buffer("weight_scale", weight_scale.detach().float().reshape(1, -1).contiguous())
            self.register_buffer("bias", None if bias is None else bias.detach())
            # cuBLASLt FP8 needs in/out features divisible by 16
            self.use_scaled_mm = bool(use_scaled_mm) and self.in_features % 16 == 0 and self.out_features % 16 == 0
            # the emulation's fp32 weight, dequantized once (not on every call: that made a CPU decode step of a
            # 30-layer model 13x slower than the same model's dequantized W4 checkpoint); the same product
            self.register_buffer("weight_dequantized", None if self.use_scaled_mm else
                                 (self.weight.float() * self.weight_scale.reshape(-1, 1)).contiguous(),
                                 persistent=False)

        def extra_repr(self) -> str:
            return (f"in_features={self.in_features}, out_features={self.out_features}, "
                    f"kernel={'scaled_mm' if self.use_scaled_mm else 'emulated'}")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            x2 = x.reshape(-1, self.in_features)
            if self.use_scaled_mm and not torch.compiler.is_compiling():
                xq, scale_a = _compiled_quantize_per_token()(x2)
            else:  # inside a compiled decode graph inductor fuses it anyway; on CPU the plain ops
                xq, scale_a = quantize_per_token(x2)
            out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            if self.use_scaled_mm:
                y = torch._scaled_mm(xq, self.weight.t(), scale_a=scale_a, scale_b=self.weight_scale,
                                     out_dtype=out_dtype)
            else:
                y = (xq.float() * scale_a) @ self.weight_dequantized.t()
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    return Fp8Linear


def fp8_linear(weight, weight_scale, bias=None, use_scaled_mm: bool | None = None):
    """One Fp8Linear (FP8 GEMM where the weight's device supports it, else the fp32 emulation)."""
    if use_scaled_mm is None:
        use_scaled_mm = fp8_matmul_supported(weight.device)
    return _fp8_linear_class()(weight, weight_scale, bias, use_scaled_mm)


def is_fp8_checkpoint_linear(module: Any) -> bool:
    """An nn.Linear as transformers loads it from a compressed-tensors FP8 checkpoint."""
    import torch

    weight = getattr(module, "weight", None)
    scale = getattr(module, "weight_scale", None)
    return (isinstance(module, torch.nn.Linear) and weight is not None and weight.dtype == torch.float8_e4m3fn
            and scale is not None and scale.numel() in (1, weight.shape[0]))


def swap_fp8_linears(model: Any, use_scaled_mm: bool | None = None) -> int:
    """Replace every FP8 checkpoint Linear in `model` with an Fp8Linear (in place); returns how many."""
    import torch

    targets = [(name, module) for name, module in model.named_modules() if is_fp8_checkpoint_linear(module)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        scale = module.weight_scale.detach()
        if scale.numel() == 1:  # per-tensor scale: the same for every output channel
            scale = scale.reshape(1).expand(module.weight.shape[0])
        with torch.no_grad():
            replacement = fp8_linear(module.weight.detach(), scale, module.bias, use_scaled_mm)
        setattr(parent, child, replacement)
    return len(targets)
