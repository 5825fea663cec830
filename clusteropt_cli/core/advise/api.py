"""advise as a library: resolve the target, predict memory and time, rank recommendations, emit recipes.

The result is a plain dict following the documented `copt.advise/1` schema (docs/advise.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from clusteropt_cli.core.advise import calibration as cal
from clusteropt_cli.core.advise.memory import (
    MemoryEstimate,
    cpu_training_bytes,
    host_train_memory,
    infer_memory,
    serving_capacity,
    train_memory,
)
from clusteropt_cli.core.advise.plan import InferPlan, Target, TrainPlan, validate_infer, validate_train
from clusteropt_cli.core.advise.recipes import command_for, copt_train_problems, serve_recipe_data, train_recipe_data
from clusteropt_cli.core.advise.recommend import Context, Recommendation, recommend, weights_exceed_gpu
from clusteropt_cli.core.advise.timing import infer_time, train_time
from clusteropt_cli.core.profile.stats import positive_number
from clusteropt_cli.errors import BadInputError, CheckFailedError
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import ModelSpec

SCHEMA_VERSION = "copt.advise/1"
GiB = 1024**3


def resolve_target(gpu: str | None, gpus: int | None = None, nodes: int | None = None,
                   memory_budget_gib: float | None = None,
                   gpu_hour_usd: float | None = None,
                   host_memory_gib: float | None = None,
                   host_loop_ms: float | None = None, serving: bool = False) -> tuple[Target, list[str]]:
    """A catalog GPU, `cpu`, or the detected GPU (no GPU detected → the CPU, said so in the notes). The host's RAM
    per node is `host_memory_gib`, else this machine's when its GPU is the target, else unknown; the host's speed
    (core/hostspeed.py's loop, which prices copt serve's host work: `serving` plans) is `host_loop_ms`, else this
    machine's when its GPU is the target, else the calibration machines'."""
    notes: list[str] = []
    if memory_budget_gib is not None and memory_budget_gib <= 0:
        raise BadInputError(f"--memory-budget must be positive GiB (got {memory_budget_gib}).")
    if host_memory_gib is not None and host_memory_gib <= 0:
        raise BadInputError(f"--host-memory must be positive GiB (got {host_memory_gib}).")
    if gpu_hour_usd is not None and gpu_hour_usd < 0:
        raise BadInputError(f"--gpu-hour-usd must not be negative (got {gpu_hour_usd}).")
    if host_loop_ms is not None and not 0 < host_loop_ms <= 10_000:
        raise BadInputError(f"--host-loop-ms must be a time in milliseconds, above 0 and up to 10,000 (got "
                            f"{host_loop_ms}).", hint="copt env prints this machine's.")
    budget = int(memory_budget_gib * GiB) if memory_budget_gib is not None else None
    spec = None
    detected = False
    if gpu is None:
        from clusteropt_cli.hardware import detect_gpu_spec, detect_gpus

        found = detect_gpus()
        spec = detect_gpu_spec()
        if found and spec is None:
            raise BadInputError(f"The detected GPU '{found[0].name}' is not in copt's catalog.",
                                hint="Pass --gpu with the closest catalog entry (copt advise --list-gpus).")
        if spec is None:
            notes.append("no GPU detected: predicting the CPU training-step memory (pass --gpu NAME to plan for a "
                         "GPU)")
        else:
            detected = True
            notes.append(f"detected {found[0].name} → catalog '{spec.name}'")
    elif gpu.lower() != "cpu":
        spec = get_gpu(gpu)
    if spec is None:
        if budget is None:
            import psutil

            budget = int(psutil.virtual_memory().total)
            notes.append(f"CPU budget = host RAM {budget / GiB:.1f} GiB (set --memory-budget to change it)")
        if (gpus or 1) > 1 or (nodes or 1) > 1:
            if gpu is not None:
                raise BadInputError(f"--gpu cpu models one process on this machine's CPU; --gpus {gpus or 1} "
                                    f"--nodes {nodes or 1} do not apply.",
                                    hint="Drop --gpus/--nodes, or pass --gpu NAME to plan for GPUs.")
            notes.append(f"--gpus {gpus or 1} --nodes {nodes or 1} ignored: no GPU detected, so the plan is one "
                         "CPU process (pass --gpu NAME to plan for GPUs)")
        gpus, nodes = 1, 1
    usd = gpu_hour_usd
    if usd is None and spec is not None:
        usd = cal.DEFAULT_GPU_HOUR_USD.get(spec.name)
    host = int(host_memory_gib * GiB) if host_memory_gib is not None else None
    if host is None and detected:
        import psutil

        host = int(psutil.virtual_memory().total)
    loop_s = host_loop_ms / 1e3 if host_loop_ms is not None and serving else None
    if loop_s is None and detected and serving:
        from clusteropt_cli.core.hostspeed import python_loop_seconds

        loop_s = python_loop_seconds()
    if loop_s is not None:
        notes.append(f"host: copt's reference loop in {loop_s * 1e3:.2f} ms "
                     f"({'--host-loop-ms' if host_loop_ms is not None else 'this machine'}; the calibration "
                     f"machines' {cal.HOST_LOOP_REFERENCE_S * 1e3:g} ms): copt serve's host work per step priced "
                     f"×{loop_s / cal.HOST_LOOP_REFERENCE_S:.2f}")
    return Target(spec, gpus or 1, nodes or 1, budget, usd, detected, host, loop_s), notes


def _mem_dict(m: MemoryEstimate) -> dict[str, Any]:
    d = asdict(m)
    d["headroom_bytes"] = m.headroom_bytes
    return d


def evaluate_train(spec: ModelSpec, plan: TrainPlan, target: Target) -> dict[str, Any]:
    if target.device == "cpu":
        cpu = cpu_training_bytes(spec, plan)
        budget = target.memory_bytes
        mem = {"per_gpu_bytes": cpu["peak_mem_bytes"], "required_bytes": cpu["peak_mem_bytes"],
               "budget_bytes": budget, "fits": None if budget is None else cpu["peak_mem_bytes"] <= budget,
               "peak_phase": "cpu-step", "model_states_bytes": cpu["model_states"],
               "breakdown": _cpu_breakdown(spec, plan, cpu), "phases": {}, "notes": [
                   "device cpu: model states + saved tensors + logits buffers (the CPU peak of docs/advise.md)"],
               "headroom_bytes": None if budget is None else budget - cpu["peak_mem_bytes"], "cpu": cpu}
    else:
        mem = _mem_dict(train_memory(spec, plan, target))
        host = host_train_memory(spec, plan, target)
        mem["host"] = host
        if host["fits"] is False:
            mem["fits"] = False
            mem["notes"] = [*mem["notes"], f"host RAM: needs {host['peak_bytes'] / GiB:.1f} GiB per node, the node has "
                                           f"{host['budget_bytes'] / GiB:.1f} GiB"]
    tm = train_time(spec, plan, target)
    return {"memory": mem, "time": tm.figures, "time_assumptions": tm.assumptions, "time_notes": tm.notes}


def _cpu_breakdown(spec: ModelSpec, plan: TrainPlan, cpu: dict[str, float]) -> dict[str, float]:
    n = spec.num_params
    opt = {"adamw": 8.0, "adamw-8bit": 2.0, "sgd": 4.0}[plan.optimizer] * n
    return {"weights": 4.0 * n, "gradients": 4.0 * n, "optimizer": opt,
            "activations": cpu["saved_tensors"], "logits": cpu["logits_buffers"], "kv_cache": 0.0,
            "autocast_weight_copies": 0.0, "buffers": 0.0}


def evaluate_infer(spec: ModelSpec, plan: InferPlan, target: Target) -> dict[str, Any]:
    if plan.serving_engine == "vllm":  # priced on the engine copt serve runs it on (vLLM batches continuously)
        plan = plan.with_(engine="vllm", continuous_batching=True)
    mem = _mem_dict(infer_memory(spec, plan, target))
    tm = infer_time(spec, plan, target)
    figures = dict(tm.figures)
    capacity = serving_capacity(spec, plan, target)
    figures["max_concurrent_seqs"] = None if capacity is None else capacity.max_concurrent_seqs
    notes = list(tm.notes)
    if plan.served_weights != plan.weights:
        notes.append(dequantized_note(plan))
    if capacity is not None:
        notes.extend(capacity_notes(capacity, plan))
    return {"memory": mem, "time": figures, "time_assumptions": tm.assumptions, "time_notes": notes,
            "kv_cache": None if capacity is None else capacity.as_dict()}


# the load an open loop (--rate without a measured profile's bound) is replayed for
OPEN_LOOP_DURATION_S = 60.0


def add_closed_loop(spec: ModelSpec, plan: InferPlan, target: Target, evaluated: dict[str, Any],
                    load: dict[str, float] | None = None) -> None:
    """The plan's clients as a closed loop through copt's engine (closed_loop.py): closed_loop_* figures and the
    load they are for, added to an evaluate_infer result. A load with a `rate` is an open loop instead (Poisson
    sends at that rate, `seed` as the client's): open_loop_* figures."""
    from clusteropt_cli.core.advise.closed_loop import (
        AMPLIFIED_TTFT,
        MAX_REPLAY_STEPS,
        closed_loop_figures,
        open_loop_figures,
        replay_applies,
    )

    load = load or {}
    requests = load.get("requests")
    if load.get("rate"):
        duration = load.get("duration_s")
        if duration is None and requests is None:
            duration = OPEN_LOOP_DURATION_S
        arrivals = "constant" if load.get("arrivals") == "constant" else "poisson"
        figures = open_loop_figures(spec, plan, target, rate=float(load["rate"]), duration_s=duration,
                                    requests=None if requests is None else int(requests),
                                    seed=int(load.get("seed", 0)), arrivals=arrivals)
        if figures is not None:
            evaluated["time"].update(figures)
            evaluated["time_assumptions"].update(
                {"open_loop_rate": float(load["rate"]), "open_loop_arrivals": arrivals,
                 **({"open_loop_duration_s": duration} if duration is not None else {"open_loop_requests": requests})})
            if "open_loop_ttft_s" not in figures:
                evaluated.setdefault("time_notes", []).append(_HOST_BOUND_TTFT_NOTE.format(loop="open loop"))
        return  # none: api.advise says why
    simulated = closed_loop_figures(spec, plan, target, duration_s=load.get("duration_s"),
                                    requests=None if requests is None else int(requests))
    if simulated is None:
        if plan.batch >= 2 and replay_applies(spec, plan, target):
            evaluated.setdefault("time_notes", []).append(
                _NOT_REPLAYED_NOTE.format(clients=plan.batch, steps=MAX_REPLAY_STEPS))
    else:
        figures, workload = simulated
        evaluated["time"].update(figures)
        evaluated["time_assumptions"].update(workload)
        if "closed_loop_ttft_s" not in figures:
            evaluated.setdefault("time_notes", []).append(_HOST_BOUND_TTFT_NOTE.format(loop="closed loop"))
        amplification = figures.get("closed_loop_ttft_amplification")
        if amplification is not None and amplification >= AMPLIFIED_TTFT:
            evaluated.setdefault("time_notes", []).append(_AMPLIFIED_TTFT_NOTE.format(times=amplification))


_AMPLIFIED_TTFT_NOTE = (
    "closed-loop TTFT: the engine is full, so its throughput sets each client's cycle and the TTFT is what the decode "
    "leaves of it; the decode is {times:.1f}× the TTFT, so a 1% shift between the two moves the TTFT ~{times:.0f}% "
    "(H200, 8B shape at 64-256 clients: the same load's TTFT p50 moved up to 1.74× between runs). Read it as a "
    "band; tok/s and TPOT are the stable figures")

_NOT_REPLAYED_NOTE = (
    "no closed-loop figures: the load of {clients:,} clients does not finish within the replay's {steps:,} engine "
    "steps; check --batch, or measure the load with copt profile endpoint")

_HOST_BOUND_TTFT_NOTE = (
    "no {loop} TTFT: most of the replay's prefilling steps are bound by the host's work, not the GPU's (a small "
    "model on a fast GPU), where measured loads keep prefill bursts the replay does not reproduce (H200, 1B shape, "
    "64-256 clients: TTFT p50 0.12-0.57 s measured); measure it with copt profile endpoint")


def dequantized_note(plan: InferPlan) -> str:
    """Why an int4/int8 plan on copt's engine is priced at the model dtype."""
    return (f"copt's engine dequantizes {plan.weights} checkpoints to {plan.served_weights} at load (no integer GEMM "
            f"kernel; it says so on stderr): priced at {plan.served_weights} memory and decode speed. --engine vllm "
            "serves them packed (Marlin/Machete kernels)")


def one_gpu_engine_note(plan: InferPlan, given: InferPlan) -> str | None:
    """Why the plan as given is priced on vLLM although it names copt's engine (None: it is not)."""
    if given.engine == plan.engine:
        return None
    why = (f"--tensor-parallel {given.tp}" if given.tp > 1 else f"a {given.kv_cache} KV cache"
           + (" in the slot layout" if given.kv_cache == "fp8" else ""))
    return (f"copt's engine runs one GPU with a model-dtype or paged fp8 KV cache: {why} is served by vLLM "
            "(--engine vllm)")


def capacity_notes(capacity: Any, plan: InferPlan) -> list[str]:
    """What limits the plan's concurrency, in words."""
    notes = []
    eng = "copt serve" if capacity.engine == "copt" else capacity.engine
    if capacity.max_model_len and capacity.seq_tokens > capacity.max_model_len:
        notes.append(f"{eng}: a sequence of {plan.prompt_len} + {plan.gen_len} tokens exceeds its max_model_len "
                     f"{capacity.max_model_len:,}: pass --max-model-len (copt serve recipe key max_model_len)")
    elif capacity.kv_concurrent_seqs < plan.batch:
        notes.append(f"{eng}: the KV cache ({capacity.budget}) holds {capacity.kv_concurrent_seqs} sequences of "
                     f"{capacity.seq_tokens + 1} tokens, fewer than --batch {plan.batch}: the rest wait (or are "
                     "preempted and recomputed)")
    elif capacity.max_seqs < plan.batch:
        notes.append(f"{eng}: at most {capacity.max_seqs} sequences run at once (max_batch_size); the rest of "
                     f"--batch {plan.batch} wait")
    if capacity.shared_blocks:
        notes.append(f"prefix caching: the shared prefix's {capacity.shared_blocks} full blocks are stored once and "
                     f"{capacity.prefix_hit_rate:.0%} of each prompt is served from the cache (all but the first "
                     "request)")
    return notes


def _plan_dict(plan: TrainPlan | InferPlan) -> dict[str, Any]:
    return asdict(plan)


def _rec_dict(rec: Recommendation, rank: int | None, model_arg: str, task: str) -> dict[str, Any]:
    return {"id": rec.id, "rank": rank, "title": rec.title, "why": rec.why, "gain": rec.gain,
            "gain_source": rec.gain_source, "cost": rec.cost, "applicable": rec.applicable, "checks": rec.checks,
            "symptoms": rec.symptoms, "score": rec.score, "predicted": rec.predicted, "flags": rec.flags,
            "command": rec.command}


# Not stacked into the emitted plan: an allocator setting, and tensor parallelism in training, which copt train does
# not run (a recipe could not carry it, so its prediction would not describe what runs); copt serve runs it (vLLM).
_NOT_STACKED = {"expandable-segments", "tensor-parallel"}
_NOT_STACKED_INFER = {"expandable-segments"}


def _top_plan(ctx: Context, ranked: list[Recommendation], symptoms: list[str],
              steps: list[Recommendation] | None = None) -> tuple[Any, list[str]]:
    """The plan to emit: for OOM, greedily stack the best memory savers (and `steps`, savers not applicable alone)
    until it fits; else the top one."""
    oom = "oom" in symptoms or ctx.base["memory"]["fits"] is False
    if not (ranked or (oom and steps)) or (not symptoms and ctx.base["memory"]["fits"] is not False):
        return ctx.plan, []  # nothing to fix: the plan as given
    if oom:
        plan, applied = ctx.plan, []
        current = ctx.base
        for _ in range(5):
            if current["memory"]["fits"]:
                break
            # the best-ranked step that makes the plan fit (the ranking already weighs speed); failing that,
            # the step that saves the most memory, and go on stacking
            best, best_req = None, current["memory"]["required_bytes"]
            for rec in [*ranked, *(steps or [])]:
                if rec.id in applied or rec.id in (_NOT_STACKED if ctx.train else _NOT_STACKED_INFER):
                    continue
                candidate = _merge(plan, rec.plan, ctx.plan)
                if ctx.train and not _copt_train_runs(candidate, ctx):
                    continue  # e.g. pipeline stages stacked onto ZeRO: not a recipe copt train takes
                result = ctx.evaluate(candidate)
                req = result["memory"]["required_bytes"]
                if result["memory"]["fits"] and req < current["memory"]["required_bytes"]:
                    best = (rec, candidate, result)
                    break
                if req < best_req * 0.98:
                    best, best_req = (rec, candidate, result), req
            if best is None:
                break
            applied.append(best[0].id)
            plan, current = best[1], best[2]
        return plan, applied
    if ctx.train and not _copt_train_runs(ctx.plan, ctx):
        return ranked[0].plan, [ranked[0].id]  # a layout copt train does not run: re-planned as it is
    for rec in ranked:  # the best plan copt train runs (tensor parallelism stays a ranked recommendation)
        if not ctx.train or _copt_train_runs(rec.plan, ctx):
            return rec.plan, [rec.id]
    return ctx.plan, []


def _copt_train_runs(plan: TrainPlan, ctx: Context) -> bool:
    """Whether the stacked plan is a recipe copt train accepts (its schema's and layout checks' rules)."""
    return not copt_train_problems(plan, ctx.spec, ctx.target, ctx.model_arg)


def _merge(current: Any, changed: Any, original: Any) -> Any:
    """Apply the fields a recommendation changed (relative to the original plan) onto `current`."""
    updates = {k: v for k, v in asdict(changed).items() if asdict(original)[k] != v}
    return current.with_(**updates)


def advise(spec: ModelSpec, target: Target, plan: TrainPlan | InferPlan, symptoms: list[str] | None = None,
           model_arg: str = "MODEL", notes: list[str] | None = None,
           measured: dict[str, float] | None = None, data: str | None = None,
           closed_loop: dict[str, float] | None = None) -> dict[str, Any]:
    """The whole advise result as a `copt.advise/1` dict. `closed_loop`: the closed-loop load the serving figures
    closed_loop_* are for ({"requests": N} or {"duration_s": D}; default: 4 requests per client), or an open loop
    ({"rate": R, the same bound or none (OPEN_LOOP_DURATION_S), "seed"}): open_loop_* figures instead."""
    symptoms = list(dict.fromkeys(symptoms or []))
    task = "train" if isinstance(plan, TrainPlan) else "infer"
    if task == "train":
        validate_train(spec, plan, target)  # type: ignore[arg-type]

        def evaluate(p: Any) -> dict[str, Any]:
            return evaluate_train(spec, p, target)
    else:
        validate_infer(spec, plan, target)  # type: ignore[arg-type]
        given = plan
        if plan.serving_engine == "vllm":  # type: ignore[union-attr]
            plan = plan.with_(engine="vllm", continuous_batching=True)  # type: ignore[union-attr]
        engine_note = one_gpu_engine_note(plan, given)  # type: ignore[arg-type]
        if engine_note:
            notes = [*(notes or []), engine_note]

        def evaluate(p: Any) -> dict[str, Any]:
            return evaluate_infer(spec, p, target)

    base = evaluate(plan)
    ctx = Context(spec, target, plan, evaluate, base, model_arg)
    ranked, rejected = recommend(ctx, symptoms)
    for rec in ranked + rejected:
        rec.command = command_for(rec.id, task, rec.plan, model_arg, target, data, spec)
    # steps that do not fit one GPU alone on copt's engine may still be stacked into a plan that does
    top, applied = _top_plan(ctx, ranked, symptoms, [r for r in rejected if r.stack_only])
    if task == "infer" and top.serving_engine == "vllm":
        top = top.with_(engine="vllm", continuous_batching=True)
    top_result = evaluate(top)
    if task == "infer":
        for planned, evaluated in ((plan, base), (top, top_result)):
            add_closed_loop(spec, planned, target, evaluated, closed_loop)
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "task": task,
        "model": spec.summary(),
        "hardware": {"device": target.device, "gpu": target.name,
                     "label": target.gpu.label if target.gpu else "CPU", "gpus_per_node": target.gpus_per_node,
                     "nodes": target.nodes, "world": target.world,
                     "memory_bytes": target.gpu.memory_bytes if target.gpu else None,
                     "budget_bytes": target.memory_bytes, "detected": target.detected,
                     "gpu_hour_usd": target.gpu_hour_usd},
        "workload": _plan_dict(plan),
        "symptoms": symptoms,
        "memory": base["memory"],
        "time": base["time"],
        "assumptions": base["time_assumptions"],
        "recommendations": [_rec_dict(r, i + 1, model_arg, task) for i, r in enumerate(ranked)],
        "not_applicable": [{"id": r.id, "reasons": [c["detail"] for c in r.checks if not c["ok"]]}
                           for r in rejected],
        "top_plan": {"applies": applied, "workload": _plan_dict(top), "memory": top_result["memory"],
                     "time": top_result["time"], "assumptions": top_result["time_assumptions"]},
        "notes": list(notes or []) + base["memory"].get("notes", []) + base.get("time_notes", []),
    }
    if task == "infer":
        from clusteropt_cli.core.advise.vllm_terms import vllm_capacity

        result["kv_cache"] = base.get("kv_cache")
        # vLLM's own sizing and paging for the same workload (whatever engine the plan runs on)
        on_vllm = serving_capacity(spec, plan.with_(engine="vllm", continuous_batching=True), target)
        result["vllm"] = vllm_capacity(result["workload"], None if on_vllm is None else on_vllm.kv_concurrent_seqs)
    result["prediction"] = prediction_figures(result["top_plan"]["memory"], result["top_plan"]["time"], task)
    # the command that runs the top plan as predicted (the same recipe --emit-recipe writes)
    train_problems = copt_train_problems(top, spec, target, model_arg) if task == "train" else []
    result["top_plan"]["command"] = None if train_problems else command_for(
        "+".join(applied) or "plan", task, top, model_arg, target, data, spec)
    if train_problems:
        result["notes"].append("copt train cannot run this layout (" + "; ".join(
            p.removeprefix("--") for p in train_problems) + "): the figures are for Megatron-LM / torchtitan; "
            "change the flags named for a plan copt train runs")
    if task == "infer" and top.engine == "copt" and weights_exceed_gpu(top_result["memory"]):
        # copt's engine (one GPU) cannot even load these weights: no command to run
        result["top_plan"]["command"] = None
        result["notes"].append(f"no plan fits: the {top.served_weights} weights alone exceed one {target.name} on "
                               "copt's engine (one GPU); quantize the model or plan more GPUs (--gpus N) for vLLM's "
                               "tensor parallelism")
    if data:
        result["data"] = data
    open_loop = bool(task == "infer" and closed_loop and closed_loop.get("rate"))
    if open_loop and "open_loop_tpot_s" not in base["time"]:
        result["notes"].append(f"the open loop at {closed_loop['rate']:g} requests/s was not replayed: the plan's step "
                               "model does not apply (another engine, speculative decoding, no GPU) or the rate is "
                               "past what the engine serves for longer than the load lasts")
    if measured:
        result["measured"] = compare(measured, prediction_figures(base["memory"], base["time"], task), open_loop)
    return result


def prediction_figures(memory: dict[str, Any], time: dict[str, Any], task: str) -> dict[str, float]:
    """The metric names copt profile measures for a recipe's prediction block; None values dropped."""
    figures: dict[str, float] = {"peak_mem_bytes": float(memory["per_gpu_bytes"])}
    keys = (("step_time_s", "tokens_per_s", "mfu") if task == "train"
            # no itl_s: under load a streaming client sees tokens in bursts (p50 ITL ~0.03 ms measured on the
            # H200 at 256 concurrent), so only the per-request mean (tpot_s) is comparable
            else ("ttft_s", "tpot_s", "tpot_out_of_step_s", "output_tokens_per_s", "mbu", "max_concurrent_seqs",
                  "closed_loop_ttft_s", "closed_loop_tpot_s", "closed_loop_output_tokens_per_s",
                  "open_loop_ttft_s", "open_loop_tpot_s", "open_loop_output_tokens_per_s"))
    for key in keys:
        if time.get(key) is not None:
            figures[key] = float(time[key])
    if memory.get("budget_bytes") and task == "train":
        figures["peak_reserved_bytes"] = float(memory["required_bytes"] - cal.CUDA_CONTEXT_BYTES
                                               if memory.get("peak_phase") != "cpu-step"
                                               else memory["required_bytes"])
    return figures


def compare(measured: dict[str, float | None], predicted: dict[str, float],
            open_loop: bool = False) -> list[dict[str, Any]]:
    """Measured vs predicted for every metric both name, with the error in percent; a measured TPOT is also set
    against the out-of-step prediction (closed-loop clients out of step), and TTFT, TPOT and output tokens/s
    against the closed loop's (closed_loop_*), where the plan has them. `open_loop` (a rate was measured): TTFT,
    TPOT and output tokens/s only against the open loop's replay (open_loop_*), never the burst's figures."""
    rows = []
    if open_loop or any(key.startswith("open_loop_") for key in predicted):
        measured = {(f"open_loop_{key}" if f"open_loop_{key}" in predicted else key): value
                    for key, value in measured.items()}
        measured = {k: v for k, v in measured.items() if k not in ("ttft_s", "tpot_s", "output_tokens_per_s")}
    if measured.get("tpot_s") is not None and "tpot_out_of_step_s" in predicted:
        measured = {**measured, "tpot_out_of_step_s": measured["tpot_s"]}
    for name in ("ttft_s", "tpot_s", "output_tokens_per_s"):
        if measured.get(name) is not None and f"closed_loop_{name}" in predicted:
            measured = {**measured, f"closed_loop_{name}": measured[name]}
    for key, value in measured.items():
        if value is None or key not in predicted:
            continue
        pred = predicted[key]
        rows.append({"metric": key, "measured": value, "predicted": pred,
                     "error_pct": None if not value else 100.0 * (pred - value) / value})
    return rows


def check_fits(result: dict[str, Any]) -> None:
    """--fail-if-oom: raise CheckFailedError (exit 6) when the plan as given does not fit."""
    mem = result["memory"]
    host = mem.get("host") or {}
    if host.get("fits") is False and mem["required_bytes"] <= (mem["budget_bytes"] or 0):
        raise CheckFailedError(
            f"The plan needs {host['peak_bytes'] / GiB:.1f} GiB of host RAM per node but the node has "
            f"{host['budget_bytes'] / GiB:.1f} GiB.",
            hint="offload to NVMe (--offload nvme), spread the states over more nodes, or raise --host-memory")
    if mem["fits"] is False:
        unit = "GPU" if result["hardware"]["device"] == "cuda" else "process"
        raise CheckFailedError(
            f"The plan needs {mem['required_bytes'] / GiB:.1f} GiB per {unit}"
            f" but the budget is {mem['budget_bytes'] / GiB:.1f} GiB.",
            hint="apply a recommendation (copt advise --symptom oom) or raise --memory-budget",
        )


# ---- emitting ------------------------------------------------------------------------------------------------
def _served_sampling_defaults(model: Any) -> dict[str, Any]:
    """temperature / top_p / top_k a server applies to requests that omit them, from a local model directory's
    generation_config.json (vLLM's and copt serve's rule: core/serve/sampling.generation_defaults); {} otherwise."""
    if not isinstance(model, str) or not Path(model).is_dir():
        return {}
    from clusteropt_cli.core.profile.external import sampling_fields
    from clusteropt_cli.core.serve.sampling import generation_defaults

    out = sampling_fields(generation_defaults(model))
    if "top_k" in out:
        out["top_k"] = max(0, out["top_k"])  # -1: off, as 0
    return out


def defaults_from_profile(report: Any, task: str, given: dict[str, Any]
                          ) -> tuple[str, dict[str, Any], list[str], dict[str, Any]]:
    """Fill the flags a user did not give from a `copt profile` report.

    Returns (task, values, the profile's symptom ids, its measured metrics). Typed flags always win; a profile
    of an inference run or an endpoint turns the task into infer; the memory budget the profile was measured
    against carries over.
    """
    values = dict(given)
    wl = report.workload
    values["model"] = values["model"] or report.model.get("path") or report.model.get("name")
    if report.mode == "train" and task == "train":
        for key in ("micro_batch", "seq_len", "precision", "grad_accum"):
            values[key] = values[key] or wl.get(key)
        if values["activation_checkpointing"] is None and wl.get("activation_checkpointing") is not None:
            values["activation_checkpointing"] = bool(wl["activation_checkpointing"])
        # the loop the profile measured (compiled or not, its loss) is the loop to predict
        if values.get("compile") is None and wl.get("compile") is not None:
            values["compile"] = bool(wl["compile"])
        if values.get("loss_impl") is None and wl.get("loss_impl") in ("auto", "fused", "hf"):
            values["loss_impl"] = wl["loss_impl"]
    elif report.mode != "train":
        task = "infer"
        values["batch"] = values["batch"] or wl.get("batch") or _measured_concurrency(report)
        values["prompt_len"] = values["prompt_len"] or wl.get("prompt_len")
        values["gen_len"] = values["gen_len"] or wl.get("gen_len") or wl.get("max_tokens")
        if values.get("temperature") is None and wl.get("temperature") is not None:
            values["temperature"] = float(wl["temperature"])  # greedy or sampled: what the load tester sent
        if values.get("top_p") is None and wl.get("top_p") is not None:
            values["top_p"] = float(wl["top_p"])
        if values.get("top_k") is None and wl.get("top_k") is not None:
            values["top_k"] = max(0, int(wl["top_k"]))  # -1: off, as 0
        if wl.get("sampling"):  # the tester sent no temperature: the server applied the model's defaults
            for key, value in _served_sampling_defaults(values.get("model")).items():
                if given.get(key) is None:
                    values[key] = value
    if values["gpu"] is None:
        values["gpu"] = "cpu" if report.hardware.device == "cpu" else report.hardware.catalog
    values["gpus"] = values["gpus"] or report.hardware.count
    if values["memory_budget"] is None and wl.get("memory_budget_bytes"):
        values["memory_budget"] = wl["memory_budget_bytes"] / GiB
    if task == "infer" and values.get("host_loop_ms") is None and report.hardware.host_loop_s:
        values["host_loop_ms"] = report.hardware.host_loop_s * 1e3  # the host the profile ran on
    return task, values, list(report.verdict.symptoms), dict(report.metrics)


def measured_closed_loop(report: Any) -> dict[str, float] | None:
    """The load behind an endpoint profile's metrics: its last completed concurrency level's closed loop (the
    duration it ran for, `profile endpoint --duration`, else its request count) or, when the last completed level
    is a rate without a concurrency (`profile endpoint --rate`, guidellm's poisson or constant profile, `vllm bench
    serve --request-rate`), that open loop: {"rate", the same bound, the client's "seed", "arrivals": "constant" for
    evenly spaced sends}. None: neither."""
    completed = [lv for lv in getattr(report, "levels", []) if lv.completed > 0]
    duration = positive_number(report.workload.get("duration_s"))
    by_duration = duration is not None and not report.workload.get("num_requests")
    last = completed[-1] if completed else None
    rate = None if last is None or last.concurrency is not None else positive_number(last.rate)
    if rate is not None:
        seed = report.workload.get("seed")
        return {"rate": rate, **({"duration_s": duration} if by_duration else {"requests": int(last.requests)}),
                **({"seed": seed} if isinstance(seed, int) and not isinstance(seed, bool) else {}),
                **({"arrivals": "constant"} if getattr(last, "arrivals", None) == "constant" else {})}
    done = [lv for lv in completed if (lv.concurrency or 0) > 1]
    if not done:
        return None
    if by_duration:
        return {"duration_s": duration}
    return {"requests": int(done[-1].requests)}


def _measured_concurrency(report: Any) -> int | None:
    """The concurrency of the endpoint level whose figures are the profile's metrics (the last completed one)."""
    done = [lv for lv in getattr(report, "levels", []) if lv.completed > 0 and lv.concurrency]
    if done:
        return int(done[-1].concurrency)
    listed = report.workload.get("concurrency")
    if isinstance(listed, list):
        listed = max((int(c) for c in listed if c), default=None)
    return int(listed) if listed else None


def check_recipe_runnable(task: str, tp: int) -> None:
    """A train plan with tensor parallelism gets no recipe: copt train cannot run it."""
    if task == "train" and tp > 1:
        raise BadInputError(
            f"--emit-recipe with --tensor-parallel {tp}: copt train has no tensor parallelism, so the recipe's "
            "prediction would not describe what runs.",
            hint="Drop --tensor-parallel (advise then plans with ZeRO, offload and pipelines, which copt train runs), "
                 "or run this layout with Megatron-LM / torchtitan.")


def _absolute_if_local(value: str) -> str:
    """A path that exists here, made absolute; a preset name or a placeholder as it is."""
    import os

    local = Path(value).expanduser()
    return str(local.resolve()) if os.path.exists(local) else value


def emit_recipe(result: dict[str, Any], model_arg: str, path: Path, overwrite: bool = False,
                spec: ModelSpec | None = None) -> Path:
    """A copt recipe (validated by its schema) for the top plan, with a prediction block. A training plan copt
    train would refuse (its layout rules, checked against `spec`) gets no recipe; what advise cannot know (the
    training text, a preset's tokenizer) is named by its placeholder, listed in the header."""
    import yaml

    from clusteropt_cli.core.advise import recipes
    from clusteropt_cli.core.io import atomic_write_text
    from clusteropt_cli.modelspec import load_model_spec
    from clusteropt_cli.recipe.load import validate_recipe

    path = Path(path)
    if path.exists() and not overwrite:
        raise BadInputError(f"{path} already exists.", hint="Pass --overwrite to replace it.")
    model_arg = _absolute_if_local(model_arg)  # the recipe runs from any directory (`copt train --recipe FILE`)
    if result.get("data"):
        result = {**result, "data": _absolute_if_local(result["data"])}
    w = result["top_plan"]["workload"]
    prediction = {"source": "copt advise", "gpu": result["hardware"]["gpu"], "figures": result["prediction"],
                  "budget_bytes": result["memory"]["budget_bytes"],
                  "assumptions": {k: v for k, v in result["top_plan"].get("assumptions", result["assumptions"]).items()
                                  if isinstance(v, (int, float, str))},
                  "recommendation": ",".join(result["top_plan"]["applies"]) or None}
    check_recipe_runnable(result["task"], w["tp"])
    hw = result["hardware"]
    if result["task"] == "train":
        plan = TrainPlan(**w)
        problems = copt_train_problems(plan, spec or load_model_spec(model_arg),
                                       Target(None, hw["gpus_per_node"], hw["nodes"]), model_arg)
        if problems:
            raise BadInputError("--emit-recipe: copt train cannot run the top plan:\n" + "\n".join(
                f"  - {p}" for p in problems), hint="Change the flags named above (the figures printed stand).")
        data = train_recipe_data(plan, model_arg, hw["gpus_per_node"], hw["nodes"],
                                 data=result.get("data") or recipes.DATA_PLACEHOLDER)
        if recipes.needs_tokenizer(model_arg):
            data["tokenizer"] = recipes.TOKENIZER_PLACEHOLDER
        data["output"] = f"runs/{path.stem}"
        data["prediction"] = prediction
        task = "train"
        header = f"# copt train --recipe {path.name}\n"
    else:
        method = recipes.quantize_method_of(result["top_plan"]["applies"])
        data = serve_recipe_data(InferPlan(**w), model_arg, method)
        if data["model"] == recipes.MODEL_DIR_PLACEHOLDER or model_arg != recipes.model_dir_arg(model_arg):
            # a preset or a config.json: clients (and `copt profile endpoint --expect`) name the model, not the
            # directory the user puts in for MODEL_DIR
            local = Path(model_arg)
            data["served_model_name"] = local.parent.name if local.suffix == ".json" else local.name
        data["prediction"] = prediction
        if w["weights"] in ("int4", "fp8", "int8"):
            prediction["assumptions"]["weights"] = w["weights"]
        # the workload the figures are for, so `copt profile --expect` measures the same one
        prediction["assumptions"].update(batch=int(w["batch"]), concurrency=int(w["batch"]),
                                         prompt_len=int(w["prompt_len"]), gen_len=int(w["gen_len"]),
                                         temperature=float(w.get("temperature", 0.0)))
        if w.get("temperature") and (w.get("top_p", 1.0) < 1.0 or w.get("top_k", 0) > 0):  # the sampling priced
            prediction["assumptions"].update(top_p=float(w.get("top_p", 1.0)), top_k=int(w.get("top_k", 0)))
        if w.get("shared_prefix_len"):  # the figures price a prefix every request shares
            prediction["assumptions"]["shared_prefix_len"] = int(w["shared_prefix_len"])
        task = "serve"
        # quantized weights: the checkpoint the recipe serves is written by copt quantize first
        quantize = recipes.quantize_command(InferPlan(**w), model_arg, method)
        header = f"# {quantize + ' && ' if quantize else ''}copt serve --recipe {path.name}\n"
    validated = validate_recipe(task, data, origin="The emitted recipe")
    text = header + "# written by copt advise; the prediction block is checked by copt profile --expect\n"
    named = (data.get("model"), data.get("data"), data.get("tokenizer"), data.get("hostfile"), data.get("nvme_path"))
    placeholders = [p for p in recipes.PLACEHOLDERS if p in named or p in header.split()]
    if placeholders:
        text += ("# placeholders: replace them here or on the command line: " + ", ".join(
            f"{p} ({recipes.PLACEHOLDER_FLAGS[p]})" for p in placeholders) + "\n")
    text += yaml.safe_dump(validated.model_dump(mode="json", exclude_defaults=False), sort_keys=False)
    atomic_write_text(path, text)
    return path


def deepspeed_config(result: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config copt train writes for the top training plan (train's generator, the same config the
    memory model sizes DeepSpeed's buffers from)."""
    from clusteropt_cli.core.advise.memory import train_options
    from clusteropt_cli.core.train.deepspeed_config import deepspeed_config as train_deepspeed_config

    if result["task"] != "train":
        raise BadInputError("--emit-ds-config needs --task train.", hint="Drop --emit-ds-config for inference.")
    w = result["top_plan"]["workload"]
    plan = TrainPlan(**w)
    dp = max(1, result["hardware"]["world"] // (plan.tp * plan.pp))
    return train_deepspeed_config(train_options(plan), dp)


def emit_ds_config(result: dict[str, Any], path: Path, overwrite: bool = False) -> Path:
    from clusteropt_cli.core.io import atomic_write_text

    path = Path(path)
    if path.exists() and not overwrite:
        raise BadInputError(f"{path} already exists.", hint="Pass --overwrite to replace it.")
    atomic_write_text(path, json.dumps(deepspeed_config(result), indent=2) + "\n")
    return path
