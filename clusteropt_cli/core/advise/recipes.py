"""advise's plans as copt recipes, and the complete commands that run them.

One source of truth: a training plan is written as the `copt train` recipe (TrainRecipe) that runs it, an inference
plan as the `copt serve` recipe (ServeRecipe); `--emit-recipe` writes these dicts and every command advise prints
is derived from the same dicts (the recipe's non-default fields as the subcommand's own flags). Inputs advise
cannot know are named by the placeholders in PLACEHOLDERS.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from clusteropt_cli.core.advise.plan import InferPlan, Target, TrainPlan
from clusteropt_cli.core.serve.kv_budget import DEFAULT_MAX_BATCH_SIZE

# what the user supplies; each appears verbatim in a printed command when advise was not told
DATA_PLACEHOLDER = "DATA.txt"
TOKENIZER_PLACEHOLDER = "TOKENIZER_DIR"
PROMPTS_PLACEHOLDER = "PROMPTS.jsonl"
STUDENT_PLACEHOLDER = "STUDENT"
CALIB_PLACEHOLDER = "CALIB.txt"
NVME_PLACEHOLDER = "NVME_DIR"
HOSTFILE_PLACEHOLDER = "HOSTFILE"  # a multi-node run's hosts, one 'hostname slots=N' line each
# the local directory with the model's weights: copt serve, quantize and distill take no preset or config.json
MODEL_DIR_PLACEHOLDER = "MODEL_DIR"
PLACEHOLDERS = (DATA_PLACEHOLDER, TOKENIZER_PLACEHOLDER, PROMPTS_PLACEHOLDER, STUDENT_PLACEHOLDER, CALIB_PLACEHOLDER,
                NVME_PLACEHOLDER, HOSTFILE_PLACEHOLDER, MODEL_DIR_PLACEHOLDER)
# how each placeholder is given on the command line instead of in a recipe
PLACEHOLDER_FLAGS = {DATA_PLACEHOLDER: "--data", TOKENIZER_PLACEHOLDER: "--tokenizer",
                     HOSTFILE_PLACEHOLDER: "--hostfile", NVME_PLACEHOLDER: "--nvme-path",
                     MODEL_DIR_PLACEHOLDER: "the model's local directory", PROMPTS_PLACEHOLDER: "--prompts",
                     STUDENT_PLACEHOLDER: "--student", CALIB_PLACEHOLDER: "--calib"}
_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.gguf")

QUANTIZE_METHODS = {"awq": "awq", "gptq": "gptq", "fp8-w8a8": "fp8"}
# the `copt quantize --method` for a plan's weights when no recommendation names one
DEFAULT_QUANTIZE_METHOD = {"int4": "awq", "int8": "int8", "fp8": "fp8"}
# recipe keys without a flag of their own: passed as `key=value` overrides
_TRAIN_OVERRIDES = ("optimizer", "loss_impl", "loss_chunk_tokens")
# recipe keys that are always spelled out in a train command (the workload the prediction is for)
_TRAIN_ALWAYS = ("precision", "micro_batch", "seq_len")


def train_recipe_data(plan: TrainPlan, model_arg: str, gpus: int = 1, nodes: int = 1,
                      data: str | None = None, nvme_path: str = NVME_PLACEHOLDER) -> dict[str, Any]:
    """The `copt train` recipe (as a dict, TrainRecipe fields) that runs `plan`."""
    out: dict[str, Any] = {
        "task": "train", "model": model_arg, "precision": plan.precision,
        "activation_checkpointing": plan.activation_checkpointing,
        "attn": "flash_attention_2" if plan.attn == "flash" else plan.attn, "micro_batch": plan.micro_batch,
        "grad_accum": plan.grad_accum, "seq_len": plan.seq_len, "optimizer": plan.optimizer, "zero": plan.zero,
        "offload": plan.offload, "gpus": gpus, "nodes": nodes, "gradient_compression": plan.gradient_compression,
        "pipeline_stages": plan.pp,
    }
    if data:
        out["data"] = data
    if plan.compile is not None:
        out["compile"] = plan.compile
    if plan.loss_impl != "auto":
        out["loss_impl"] = plan.loss_impl
    if plan.loss_chunk_tokens:
        out["loss_chunk_tokens"] = plan.loss_chunk_tokens
    if plan.offload == "nvme":
        out["nvme_path"] = nvme_path
    if nodes > 1:  # copt train launches a multi-node run from a hostfile (or --master-addr on every node)
        out["hostfile"] = HOSTFILE_PLACEHOLDER
    if plan.pp > 1:
        if plan.pp_micro_batches:  # else copt train's default, one micro-batch per sequence (as priced)
            out["pipeline_micro_batches"] = plan.pp_micro_batches
        if plan.pp_virtual_stages > 1:
            out["pipeline_schedule"] = "interleaved-1f1b"
            out["virtual_stages"] = plan.pp_virtual_stages
    return out


def copt_train_problems(plan: TrainPlan, spec: Any, target: Target, model_arg: str = "MODEL") -> list[str]:
    """What copt train would refuse in the recipe that runs `plan` (empty: it runs it): its schema's cross-field
    rules and train's layout checks against the model (the same functions copt train calls), and tensor
    parallelism, which copt train does not run."""
    from pydantic import ValidationError

    from clusteropt_cli.core.train.validate import layout_problems
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    problems = [f"tensor_parallel: copt train has no tensor parallelism (--tensor-parallel {plan.tp})"] \
        if plan.tp > 1 else []
    data = train_recipe_data(plan, model_arg, target.gpus_per_node, target.nodes)
    try:
        recipe = TrainRecipe.model_validate(data)
    except ValidationError as exc:
        from clusteropt_cli.recipe.load import format_validation_error

        return problems + format_validation_error(exc)
    return problems + layout_problems(recipe, {"max_position_embeddings": spec.max_position_embeddings,
                                               "num_hidden_layers": spec.num_layers})


def model_dir_arg(model_arg: str) -> str:
    """What `copt serve`, `copt quantize` and `copt distill --teacher` are given for `model_arg`: its directory
    (a model directory as is, the directory of a config.json that sits beside weights), else MODEL_DIR (a preset, a
    bare config.json: advise priced the shape, the user has the weights somewhere)."""
    path = Path(model_arg).expanduser()
    if path.is_dir():
        return model_arg
    if path.is_file() and any(any(path.parent.glob(pattern)) for pattern in _WEIGHT_FILES):
        return str(Path(model_arg).parent)
    return MODEL_DIR_PLACEHOLDER


def quantized_path(model_arg: str, method: str) -> str:
    """Where `copt quantize --method METHOD` is told to write the quantized checkpoint of `model_arg`."""
    stem = Path(model_arg.rstrip("/")).name or "model"
    if stem.endswith(".json"):
        stem = Path(model_arg).parent.name or "model"
    return str(Path(model_arg.rstrip("/")).parent / f"{stem}-{method}") if Path(model_arg).is_dir() \
        else f"{stem}-{method}"


def serve_recipe_data(plan: InferPlan, model_arg: str, quantize_method: str | None = None) -> dict[str, Any]:
    """The `copt serve` recipe (as a dict, ServeRecipe fields) that serves `plan`."""
    model = model_dir_arg(model_arg)
    if plan.weights in DEFAULT_QUANTIZE_METHOD:  # beside the model's directory, else named after the preset
        model = quantized_path(model if model != MODEL_DIR_PLACEHOLDER else model_arg,
                               quantize_method or DEFAULT_QUANTIZE_METHOD[plan.weights])
    data: dict[str, Any] = {"task": "serve", "model": model, "tensor_parallel": plan.tp,
                            # copt's engine runs one GPU; its paged cache keeps fp8 blocks, an int8 cache is vLLM's
                            "engine": plan.serving_engine,
                            # room for the plan's concurrent requests (never below copt serve's default), unless
                            # the plan sets the cap
                            "max_batch_size": int(plan.max_batch_size) if plan.max_batch_size is not None
                            else max(DEFAULT_MAX_BATCH_SIZE, int(plan.batch)),
                            # bf16/fp16: the model's own dtype
                            "kv_cache_dtype": {"bf16": "auto", "fp16": "auto"}.get(plan.kv_cache, plan.kv_cache)}
    if plan.chunked_prefill:
        data["max_batch_tokens"] = int(plan.chunked_prefill)
    # the KV-cache settings the plan's capacity was sized with (defaults are left out of the printed command)
    data.update({"block_size": int(plan.block_size), "enable_prefix_caching": bool(plan.prefix_caching),
                 "dtype": plan.dtype})
    for key, value in (("kv_cache_memory", plan.kv_cache_memory_gib), ("max_model_len", plan.max_model_len),
                       ("gpu_memory_utilization", plan.gpu_memory_utilization)):
        if value is not None:
            data[key] = value
    if plan.kv_cache_tokens is not None:
        data["kv_cache_blocks"] = max(1, int(plan.kv_cache_tokens) // int(plan.block_size))
    if data["engine"] == "copt" and plan.kv_layout != "auto":
        data["kv_layout"] = plan.kv_layout
    if plan.compile_mode != "auto" and data["engine"] == "copt":
        data["compile_mode"] = plan.compile_mode
    if plan.speculative_tokens:
        data["prompt_lookup"] = 3
        data["num_speculative_tokens"] = int(plan.speculative_tokens)
    return data


def _flags(task: str, data: dict[str, Any], always: tuple[str, ...] = ()) -> list[str]:
    """The recipe's fields that differ from the schema's defaults (and `always`), as the subcommand's flags."""
    from clusteropt_cli.recipe.schema import RECIPE_MODELS

    fields = RECIPE_MODELS[task].model_fields
    flags: list[str] = []
    overrides: list[str] = []
    for key, value in data.items():
        if key in ("task", "model", "prediction") or value is None:
            continue
        if key not in always and key in fields and fields[key].default == value:
            continue
        if task == "train" and key in _TRAIN_OVERRIDES:
            overrides.append(f"{key}={value}")
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, shlex.quote(str(value))]
    return flags + overrides


def needs_tokenizer(model_arg: str) -> bool:
    """Whether copt train needs --tokenizer for `model_arg` (no tokenizer files beside it)."""
    path = Path(model_arg)
    return not (path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                     "tokenizer.model")))


def train_command(plan: TrainPlan, model_arg: str, target: Target, data: str | None = None,
                  output: str = "runs/plan") -> str:
    """`copt train` with the flags of the recipe that runs `plan`."""
    recipe = train_recipe_data(plan, model_arg, target.gpus_per_node, target.nodes, data=data or DATA_PLACEHOLDER)
    parts = ["copt", "train", "--model", shlex.quote(model_arg)]
    if needs_tokenizer(model_arg):
        parts += ["--tokenizer", TOKENIZER_PLACEHOLDER]
    parts += _flags("train", recipe, _TRAIN_ALWAYS) + ["--output", output]
    return " ".join(parts)


def quantize_command(plan: InferPlan, model_arg: str, quantize_method: str | None = None) -> str | None:
    """`copt quantize` writing the checkpoint the serve recipe of `plan` names (None: the plan serves the model's own
    weights)."""
    if plan.weights not in DEFAULT_QUANTIZE_METHOD:
        return None
    method = quantize_method or DEFAULT_QUANTIZE_METHOD[plan.weights]
    calib = f" --calib {CALIB_PLACEHOLDER}" if method in ("awq", "gptq", "int8") else ""  # quantize needs them
    output = serve_recipe_data(plan, model_arg, quantize_method)["model"]
    return (f"copt quantize {shlex.quote(model_dir_arg(model_arg))} --method {method}{calib} --output "
            f"{shlex.quote(output)}")


def serve_command(plan: InferPlan, model_arg: str, quantize_method: str | None = None) -> str:
    """`copt serve` with the flags of the recipe that serves `plan` (after `copt quantize` for quantized weights)."""
    recipe = serve_recipe_data(plan, model_arg, quantize_method)
    serve = " ".join(["copt", "serve", shlex.quote(recipe["model"]), *_flags("serve", recipe)])
    quantize = quantize_command(plan, model_arg, quantize_method)
    return f"{quantize} && {serve}" if quantize else serve


def advise_layout_command(plan: TrainPlan, model_arg: str, target: Target, problems: list[str]) -> str:
    """For a training layout copt train does not run (tensor parallelism, a pipeline with data parallelism or ZeRO,
    ...): the advise command that re-plans it, with the reasons and where such layouts run."""
    head = f"copt advise --model {shlex.quote(model_arg)} --task train --gpu {target.name}"
    if target.world > 1:
        head += f" --gpus {target.gpus_per_node}" + (f" --nodes {target.nodes}" if target.nodes > 1 else "")
    if target.budget_bytes is not None:
        head += f" --memory-budget {target.budget_bytes / 1024**3:.6g}"
    head += f" --micro-batch {plan.micro_batch} --seq-len {plan.seq_len}"
    attn = "flash_attention_2" if plan.attn == "flash" else plan.attn
    for flag, value, default in (("--grad-accum", plan.grad_accum, 1), ("--tensor-parallel", plan.tp, 1),
                                 ("--pipeline-stages", plan.pp, 1),
                                 ("--pipeline-micro-batches", plan.pp_micro_batches, None),
                                 ("--virtual-stages", plan.pp_virtual_stages, 1), ("--zero", plan.zero, 0),
                                 ("--offload", plan.offload, "none"), ("--precision", plan.precision, None),
                                 ("--optimizer", plan.optimizer, "adamw"), ("--attn", attn, "sdpa")):
        if value != default:
            head += f" {flag} {value}"
    if plan.activation_checkpointing:
        head += " --activation-checkpointing"
    for key, value, default in (("gradient_compression", plan.gradient_compression, "none"),
                                ("loss_impl", plan.loss_impl, "auto")):
        if value != default:
            head += f" {key}={value}"
    if plan.tp > 1 and len(problems) == 1:
        return head + "  # copt train has no tensor parallelism: run this layout with Megatron-LM or torchtitan"
    reasons = "; ".join(p.removeprefix("--") for p in problems)
    return head + f"  # copt train cannot run this layout ({reasons}): run it with Megatron-LM or torchtitan"


def command_for(rec_id: str, task: str, plan: TrainPlan | InferPlan, model_arg: str, target: Target,
                data: str | None, spec: Any) -> str:
    """The complete command that applies recommendation `rec_id` (its changed plan `plan`); `spec` (the model's
    ModelSpec) checks a training plan against what copt train runs."""
    if task == "train":
        assert isinstance(plan, TrainPlan)
        problems = copt_train_problems(plan, spec, target, model_arg)
        if problems:
            # the figures are for a layout copt train cannot run: re-plan it with advise
            return advise_layout_command(plan, model_arg, target, problems)
        command = train_command(plan, model_arg, target, data, output=f"runs/{rec_id}")
        if rec_id == "expandable-segments":
            command = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True " + command
        return command
    assert isinstance(plan, InferPlan)
    m = shlex.quote(model_arg)
    if rec_id == "distillation":
        teacher = shlex.quote(model_dir_arg(model_arg))
        return (f"copt distill traces --teacher {teacher} --prompts {PROMPTS_PLACEHOLDER} --output traces.jsonl && "
                f"copt distill sft --student {STUDENT_PLACEHOLDER} --traces traces.jsonl --output student")
    if rec_id == "prefix-caching" and not plan.shared_prefix_len:
        return (f"copt advise --model {m} --task infer --prompt-len {plan.prompt_len} --shared-prefix-len N  "
                "# price the prefix your requests share (copt serve and vLLM cache prefixes by default)")
    if rec_id == "operator-fusion":
        return f"{serve_command(plan, model_arg)} --cuda-graphs --compile"
    return serve_command(plan, model_arg, quantize_method_of(rec_id.split("+")))


def quantize_method_of(applied: list[str]) -> str | None:
    """The `copt quantize --method` of the recommendations applied (None: the weights' default method)."""
    return next((QUANTIZE_METHODS[r] for r in applied if r in QUANTIZE_METHODS), None)
