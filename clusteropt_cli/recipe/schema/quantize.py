"""Recipe for copt quantize."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from clusteropt_cli.recipe.schema.base import Prediction, Strict, raise_problems

# Which backend can run which method (the llm-compressor backend runs them all).
BACKEND_METHODS: dict[str, tuple[str, ...]] = {
    "llmcompressor": ("awq", "gptq", "fp8", "int8", "rtn"),
    "gptqmodel": ("awq", "gptq"),
    "auto-gptq": ("gptq",),
    "autoawq": ("awq",),
}
CALIBRATED_METHODS = ("awq", "gptq", "int8")
# llm-compressor's preset scheme names (compressed_tensors PRESET_SCHEMES) → the recipe keys they fix. W_A16 presets
# leave the algorithm (awq, gptq, rtn) to `method`.
SCHEMES: dict[str, dict] = {
    "W2A16": {"bits": 2, "group_size": 128, "symmetric": True},
    "W3A16": {"bits": 3, "group_size": 128, "symmetric": True},
    "W4A16": {"bits": 4, "group_size": 128, "symmetric": True},
    "W4A16_ASYM": {"bits": 4, "group_size": 128, "symmetric": False},
    "W8A16": {"bits": 8, "group_size": 128, "symmetric": True},
    "W8A8": {"method": "int8"},
    "INT8": {"method": "int8"},
    "FP8_DYNAMIC": {"method": "fp8"},
}


class QuantizeRecipe(Strict):
    """copt quantize."""

    task: Literal["quantize"] = "quantize"
    model: str = Field(description="Local Hugging Face model directory (with config.json).")
    output: str | None = Field(None, description="Output directory (default ./<model>-<method>-w<bits>[g<group>]).")
    scheme: str | None = Field(
        None, description="llm-compressor's preset name: W4A16, W4A16_ASYM, W8A16 (with method awq, gptq or rtn; "
        "W2A16/W3A16 too), W8A8 or INT8 (method int8), FP8_DYNAMIC (method fp8). Sets bits, group_size, symmetric "
        "(or the method); an explicit key that disagrees is an error.")
    method: Literal["awq", "gptq", "fp8", "int8", "rtn"] = "awq"
    # checked with the cross-checks below (a Literal would stop them, and report a bad bits alone)
    bits: int | None = Field(
        None, description="Weight bits: 2, 3, 4 or 8; default 4 for awq/gptq/rtn, 8 for fp8/int8."
    )
    group_size: int = Field(128, description="Columns sharing one scale; -1 for per-channel (awq/gptq/rtn).")
    symmetric: bool = Field(True, description="Symmetric integer weights (no zero point); awq/gptq/rtn.")
    calib: str | None = Field(None, description=".txt (one sample a line) or .jsonl with a text field.")
    num_samples: PositiveInt = Field(128, description="Calibration samples used (the first N of --calib).")
    seq_len: int = Field(512, ge=2, description="Tokens per calibration sample (longer ones are truncated).")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"],
                              description="Modules kept in full precision (names or re:regex).")
    backend: Literal["llmcompressor", "gptqmodel", "auto-gptq", "autoawq"] = "llmcompressor"
    eval: str | None = Field(None, description="Text file for perplexity before and after.")
    eval_tokens: PositiveInt = Field(32768, description="At most this many --eval tokens are scored.")
    compare_rtn: bool = Field(False, description="Also score round-to-nearest at the same bits (needs eval).")
    awq_duo_scaling: bool | Literal["both"] = Field(
        True, description="AWQ scale search: activation and weight magnitudes (true, llm-compressor's default), "
                          "activations only (false), or half the grid each (both).")
    awq_clip: bool | None = Field(
        None, description="After AWQ's scaling, llm-awq's clipping search: per output channel and group, the "
        "weight range (1 to 0.55 of max|w|) whose quantized weights best reproduce the group's share of the layer "
        "output on calibration inputs (q/k projections excluded); llm-compressor's AWQ has no such step. "
        "None = on for method awq on the llmcompressor backend.")
    observer: Literal["minmax", "mse", "imatrix_mse"] | None = Field(
        None, description="How integer weight scales are chosen (awq/gptq/rtn on llmcompressor): the group's "
        "min/max (minmax), a clipping-range search minimizing the weights' quantization error (mse), or the same "
        "weighted by each input channel's mean squared calibration activation (imatrix_mse; needs calibration). "
        "Default: mse for awq (with awq_clip the clipped layers' ranges come from the clipping search; the "
        "observer sets the q/k projections'), minmax otherwise. The --compare-rtn baseline of awq/gptq uses "
        "minmax.")
    prediction: Prediction | None = None

    @model_validator(mode="before")
    @classmethod
    def _apply_scheme(cls, data: object) -> object:
        if not isinstance(data, dict) or data.get("scheme") is None:
            return data
        name = str(data["scheme"]).upper()
        if name == "FP8":
            raise ValueError("scheme: FP8 is llm-compressor's static per-tensor activation scheme, which copt does "
                             "not write; use FP8_DYNAMIC (per-token activation scales, no calibration)")
        if name not in SCHEMES:
            raise ValueError(f"scheme: unknown '{data['scheme']}' (choose from {', '.join(SCHEMES)})")
        data = {**data, "scheme": name}
        fixed = dict(SCHEMES[name])
        if "bits" in fixed and data.get("method") in ("fp8", "int8"):
            raise ValueError(f"scheme: {name} is weight-only; `method` {data['method']} writes W8A8 (use `method` "
                             "awq, gptq or rtn, or `scheme` W8A8/FP8_DYNAMIC)")
        clashes = [f"`{key}`={data[key]}" for key, value in fixed.items()
                   if data.get(key) is not None and data[key] != value]
        if clashes:
            raise ValueError(f"scheme: {name} sets {', '.join(f'{k}={v}' for k, v in fixed.items())}; "
                             f"it disagrees with {', '.join(clashes)}")
        return {**data, **fixed}

    @model_validator(mode="after")
    def _check_bits(self) -> QuantizeRecipe:
        problems = []
        if self.bits not in (None, 2, 3, 4, 8):
            problems.append(f"bits: must be 2, 3, 4 or 8 (got {self.bits})")
        elif self.method in ("fp8", "int8") and self.bits not in (None, 8):
            chosen = f"`scheme` {self.scheme}" if self.scheme else f"`method` {self.method}"
            problems.append(f"bits: {chosen} writes 8-bit weights (W8A8), so `bits` must be 8 (got {self.bits}): "
                            f"leave `bits` out, or use `method` awq, gptq or rtn for {self.bits}-bit weights")
        if self.group_size == 0 or self.group_size < -1:
            problems.append("group_size: must be positive or -1 (per-channel)")
        if self.method not in BACKEND_METHODS[self.backend]:
            problems.append(f"backend: {self.backend} does not run `method` {self.method} "
                            f"(it runs {', '.join(BACKEND_METHODS[self.backend])}; llmcompressor runs all)")
        if self.awq_duo_scaling is not True and not self.llmcompressor_awq:
            problems.append("awq_duo_scaling: applies to `method` awq on the llmcompressor `backend` only")
        if self.awq_clip and not self.llmcompressor_awq:
            problems.append("awq_clip: applies to `method` awq on the llmcompressor `backend` only")
        if self.observer not in (None, "minmax") and (self.method not in ("awq", "gptq", "rtn")
                                                      or self.backend != "llmcompressor"):
            problems.append("observer: applies to integer weights (`method` awq, gptq, rtn) on the llmcompressor "
                            "`backend` only")
        elif self.observer == "imatrix_mse" and self.method == "rtn":
            problems.append("observer: imatrix_mse weighs by calibration activations; rtn runs none (use mse, or "
                            "`method` awq/gptq)")
        if self.compare_rtn and not self.eval:
            problems.append("compare_rtn: needs `eval` (a text file to measure perplexity on)")
        raise_problems(problems)
        return self

    @property
    def weight_bits(self) -> int:
        return self.bits or (8 if self.method in ("fp8", "int8") else 4)

    @property
    def weight_observer(self) -> str | None:
        """The observer llm-compressor's integer weight schemes use (None where it does not apply)."""
        if self.backend != "llmcompressor" or self.method not in ("awq", "gptq", "rtn"):
            return None
        if self.observer is not None:
            return self.observer
        return "mse" if self.method == "awq" else "minmax"

    @property
    def llmcompressor_awq(self) -> bool:
        """AWQ through llm-compressor (where awq_duo_scaling and awq_clip apply)."""
        return self.method == "awq" and self.backend == "llmcompressor"

    @property
    def clip_search(self) -> bool:
        """Whether llm-awq's clipping search runs after AWQ (awq_clip; None = on for awq on llmcompressor)."""
        return self.llmcompressor_awq and self.awq_clip is not False

    @property
    def needs_calibration(self) -> bool:
        return self.method in CALIBRATED_METHODS
