"""Recipe for copt train."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from clusteropt_cli.recipe.schema.base import Prediction, TrainingOptions, raise_problems


class TrainRecipe(TrainingOptions):
    """copt train."""

    task: Literal["train"] = "train"
    model: str = Field(..., description="Local HF model dir (fine-tune), a config.json or a preset (scratch).")
    data: str | None = Field(None, description=".txt or .jsonl (text field), tokenized and packed to seq_len.")
    tokenizer: str | None = Field(None, description="Tokenizer dir (default: the model dir; needed from a config).")
    text_field: str = Field("text", description="Field of each .jsonl row that holds the text.")
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
            problems.append("zero: ZeRO-3 cannot be combined with `pipeline_stages` > 1; use `zero` 0 with pipelines")
        elif self.zero > 0 and self.pipeline_stages > 1:
            problems.append("zero: copt's pipeline engine runs without ZeRO; set `zero` 0 with `pipeline_stages` > 1")
        if self.pipeline_stages > 1 and self.precision not in ("fp32", "bf16"):
            problems.append("precision: pipeline parallelism runs in fp32 or bf16 (no loss scaling across stages)")
        if self.pipeline_stages > 1 and self.gpus * self.nodes != self.pipeline_stages:
            problems.append(f"pipeline_stages: {self.pipeline_stages} stages need `gpus` × `nodes` = "
                            f"{self.pipeline_stages} processes (one stage per rank), not {self.gpus * self.nodes}")
        if self.pipeline_stages > 1 and self.pipeline_micro_batches and \
                (self.micro_batch * self.grad_accum) % self.pipeline_micro_batches:
            problems.append(f"pipeline_micro_batches: `micro_batch` × `grad_accum` = "
                            f"{self.micro_batch * self.grad_accum} sequences per step must split evenly into "
                            f"{self.pipeline_micro_batches} micro-batches")
        if self.gradient_compression != "none" and self.zero > 0:
            problems.append("gradient_compression: DDP comm hooks apply only with `zero` 0")
        if self.pipeline_schedule == "interleaved-1f1b" and self.pipeline_stages > 1 and self.virtual_stages < 2:
            problems.append("virtual_stages: interleaved-1f1b needs `virtual_stages` >= 2")
        if self.pipeline_schedule != "interleaved-1f1b" and self.virtual_stages > 1:
            problems.append("virtual_stages: virtual stages need `pipeline_schedule` interleaved-1f1b")
        raise_problems(problems)
        return self
