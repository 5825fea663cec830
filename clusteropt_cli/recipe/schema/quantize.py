"""Recipe for copt quantize."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from clusteropt_cli.recipe.schema.base import Prediction, Strict


class QuantizeRecipe(Strict):
    """copt quantize."""

    task: Literal["quantize"] = "quantize"
    model: str
    output: str | None = None
    method: Literal["awq", "gptq", "fp8", "int8", "rtn"] = "awq"
    bits: Literal[2, 3, 4, 8] | None = Field(
        None, description="Weight bits; default 4 for awq/gptq/rtn, 8 for fp8/int8."
    )
    group_size: int = Field(128, description="Columns sharing one scale; -1 for per-channel.")
    symmetric: bool = True
    calib: str | None = Field(None, description=".txt (one sample a line) or .jsonl with a text field.")
    num_samples: PositiveInt = 128
    seq_len: PositiveInt = 512
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    backend: Literal["llmcompressor", "gptqmodel", "auto-gptq", "autoawq"] = "llmcompressor"
    eval: str | None = Field(None, description="Text file for perplexity before and after.")
    compare_rtn: bool = False
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_bits(self) -> QuantizeRecipe:
        if self.method in ("fp8", "int8") and self.bits not in (None, 8):
            raise ValueError(f"bits: method {self.method} is W8A8; bits must be 8 (got {self.bits})")
        if self.group_size == 0 or self.group_size < -1:
            raise ValueError("group_size: must be positive or -1 (per-channel)")
        return self

    @property
    def weight_bits(self) -> int:
        return self.bits or (8 if self.method in ("fp8", "int8") else 4)
