"""Recipe for copt distill (logits, traces, sft, onpolicy: the subcommand sets `mode`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from clusteropt_cli.recipe.schema.base import Prediction, TrainingOptions, raise_problems


class DistillRecipe(TrainingOptions):
    """copt distill logits / traces / sft. Training options apply to logits and sft."""

    task: Literal["distill"] = "distill"
    mode: Literal["logits", "traces", "sft", "onpolicy"] = "logits"
    teacher: str | None = Field(None, description="Teacher model directory (logits, traces).")
    student: str | None = Field(None, description="Student model directory, config.json or preset (logits, sft).")
    data: str | None = Field(None, description="logits: training text (.txt, or .jsonl with a text field).")
    eval_data: str | None = Field(None, description="logits: held-out text; KL to the teacher before/after.")
    output: str | None = Field(None, description="logits/sft: model directory; traces: the traces .jsonl.")
    # logits
    loss: Literal["forward-kl", "reverse-kl", "jsd"] = "forward-kl"
    temperature: float = Field(2.0, gt=0, description="Softmax temperature of both models; the loss is scaled by T².")
    alpha: float = Field(0.5, ge=0, le=1, description="Weight of the distillation loss; 1-alpha goes to CE.")
    top_k: PositiveInt | None = Field(None, description="Distill against the teacher's top-k tokens + a tail bucket.")
    teacher_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # onpolicy
    beta: float | None = Field(None, ge=0, le=1, description="onpolicy: generalized JSD of TRL's DistillationTrainer: "
                               "0 forward KL(teacher‖student), 1 reverse KL, 0.5 JSD (default 1.0, TRL's).")
    # traces
    prompts: str | None = Field(None, description="traces: prompts .jsonl (prompt, optional id/answer/match).")
    samples: PositiveInt = Field(4, description="traces: samples per prompt.")
    max_new_tokens: PositiveInt = Field(512, description="traces: longest trace, in tokens.")
    sample_temperature: float = Field(0.7, ge=0, description="traces: sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="traces: nucleus sampling mass.")
    verify: bool = Field(False, description="traces: keep only samples whose answer matches the prompt's answer.")
    match: Literal["exact", "numeric", "regex", "math"] | None = Field(
        None, description="traces: how answers are compared when a prompt has no `match` (default: numeric for "
                          "numbers, else exact; math: Math-Verify's symbolic comparison of LaTeX answers).")
    think: bool | None = Field(None, description=(
        "traces: have the teacher reason first. Default: the chat template's own switch (enable_thinking) when it "
        "has one, else a '<think>\\n' prefix when '<think>' is in the vocabulary, else nothing forced; true: the "
        "switch or the prefix always; false: neither."))
    gen_batch: PositiveInt = Field(64, description="traces: prompts handed to the engine at once.")
    # sft
    traces: str | None = Field(None, description="sft: traces .jsonl written by copt distill traces.")
    eval_traces: str | None = Field(None, description="sft: held-out traces; completion loss before/after.")
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _check_distill(self) -> DistillRecipe:
        problems = []
        # inputs that are files (data, prompts, traces) are checked by the command, naming its flag
        needs = {"logits": ("teacher", "student"), "traces": ("teacher",), "sft": ("student",),
                 "onpolicy": ("teacher", "student")}
        for key in needs[self.mode]:
            if not getattr(self, key):
                problems.append(f"{key}: required for distill {self.mode}")
        if self.mode == "logits" and self.alpha == 0 and self.top_k is not None:
            problems.append("top_k: with `alpha` 0 there is no distillation term to apply `top_k` to")
        raise_problems(problems)
        return self
