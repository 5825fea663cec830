"""Recipe for copt train."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from clusteropt_cli.recipe.schema.base import Prediction, TrainingOptions


class TrainRecipe(TrainingOptions):
    """copt train."""

    task: Literal["train"] = "train"
    model: str = Field(..., description="Local HF model dir (fine-tune), a config.json or a preset (scratch).")
    data: str | None = Field(None, description=".txt or .jsonl (text field), tokenized and packed to seq_len.")
    output: str | None = None
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    pipeline_stages: PositiveInt = 1
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    pipeline_micro_batches: PositiveInt | None = None
    virtual_stages: PositiveInt = 1
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_parallel(self) -> TrainRecipe:
        problems = []
        if self.zero == 3 and self.pipeline_stages > 1:
            problems.append("zero: ZeRO-3 cannot be combined with pipeline_stages > 1; use zero 0/1 with pipelines")
        if self.gradient_compression != "none" and self.zero > 0:
            problems.append("gradient_compression: DDP comm hooks apply only with zero=0")
        if self.pipeline_schedule == "interleaved-1f1b" and self.pipeline_stages > 1 and self.virtual_stages < 2:
            problems.append("virtual_stages: interleaved-1f1b needs virtual_stages >= 2")
        if self.pipeline_schedule != "interleaved-1f1b" and self.virtual_stages > 1:
            problems.append("virtual_stages: virtual stages need pipeline_schedule=interleaved-1f1b")
        if problems:
            raise ValueError("; ".join(problems))
        return self
