"""Quantized checkpoints in copt's engine: what runs on which kernel, decided once at load time.

transformers loads a compressed-tensors checkpoint (every format `copt quantize` writes) with its weights still
compressed — int4/int3 packed into int32 (`weight_packed`), int8 or e4m3 values with scales — and registers a
forward pre-hook on the *top-level* model that decompresses every layer in place on its first forward. copt's
engine calls the decoder directly, so that hook never runs: the layers would have no `.weight` at all (packed) or an
int8 one that the float input cannot multiply. `prepare_quantized_model` does that work explicitly, before the
projections are merged:

* FP8 (W8A8, FP8_DYNAMIC): `Fp8Linear` — FP8 GEMMs on GPUs with FP8 tensor cores, the exact emulation elsewhere
  (fp8_linear.py);
* packed integer weights (W4A16/W3A16/W8A16, AWQ/GPTQ/RTN): dequantized to the serving dtype with compressed-tensors'
  own decompressor — the same tensors transformers computes on its first forward, so greedy tokens match `generate`.
  copt's engine has no packed-integer GEMM kernel; the weights then take full-precision memory, and the engine says
  so on stderr (vLLM runs them on Marlin/Machete kernels: `--engine vllm`);
* INT8 W8A8 (SmoothQuant + GPTQ): weights dequantized the same way; the activations keep compressed-tensors'
  per-token int8 quantize-dequantize in each layer's forward, as transformers runs them (no int8 GEMM here either).

Layers that quantize their input activations keep their own forward and are never merged (fusion.py merges plain
`nn.Linear` layers with a dense weight only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class QuantizedLayers:
    """What prepare_quantized_model found and did (for the start-up notice and the server's info)."""

    fp8_linears: int = 0
    fp8_kernels: bool = False
    dequantized: int = 0  # integer-weight layers dequantized to the serving dtype
    activation_quantized: int = 0  # of those, layers that quantize their input per token at run time
    formats: list[str] = field(default_factory=list)  # e.g. "W4A16 int g64 (pack-quantized)"
    extra_bytes: int = 0  # memory the dequantized weights take beyond their stored size

    def notice(self, model_path: str, dtype_name: str) -> str | None:
        """One stderr line when weights run dequantized (None when nothing was)."""
        if not self.dequantized:
            return None
        what = ", ".join(self.formats)
        act = (f"; {self.activation_quantized} of them keep per-token int8 activation quantize-dequantize"
               if self.activation_quantized else "")
        return (f"copt serve: {model_path}: {self.dequantized} quantized linear layers ({what}) dequantized to "
                f"{dtype_name} at load (+{self.extra_bytes / 2**30:.2f} GiB), the tensors transformers computes; "
                f"copt's engine has no integer GEMM kernel{act}. --engine vllm runs them on packed kernels.")


def _scheme_name(scheme: Any) -> str:
    weights = scheme.weights
    acts = scheme.input_activations
    a_bits = f"A{acts.num_bits}" if acts is not None else "A16"
    group = weights.strategy.value if hasattr(weights.strategy, "value") else str(weights.strategy)
    if group == "group" and weights.group_size:
        group = f"g{weights.group_size}"
    fmt = scheme.format.value if hasattr(scheme.format, "value") else scheme.format
    kind = weights.type.value if hasattr(weights.type, "value") else weights.type
    return f"W{weights.num_bits}{a_bits} {kind} {group}" + (f" ({fmt})" if fmt else "")


def is_compressed_linear(module: Any) -> bool:
    """A layer transformers loaded from a compressed-tensors checkpoint that still holds its compressed weights."""
    scheme = getattr(module, "quantization_scheme", None)
    status = getattr(module, "quantization_status", None)
    return scheme is not None and getattr(scheme, "weights", None) is not None and str(
        getattr(status, "value", status)) == "compressed"


def prepare_quantized_model(model: Any, dtype: Any) -> QuantizedLayers:
    """Make every quantized layer of a freshly loaded model runnable by a direct decoder call (see the module
    docstring); returns what was done. A model without quantized layers is left as it is."""
    import torch

    from clusteropt_cli.core.serve.fp8_linear import swap_fp8_linears

    found = QuantizedLayers()
    # FP8 first: its layers become Fp8Linear (no compressed-tensors scheme left), so they are never dequantized
    found.fp8_linears = swap_fp8_linears(model)
    found.fp8_kernels = any(getattr(m, "use_scaled_mm", False) for m in model.modules())
    targets = [m for m in model.modules() if is_compressed_linear(m)]
    if targets:
        from compressed_tensors.compressors.base import decompress_module

        formats: dict[str, None] = {}
        for module in targets:
            scheme = module.quantization_scheme
            formats[_scheme_name(scheme)] = None
            stored = sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
            with torch.no_grad():
                decompress_module(module)
                module.weight.data = module.weight.data.to(dtype)
            module.weight.requires_grad_(False)
            found.extra_bytes += module.weight.numel() * module.weight.element_size() - stored
            found.dequantized += 1
            if scheme.input_activations is not None:
                found.activation_quantized += 1
        found.formats = list(formats)
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:  # everything it would decompress is decompressed (or FP8 and swapped)
        hook.remove()
        del model.ct_decompress_hook
    return found
