"""Can vLLM serve the checkpoint these settings write? Checked before any work, repeated in the report.

From vLLM's kernels (vllm/model_executor/layers/quantization, read at 0.33): compressed-tensors W_A16 checkpoints run
on the Marlin kernels (MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128]; symmetric uint4b8/uint8b128 = 4 or 8 bits,
with a zero point only uint4 = 4 bits). GPTQ checkpoints go through gptq/gptq_marlin (2, 3, 4 or 8 bits); AWQ
checkpoints through awq/awq_marlin (4 bits). FP8_DYNAMIC and int8 W8A8 are vLLM's own compressed-tensors schemes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

MARLIN_GROUP_SIZES = (-1, 32, 64, 128)


@dataclass(frozen=True)
class Servability:
    servable: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        return f"{'yes' if self.servable else 'no'} ({self.reason})"


def vllm_servability(settings: QuantizeRecipe) -> Servability:
    """Whether vLLM loads and runs the checkpoint a QuantizeRecipe writes, and why (not)."""
    method, bits, group = settings.method, settings.weight_bits, settings.group_size
    if method == "fp8":
        return Servability(True, "compressed-tensors FP8_DYNAMIC; FP8 GEMMs on compute capability >= 8.9, "
                                 "weight-only FP8 Marlin below")
    if method == "int8":
        return Servability(True, "compressed-tensors W8A8 int8 (compute capability >= 7.5)")
    if settings.backend != "llmcompressor":
        fmt = "GPTQ" if method == "gptq" else "AWQ"
        allowed = (2, 3, 4, 8) if fmt == "GPTQ" else (4,)
        if bits not in allowed:
            return Servability(False, f"vLLM's {fmt} kernels take {' or '.join(map(str, allowed))} bits, "
                                      f"not {bits}")
        marlin = bits in (4, 8) and group in MARLIN_GROUP_SIZES and (fmt == "AWQ" or settings.symmetric)
        return Servability(True, f"{fmt} format, {'Marlin' if marlin else f'its plain {fmt} (slower)'} kernels")
    # compressed-tensors W{bits}A16 (pack-quantized), llm-compressor's awq/gptq/rtn
    if bits not in (4, 8):
        return Servability(False, f"{bits}-bit weights: vLLM's compressed-tensors W_A16 kernels take 4 or 8 bits "
                                  "(use --bits 4 or 8)")
    if group not in MARLIN_GROUP_SIZES:
        return Servability(False, f"group size {group}: vLLM's W_A16 (Marlin) kernels take -1, 32, 64 or 128")
    if not settings.symmetric and bits != 4:
        return Servability(False, f"asymmetric {bits}-bit weights: vLLM's zero-point W_A16 kernels take 4 bits "
                                  "(use --symmetric or --bits 4)")
    return Servability(True, f"compressed-tensors W{bits}A16{'' if settings.symmetric else '_ASYM'}, "
                             f"{'per-channel' if group == -1 else f'group {group}'}, Marlin kernels")
