"""copt advise: predict memory and time of a training or inference plan, and rank what to do about it."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from clusteropt_cli import console
from clusteropt_cli.errors import BadInputError
from clusteropt_cli.options import JsonOpt, OverridesArg, OverwriteOpt, RecipeOpt

SYMPTOM_HELP = "oom | high-ttft | low-throughput | slow-tpot | comm-bound | low-mfu (repeatable)"


def advise(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Preset name, model directory or config.json.",
                                              show_default=False)] = None,
    task: Annotated[str | None, typer.Option("--task", help="train | infer (default: infer for --symptom high-ttft "
                                                            "or slow-tpot, else train).", show_default=False)] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Catalog GPU (e.g. h100-sxm, a100-80g, h200) or 'cpu'; "
                                                          "default: the detected GPU.", show_default=False)] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="GPUs per node.", show_default=False)] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes (N×M GPUs in total).", show_default=False)] = None,
    gpu_hour_usd: Annotated[float | None, typer.Option("--gpu-hour-usd", help="Price of one GPU-hour for cost per "
                                                                             "1M tokens.", show_default=False)] = None,
    memory_budget: Annotated[float | None, typer.Option("--memory-budget", help="GiB per device to fit in (default: "
                                                                               "the GPU's memory).",
                                                        show_default=False)] = None,
    host_memory: Annotated[float | None, typer.Option("--host-memory", help="[train] Host RAM per node in GiB, for "
                                                                           "CPU offload (default: this machine's "
                                                                           "when its GPU is the target).",
                                                      show_default=False)] = None,
    host_loop_ms: Annotated[float | None, typer.Option(
        "--host-loop-ms", help="[infer] The serving host's speed: its time for copt's reference Python loop in ms "
                               "(copt env prints it), which copt serve's host work per step scales with (default: "
                               "this machine's when its GPU is the target, else the calibration machines').",
        show_default=False)] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="[train] Sequences per GPU per step.",
                                                    show_default=False)] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="[train] Tokens per sequence.",
                                                show_default=False)] = None,
    grad_accum: Annotated[int | None, typer.Option("--grad-accum", help="[train] Micro-batches per optimizer step.",
                                                   show_default=False)] = None,
    precision: Annotated[str | None, typer.Option("--precision", help="[train] bf16 | fp16 | fp8 | fp32.",
                                                  show_default=False)] = None,
    optimizer: Annotated[str | None, typer.Option("--optimizer", help="[train] adamw | adamw-8bit | sgd.",
                                                  show_default=False)] = None,
    zero: Annotated[int | None, typer.Option("--zero", help="[train] DeepSpeed ZeRO stage 0–3.",
                                             show_default=False)] = None,
    offload: Annotated[str | None, typer.Option("--offload", help="[train] none | cpu | nvme.",
                                                show_default=False)] = None,
    activation_checkpointing: Annotated[bool | None, typer.Option(
        "--activation-checkpointing/--no-activation-checkpointing", help="[train] Recompute activations.",
        show_default=False)] = None,
    attn: Annotated[str | None, typer.Option("--attn", help="[train] sdpa | flash_attention_2 | eager (as copt "
                                             "train and transformers spell them).", show_default=False)] = None,
    compile_: Annotated[bool | None, typer.Option("--compile/--no-compile", help="[train] torch.compile.",
                                                  show_default=False)] = None,
    tp: Annotated[int | None, typer.Option("--tensor-parallel", help="Tensor-parallel degree.",
                                           show_default=False)] = None,
    pp: Annotated[int | None, typer.Option("--pipeline-stages", help="[train] Pipeline stages.",
                                           show_default=False)] = None,
    pp_micro_batches: Annotated[int | None, typer.Option("--pipeline-micro-batches", help="[train] Pipeline "
                                                         "micro-batches m.", show_default=False)] = None,
    pp_virtual_stages: Annotated[int | None, typer.Option("--virtual-stages", help="[train] Interleaved virtual "
                                                          "stages v.", show_default=False)] = None,
    data: Annotated[str | None, typer.Option("--data", help="[train] Text to train on: named in the printed copt "
                                             "train commands and the emitted recipe.", show_default=False)] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="[infer] Sampling temperature of the "
                                                      "requests (0 = greedy; OpenAI's default is 1).",
                                                      show_default=False, min=0.0)] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="[infer] Nucleus (top-p) truncation of the sampled "
                                                "requests (1 = off, OpenAI's default).", show_default=False,
                                                min=0.0, max=1.0)] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="[infer] Top-k truncation of the sampled requests "
                                              "(0 = off).", show_default=False, min=0)] = None,
    tp_alias: Annotated[int | None, typer.Option("--tp", hidden=True)] = None,
    pp_alias: Annotated[int | None, typer.Option("--pp", hidden=True)] = None,
    pp_micro_alias: Annotated[int | None, typer.Option("--pp-micro-batches", hidden=True)] = None,
    pp_virtual_alias: Annotated[int | None, typer.Option("--pp-virtual-stages", hidden=True)] = None,
    kv_alias: Annotated[str | None, typer.Option("--kv-cache", hidden=True)] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="[infer] Concurrent sequences.",
                                              show_default=False)] = None,
    prompt_len: Annotated[int | None, typer.Option("--prompt-len", help="[infer] Prompt tokens.",
                                                   show_default=False)] = None,
    gen_len: Annotated[int | None, typer.Option("--gen-len", help="[infer] Generated tokens.",
                                                show_default=False)] = None,
    rate: Annotated[float | None, typer.Option(
        "--rate", help="[infer] Requests per second sent whatever the answers do (Poisson: copt profile endpoint "
        "--rate, vllm bench serve --request-rate, guidellm's poisson profile): adds the open loop's TTFT, TPOT and "
        "output tokens/s, replayed through copt serve's scheduler for 60 s of such arrivals.",
        show_default=False)] = None,
    shared_prefix_len: Annotated[int | None, typer.Option(
        "--shared-prefix-len", help="[infer] Leading prompt tokens every request shares (a system prompt, few-shot "
        "examples): with prefix caching (copt serve's and vLLM's default) their KV blocks are stored once and "
        "not prefilled again, which raises the concurrency and lowers TTFT.", show_default=False, min=0)] = None,
    shared_prefix_alias: Annotated[int | None, typer.Option("--shared-prefix-tokens", hidden=True, min=0)] = None,
    max_batch_size: Annotated[int | None, typer.Option(
        "--max-batch-size", help="[infer] Sequences the serving engine runs at once at most (copt serve's "
        "--max-batch-size, vLLM's --max-num-seqs; default: the engine's, 256 for copt serve).", show_default=False,
        min=1)] = None,
    max_num_seqs_alias: Annotated[int | None, typer.Option("--max-num-seqs", hidden=True, min=1)] = None,
    weights: Annotated[str | None, typer.Option("--weights", help="[infer] bf16 | fp8 | int8 | int4.",
                                                show_default=False)] = None,
    kv_cache: Annotated[str | None, typer.Option("--kv-cache-dtype", help="[infer] auto | bf16 | fp8 (as copt "
                                                 "serve spells it).", show_default=False)] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="[infer] Serving engine the figures are for: "
                                               "transformers (copt serve's own, calibrated) | vllm (roofline).",
                                               show_default=False)] = None,
    symptom: Annotated[list[str] | None, typer.Option("--symptom", "-s", help=SYMPTOM_HELP,
                                                      show_default=False)] = None,
    from_profile: Annotated[Path | None, typer.Option("--from-profile", help="A copt profile JSON: its workload, "
                                                                            "symptoms and measurements.",
                                                      show_default=False)] = None,
    emit_recipe: Annotated[Path | None, typer.Option("--emit-recipe", help="Write a copt recipe for the top plan "
                                                                           "(with a prediction block).",
                                                     show_default=False)] = None,
    emit_ds_config: Annotated[Path | None, typer.Option("--emit-ds-config", help="Write a DeepSpeed config for the "
                                                                                 "top plan.",
                                                        show_default=False)] = None,
    fail_if_oom: Annotated[bool, typer.Option("--fail-if-oom", help="Exit 6 when the plan does not fit.")] = False,
    list_presets: Annotated[bool, typer.Option("--list-presets", help="List the model presets and exit.")] = False,
    list_gpus: Annotated[bool, typer.Option("--list-gpus", help="List the GPU catalog and exit.")] = False,
    json_out: JsonOpt = False,
    overwrite: OverwriteOpt = False,
    recipe: RecipeOpt = None,
    overrides: OverridesArg = None,
) -> None:
    """Predict per-GPU memory (with a breakdown) and time of a plan, and rank the fixes for its symptoms."""
    from clusteropt_cli.core.advise import api
    from clusteropt_cli.core.profile.report import SYMPTOM_TASK, SYMPTOMS
    from clusteropt_cli.modelspec import list_presets as presets
    from clusteropt_cli.modelspec import load_model_spec

    tp, pp = _alias(tp, tp_alias, "--tensor-parallel", "--tp"), _alias(pp, pp_alias, "--pipeline-stages", "--pp")
    pp_micro_batches = _alias(pp_micro_batches, pp_micro_alias, "--pipeline-micro-batches", "--pp-micro-batches")
    pp_virtual_stages = _alias(pp_virtual_stages, pp_virtual_alias, "--virtual-stages", "--pp-virtual-stages")
    kv_cache = _alias(kv_cache, kv_alias, "--kv-cache-dtype", "--kv-cache")
    shared_prefix_len = _alias(shared_prefix_len, shared_prefix_alias, "--shared-prefix-len", "--shared-prefix-tokens")
    max_batch_size = _alias(max_batch_size, max_num_seqs_alias, "--max-batch-size", "--max-num-seqs")
    if attn is not None and attn.lower() == "flash":  # the old spelling
        attn = "flash_attention_2"
    if list_presets or list_gpus:
        _print_lists(list_presets, list_gpus, json_out, presets())
        return
    symptoms = [s.lower() for s in (symptom or [])]
    bad = [s for s in symptoms if s not in SYMPTOMS]
    if bad:
        raise BadInputError(f"Unknown --symptom {', '.join(bad)}.", hint=f"Choose from: {', '.join(SYMPTOMS)}")
    task_given = task is not None
    task = task.lower() if task is not None else _task_of(symptoms)
    if task not in ("train", "infer"):
        raise BadInputError(f"--task must be train or infer (got '{task}').")
    _check_choices(precision=("--precision", precision, _schema_choices("train", "precision")),
                   optimizer=("--optimizer", optimizer, _schema_choices("train", "optimizer")),
                   offload=("--offload", offload, _schema_choices("train", "offload")),
                   attn=("--attn", attn, _schema_choices("train", "attn")),
                   weights=("--weights", weights, ("bf16", "fp16", "fp8", "int8", "int4")),
                   kv=("--kv-cache-dtype", kv_cache, _schema_choices("serve", "kv_cache_dtype") + ("fp16",)),
                   engine=("--engine", engine, _schema_choices("serve", "engine") + ("transformers",)))
    _check_positive({"--micro-batch": micro_batch, "--seq-len": seq_len, "--grad-accum": grad_accum,
                     "--tensor-parallel": tp, "--pipeline-stages": pp, "--pipeline-micro-batches": pp_micro_batches,
                     "--virtual-stages": pp_virtual_stages,
                     "--batch": batch, "--prompt-len": prompt_len, "--gen-len": gen_len, "--gpus": gpus,
                     "--nodes": nodes})
    if kv_cache == "int8":
        raise BadInputError("--kv-cache-dtype int8: neither copt's engine nor vLLM serves an int8 KV cache (vLLM's "
                            "8-bit cache is fp8), so no command advise prints could run it.",
                            hint="Use --kv-cache-dtype fp8.")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise BadInputError(f"--zero must be 0, 1, 2 or 3 (got {zero}).")
    from clusteropt_cli.core.profile.stats import non_finite_problems

    bad_numbers = non_finite_problems({"--memory-budget": memory_budget, "--host-memory": host_memory,
                                       "--gpu-hour-usd": gpu_hour_usd, "--host-loop-ms": host_loop_ms,
                                       "--temperature": temperature, "--top-p": top_p})
    if bad_numbers:
        raise BadInputError("; ".join(bad_numbers) + ".", hint="Give plain numbers (no inf or nan).")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise BadInputError(f"--rate must be a positive number of requests per second (got {rate}).")
    from clusteropt_cli.core.io import check_distinct_outputs, check_output

    check_distinct_outputs({"--emit-recipe": emit_recipe, "--emit-ds-config": emit_ds_config})
    for flag, out in (("--emit-recipe", emit_recipe), ("--emit-ds-config", emit_ds_config)):
        if out is not None:
            check_output(out, {"--model": model, "--from-profile": from_profile, "--recipe": recipe},
                         overwrite=overwrite, kind="file", flag=flag)
    if emit_ds_config is not None and task != "train":
        raise BadInputError("--emit-ds-config needs --task train.")
    if emit_recipe is not None:  # before any work
        from clusteropt_cli.core.advise.api import check_recipe_runnable

        check_recipe_runnable(task, tp or 1)

    measured: dict[str, Any] | None = None
    closed_loop = None
    if from_profile is not None:
        from clusteropt_cli.core.profile.report import load_profile

        report = load_profile(str(from_profile))
        given = {"model": model, "micro_batch": micro_batch, "seq_len": seq_len, "precision": precision,
                 "grad_accum": grad_accum, "activation_checkpointing": activation_checkpointing, "batch": batch,
                 "prompt_len": prompt_len, "gen_len": gen_len, "gpu": gpu, "gpus": gpus,
                 "memory_budget": memory_budget, "compile": compile_, "loss_impl": None, "temperature": temperature,
                 "top_p": top_p, "top_k": top_k, "host_loop_ms": host_loop_ms}
        task, filled, profile_symptoms, measured = api.defaults_from_profile(report, task, given)
        closed_loop = api.measured_closed_loop(report)
        # the profile's own symptoms for the task advised (a user's --symptom is checked below)
        symptoms = list(dict.fromkeys(symptoms + [s for s in profile_symptoms if SYMPTOM_TASK.get(s, task) == task]))
        model, micro_batch, seq_len, precision = filled["model"], filled["micro_batch"], filled["seq_len"], \
            filled["precision"]
        grad_accum, activation_checkpointing = filled["grad_accum"], filled["activation_checkpointing"]
        batch, prompt_len, gen_len = filled["batch"], filled["prompt_len"], filled["gen_len"]
        gpu, gpus, memory_budget = filled["gpu"], filled["gpus"], filled["memory_budget"]
        compile_, temperature = filled["compile"], filled.get("temperature")
        top_p, top_k, host_loop_ms = filled.get("top_p"), filled.get("top_k"), filled.get("host_loop_ms")
        if filled["loss_impl"] and not any(o.startswith("loss_impl=") for o in overrides or []):
            overrides = [*(overrides or []), f"loss_impl={filled['loss_impl']}"]
    _check_symptom_tasks(symptoms, task, task_given or from_profile is not None)
    if rate is not None and task != "infer":  # after --from-profile, which makes an endpoint's profile infer
        raise BadInputError("--rate needs --task infer.", hint="It is the request rate of a serving load.")
    if host_loop_ms is not None and task != "infer":
        raise BadInputError("--host-loop-ms needs --task infer.", hint="It prices copt serve's host work.")
    if rate is not None:  # the rate asked for, over the measured open loop's bound (else OPEN_LOOP_DURATION_S)
        bound = {k: v for k, v in (closed_loop or {}).items() if k in ("duration_s", "requests", "seed", "arrivals")}
        closed_loop = {"rate": rate, **(bound if closed_loop and "rate" in closed_loop else {})}

    target, notes = api.resolve_target(gpu, gpus, nodes, memory_budget, gpu_hour_usd, host_memory, host_loop_ms,
                                       serving=task == "infer")
    if model is None and not recipe:
        raise BadInputError("--model is required.", hint="Pass a preset (copt advise --list-presets), a model "
                                                          "directory or a config.json.")
    if task == "train":
        settings, plan = _train_settings(model, recipe, overrides, target, locals())
        if target.device == "cuda":  # a recipe may set gpus/nodes
            target = replace(target, gpus_per_node=settings.gpus, nodes=settings.nodes)
    else:
        settings, plan = _infer_settings(model, recipe, overrides, target, locals())
    model_arg = str(settings.model)
    spec = load_model_spec(model_arg)
    result = api.advise(spec, target, plan, symptoms, model_arg=model_arg, notes=notes, measured=measured,
                        data=data, closed_loop=closed_loop)

    written = []
    if emit_recipe is not None:
        written.append(str(api.emit_recipe(result, model_arg, emit_recipe, overwrite, spec)))
    if emit_ds_config is not None:
        written.append(str(api.emit_ds_config(result, emit_ds_config, overwrite)))
    result["written"] = written
    if json_out:
        console.print_json(result, "copt.advise/1")
    else:
        _render(result)
    for path in written:
        console.log(f"wrote {path}")
    if fail_if_oom:
        api.check_fits(result)


def _task_of(symptoms: list[str]) -> str:
    """The task --symptom implies when --task is not given: infer for a serving symptom, else train."""
    from clusteropt_cli.core.profile.report import SYMPTOM_TASK

    return "infer" if any(SYMPTOM_TASK.get(s) == "infer" for s in symptoms) else "train"


def _check_symptom_tasks(symptoms: list[str], task: str, task_given: bool) -> None:
    """Every --symptom belongs to the task advised (a serving symptom ranks no training technique, and the reverse)."""
    from clusteropt_cli.core.profile.report import SYMPTOM_TASK

    wrong = [s for s in symptoms if SYMPTOM_TASK.get(s, task) != task]
    if not wrong:
        return
    kinds = {"infer": "serving", "train": "training"}
    named = ", ".join(f"{s} ({kinds[SYMPTOM_TASK[s]]})" for s in wrong)
    if task_given:
        raise BadInputError(f"--symptom {named} does not apply to a {kinds[task]} plan (--task {task}).",
                            hint=f"Pass --task {SYMPTOM_TASK[wrong[0]]}, or drop the symptom.")
    raise BadInputError(f"--symptom {named} mixes serving and training symptoms.",
                        hint="Pass the symptoms of one task, with --task train or --task infer.")


def _alias(value: Any, old: Any, flag: str, old_flag: str) -> Any:
    """The value of a flag given under its current name or its old (hidden) one, not both."""
    if value is not None and old is not None and value != old:
        raise BadInputError(f"{flag} {value} and {old_flag} {old} disagree.", hint=f"Pass {flag} only.")
    return value if value is not None else old


def _schema_choices(task: str, field: str) -> tuple[str, ...]:
    """The values the recipe schema allows for a field (one vocabulary for advise, train and serve)."""
    import typing

    from clusteropt_cli.recipe.schema import RECIPE_MODELS

    annotation = RECIPE_MODELS[task].model_fields[field].annotation
    return tuple(str(a) for a in typing.get_args(annotation) if a is not None and not isinstance(a, type))


def _check_choices(**choices: tuple[str, str | None, tuple[str, ...]]) -> None:
    problems = [f"{flag} must be one of {', '.join(allowed)} (got '{value}')"
                for flag, value, allowed in choices.values() if value is not None and value.lower() not in allowed]
    if problems:
        raise BadInputError("; ".join(problems) + ".")


def _check_positive(values: dict[str, int | None]) -> None:
    problems = [f"{flag} must be at least 1 (got {v})" for flag, v in values.items() if v is not None and v < 1]
    if problems:
        raise BadInputError("; ".join(problems) + ".", hint="Use positive numbers for sizes and counts.")


def _train_settings(model: str | None, recipe: str | None, overrides: list[str] | None, target: Any,
                    v: dict[str, Any]) -> tuple[Any, Any]:
    from clusteropt_cli.core.advise.plan import TrainPlan
    from clusteropt_cli.recipe.load import load_settings

    attn = v["attn"]
    cli = {"model": model, "micro_batch": v["micro_batch"], "seq_len": v["seq_len"], "grad_accum": v["grad_accum"],
           "precision": v["precision"], "optimizer": v["optimizer"], "zero": v["zero"], "offload": v["offload"],
           "activation_checkpointing": v["activation_checkpointing"], "attn": attn, "compile": v["compile_"],
           "gpus": target.gpus_per_node if target.gpus_per_node > 1 else v["gpus"], "nodes": v["nodes"]}
    if v["offload"] == "nvme":
        cli["nvme_path"] = "/local_nvme"
    # --tensor-parallel/--pipeline-* describe any Megatron-style layout advise can model; they stay out of the
    # train recipe
    # (copt train's own pipeline engine has narrower rules, checked only when a recipe is emitted)
    s = load_settings("train", recipe, overrides, cli, flags={"nvme_path": None})
    plan = TrainPlan(micro_batch=s.micro_batch, seq_len=s.seq_len, grad_accum=s.grad_accum, precision=s.precision,
                     optimizer=s.optimizer, zero=s.zero, offload=s.offload,
                     activation_checkpointing=s.activation_checkpointing,
                     attn="flash" if s.attn == "flash_attention_2" else s.attn, tp=v["tp"] or 1,
                     pp=v["pp"] or s.pipeline_stages,
                     pp_micro_batches=v["pp_micro_batches"] or s.pipeline_micro_batches,
                     pp_virtual_stages=v["pp_virtual_stages"] or s.virtual_stages, compile=s.compile,
                     gradient_compression=s.gradient_compression, loss_impl=s.loss_impl,
                     loss_chunk_tokens=s.loss_chunk_tokens)
    return s, plan


def _infer_settings(model: str | None, recipe: str | None, overrides: list[str] | None, target: Any,
                    v: dict[str, Any]) -> tuple[Any, Any]:
    from clusteropt_cli.core.advise.plan import InferPlan
    from clusteropt_cli.recipe.load import load_settings

    if v["top_p"] is not None and v["top_p"] <= 0:
        raise BadInputError(f"--top-p must be above 0 (got {v['top_p']:g}).",
                            hint="Pass the requests' top_p, in (0, 1]; 1 means no truncation.")
    kv = v["kv_cache"]
    cli = {"model": model, "tensor_parallel": v["tp"], "engine": v["engine"], "max_batch_size": v["max_batch_size"],
           "kv_cache_dtype": {"fp16": "auto"}.get(kv, kv) if kv else None}
    s = load_settings("serve", recipe, overrides, cli)
    kv_dtype = {"auto": "bf16"}.get(s.kv_cache_dtype, s.kv_cache_dtype)
    # the serve recipe's KV-cache settings size the engine's cache (`max_batch_size=256`, `kv_cache_memory=40`, ...
    # as overrides or in --recipe); max_batch_size only where given (else the engine's own default cap)
    given_cap = "max_batch_size" in s.model_fields_set
    # copt serve batches continuously (its own engine or vLLM): the plan is what it runs
    plan = InferPlan(batch=v["batch"] or 1, prompt_len=v["prompt_len"] or 512, gen_len=v["gen_len"] or 256,
                     weights=v["weights"] or "bf16", kv_cache=kv_dtype, tp=s.tensor_parallel,
                     engine="vllm" if s.engine == "vllm" else "copt", continuous_batching=True,
                     chunked_prefill=s.max_batch_tokens, compile_mode=s.compile_mode,
                     speculative_tokens=s.num_speculative_tokens if (s.prompt_lookup or s.draft_model) else 0,
                     temperature=v["temperature"] or 0.0, top_p=1.0 if v["top_p"] is None else v["top_p"],
                     top_k=v["top_k"] or 0, shared_prefix_len=v["shared_prefix_len"] or 0,
                     prefix_caching=s.enable_prefix_caching, max_batch_size=s.max_batch_size if given_cap else None,
                     block_size=s.block_size, kv_cache_memory_gib=s.kv_cache_memory,
                     kv_cache_tokens=s.kv_cache_blocks * s.block_size if s.kv_cache_blocks else None,
                     gpu_memory_utilization=s.gpu_memory_utilization, max_model_len=s.max_model_len,
                     kv_layout=s.kv_layout, dtype=s.dtype)
    return s, plan


def _print_lists(show_presets: bool, show_gpus: bool, json_out: bool, preset_names: list[str]) -> None:
    from clusteropt_cli.hardware import CATALOG
    from clusteropt_cli.modelspec import load_model_spec

    data: dict[str, Any] = {}
    if show_presets:
        data["presets"] = [load_model_spec(n).summary() for n in preset_names]
    if show_gpus:
        data["gpus"] = [{"name": g.name, "label": g.label, "memory_bytes": g.memory_bytes,
                         "hbm_bandwidth": g.hbm_bandwidth, "bf16_tflops": g.tflops.get("bf16"),
                         "fp8": g.supports_fp8, "interconnect": g.interconnect} for g in CATALOG.values()]
    if json_out:
        console.print_json(data, "copt.advise-lists/1")
        return
    if show_presets:
        console.out.print(console.grid("Model presets", ["name", "params", "active", "layers", "hidden", "heads/kv"],
                                       [[p["name"], f"{p['num_params'] / 1e9:.2f}B",
                                         f"{p['num_active_params'] / 1e9:.2f}B", p["num_layers"], p["hidden_size"],
                                         f"{p['num_heads']}/{p['num_kv_heads']}"] for p in data["presets"]]))
    if show_gpus:
        console.out.print(console.grid("GPU catalog", ["name", "label", "memory", "HBM TB/s", "bf16 TFLOP/s", "fp8"],
                                       [[g["name"], g["label"], console.human_bytes(g["memory_bytes"]),
                                         f"{g['hbm_bandwidth'] / 1e12:.2f}", g["bf16_tflops"], g["fp8"]]
                                        for g in data["gpus"]]))


def _default_kv_setting(key: str, value: Any) -> bool:
    """A serving KV-cache setting at its default (left out of the rendered workload)."""
    return (key, value) in (("prefix_caching", True), ("block_size", 16), ("shared_prefix_len", 0))


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.2f} ms" if x < 1 else f"{x:.2f} s"


def _render(r: dict[str, Any]) -> None:
    from rich.markup import escape

    out = console.out
    m, hw, mem, tm = r["model"], r["hardware"], r["memory"], r["time"]
    where = f"{hw['world']}× {hw['label']}" if hw["device"] == "cuda" else "CPU"
    out.print(console.kv_table("copt advise", [
        ("model", f"{m['name']} ({m['num_params'] / 1e9:.2f}B params"
                  + (f", {m['num_active_params'] / 1e9:.2f}B active" if m["num_experts"] else "") + ")"),
        ("hardware", where + (f" ({hw['nodes']} nodes)" if hw["nodes"] > 1 else "")),
        ("task", r["task"]),
        ("workload", ", ".join(f"{k}={v}" for k, v in r["workload"].items()
                               if v not in (None, False, "none", "auto") and not _default_kv_setting(k, v))),
        ("symptoms", ", ".join(r["symptoms"]) or "-"),
    ]))
    rows = [[k, console.human_bytes(v)] for k, v in mem["breakdown"].items() if v]
    rows.append(["peak (allocated)", console.human_bytes(mem["per_gpu_bytes"])])
    rows.append(["required (+allocator, context)", console.human_bytes(mem["required_bytes"])])
    verdict = "-" if mem["fits"] is None else ("[green]fits[/green]" if mem["fits"] else "[red]does NOT fit[/red]")
    rows.append(["budget", console.markup(f"{console.human_bytes(mem['budget_bytes'])} → {verdict}")])
    host = mem.get("host")
    if host and (host["terms"]["offload_buffers"] or host["fits"] is False):
        hverdict = "-" if host["fits"] is None else ("[green]fits[/green]" if host["fits"] else
                                                     "[red]does NOT fit[/red]")
        budget = console.human_bytes(host["budget_bytes"]) if host["budget_bytes"] else "unknown (--host-memory)"
        rows.append(["host RAM per node",
                     console.markup(f"{console.human_bytes(host['peak_bytes'])} of {budget} → {hverdict}")])
        if host["nvme_bytes"]:
            rows.append(["NVMe space per node", console.human_bytes(host["nvme_bytes"])])
    out.print(console.grid(f"Memory per {'GPU' if hw['device'] == 'cuda' else 'process'} "
                           f"(peak phase: {mem['peak_phase']})", ["term", "bytes"], rows))
    trows = []
    a = r["assumptions"]
    loop = (f"{r['workload'].get('batch')} clients, "
            + (f"{a['closed_loop_requests']:,} requests" if "closed_loop_requests" in a
               else f"{a.get('closed_loop_duration_s')} s"))
    open_loop = (f"{a.get('open_loop_rate', 0):g} requests/s "
                 f"{'evenly spaced' if a.get('open_loop_arrivals') == 'constant' else 'Poisson'}, "
                 + (f"{a['open_loop_requests']:,} requests" if "open_loop_requests" in a
                    else f"{a.get('open_loop_duration_s')} s"))
    for key, label in (("step_time_s", "step time"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
                       ("bubble_fraction", "pipeline bubble"), ("comm_s", "DP communication"),
                       ("comm_exposed_s", "exposed communication"), ("offload_s", "offload"),
                       ("optimizer_s", "optimizer step (clip + update)"),
                       ("ttft_s", "TTFT"), ("tpot_s", "TPOT (per request)"),
                       ("tpot_out_of_step_s", "TPOT, closed-loop clients out of step"),
                       ("closed_loop_ttft_s", f"TTFT, closed loop ({loop})"),
                       ("closed_loop_ttft_amplification", "TTFT amplification, closed loop (% per % of decode)"),
                       ("closed_loop_tpot_s", f"TPOT, closed loop ({loop})"),
                       ("closed_loop_output_tokens_per_s", f"output tokens/s, closed loop ({loop})"),
                       ("open_loop_ttft_s", f"TTFT, open loop ({open_loop})"),
                       ("open_loop_tpot_s", f"TPOT, open loop ({open_loop})"),
                       ("open_loop_output_tokens_per_s", f"output tokens/s, open loop ({open_loop})"),
                       ("decode_step_s", "decode step"),
                       ("tpot_floor_s", "TPOT floor (bytes/bandwidth)"),
                       ("output_tokens_per_s", "output tokens/s"), ("max_concurrent_seqs", "max concurrent seqs"),
                       ("usd_per_million_tokens", "USD per 1M tokens")):
        value = tm.get(key)
        optional = ("bubble_fraction", "comm_s", "comm_exposed_s", "offload_s", "optimizer_s")
        if value is None or (key in optional and not value):
            continue
        if key == "tpot_out_of_step_s" and value == tm.get("tpot_s"):
            continue  # one client, or none decodes through another's prefill
        if key.endswith("_s") and not key.endswith("per_s"):
            text = _fmt_s(value)
        elif key in ("mfu", "bubble_fraction"):
            text = f"{value:.1%}"
        elif key == "closed_loop_ttft_amplification":
            text = f"{value:.1f}×"
        elif key == "usd_per_million_tokens":
            text = f"${value:.3f}"
        else:
            text = f"{value:,.0f}"
        trows.append([label, text])
    if trows:
        assumptions = ", ".join(f"{k}={v}" for k, v in r["assumptions"].items())
        out.print(console.grid(f"Time ({assumptions})", ["figure", "value"], trows))
    kv = r.get("kv_cache")
    if kv and kv["layout"] in ("paged", "slots"):
        eng = "copt serve" if kv["engine"] == "copt" else kv["engine"]
        held = (f"{kv['num_blocks']:,} blocks × {kv['block_size']} tokens" if kv["layout"] == "paged"
                else f"{kv['capacity_tokens'] // max(1, kv['max_model_len'] or 1):,} slots of {kv['max_model_len']:,} "
                     "tokens")
        size = console.human_bytes(kv["capacity_tokens"] * kv["bytes_per_token"])
        shared = (f", the shared prefix's {kv['shared_blocks']} blocks stored once "
                  f"({kv['prefix_hit_rate']:.0%} prefix hits)" if kv["shared_blocks"] else "")
        out.print(f"KV cache ({eng}, {kv['layout']}): {held} = {size} ({kv['budget']}); holds "
                  f"{kv['kv_concurrent_seqs']:,} sequences of {kv['seq_tokens'] + 1:,} tokens{shared}; at most "
                  f"{kv['max_seqs']} run at once (max_batch_size)", highlight=False, markup=False)
    if r.get("vllm"):
        out.print(f"vLLM: {r['vllm']['args']}  ({r['vllm']['note']})", highlight=False, markup=False)
    if r["recommendations"]:
        rec_rows = []
        for rec in r["recommendations"][:10]:
            p = rec["predicted"]
            after = console.human_bytes(p.get("peak_mem_bytes"))
            if p.get("fits") is not None:
                after += " ✓" if p["fits"] else " ✗"
            speed = p.get("tokens_per_s") or p.get("output_tokens_per_s")
            extra = f"{speed:,.0f} tok/s" if speed else ""
            if p.get("ttft_s") is not None and "high-ttft" in rec["symptoms"]:
                extra = f"TTFT {_fmt_s(p['ttft_s'])}"
            if p.get("tpot_s") is not None and "slow-tpot" in rec["symptoms"]:
                extra = f"TPOT {_fmt_s(p['tpot_s'])}"
            rec_rows.append([rec["rank"], rec["id"], f"{rec['why']}; gain: {rec['gain']} [{rec['gain_source']}]",
                             rec["cost"], f"{after} {extra}"])
        out.print(console.grid("Recommendations (best first)", ["#", "id", "why here; expected gain [source]",
                                                                 "cost", "predicted after"], rec_rows))
        for rec in r["recommendations"][:10]:
            out.print(f"  [bold]{rec['id']}[/bold]: {escape(rec['command'])}", highlight=False)
    if r["not_applicable"]:
        out.print(console.grid("Not applicable here", ["id", "why not"],
                               [[n["id"], "; ".join(n["reasons"])] for n in r["not_applicable"]]))
    top = r["top_plan"]
    if top["applies"]:
        fits = top["memory"]["fits"]
        out.print(f"[bold]Top plan:[/bold] {' + '.join(top['applies'])} → "
                  f"{console.human_bytes(top['memory']['per_gpu_bytes'])} peak"
                  + ("" if fits is None else (" (fits)" if fits else " (still does not fit)")))
    if top.get("command"):
        out.print(f"[bold]Run it:[/bold] {escape(top['command'])}", highlight=False)
    if r.get("measured"):
        out.print(console.grid("Profile vs prediction", ["metric", "measured", "predicted", "error"],
                               [[row["metric"], f"{row['measured']:.4g}", f"{row['predicted']:.4g}",
                                 "-" if row["error_pct"] is None else f"{row['error_pct']:+.1f}%"]
                                for row in r["measured"]]))
    runs_as = "this plan as copt train runs it"
    for note in r["notes"]:
        if top["applies"] and note.startswith(runs_as):  # say which plan: the one given, then the top plan
            note = "the plan as given, as copt train runs it" + note[len(runs_as):]
            note += "".join(f"; the top plan: {n[len(runs_as) + 2:]}" for n in top["memory"].get("notes", [])
                            if n.startswith(runs_as))
        console.err.print(f"note: {note}", highlight=False)
