"""`--expect R.yaml`: read the prediction a recipe carries and check a fresh measurement against it.

A recipe emitted by `copt advise --emit-recipe` has `prediction.figures` (e.g. peak_mem_bytes, step_time_s,
tokens_per_s, ttft_s, tpot_s). Each predicted figure is compared with the profile's measured figure of the same
name; the relative error is (measured − predicted) / predicted, and a figure misses when |error| > tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from clusteropt_cli.core.profile.report import ProfileReport
from clusteropt_cli.core.profile.stats import positive_number
from clusteropt_cli.errors import BadInputError, RecipeError


@dataclass
class Expectation:
    """The prediction block of a recipe, and the recipe's settings."""

    path: str
    task: str
    figures: dict[str, float]
    recipe: Any  # the validated recipe model (TrainRecipe, ServeRecipe, ...)
    gpu: str | None = None
    budget_bytes: int | None = None
    assumptions: dict[str, Any] = field(default_factory=dict)


@dataclass
class FigureCheck:
    name: str
    predicted: float
    measured: float | None
    rel_error: float | None
    # "explained": a full closed loop's TTFT that missed by what the tok/s and TPOT errors imply (which passed):
    # not a miss (explain_amplified_ttft)
    status: Literal["pass", "miss", "explained", "not-measured"]
    # "closed loop": advise's replay of this level's closed loop (closed_loop_*, the same clients and load);
    # "upper": the prediction bounds the figure from above (a closed loop's TTFT: at most the in-step figure);
    # "out of step": the prediction for closed-loop clients out of step (tpot_out_of_step_s);
    # "open loop": advise's replay of this rate level's sends (open_loop_*, the same rate, spacing and load)
    note: str | None = None


@dataclass
class Comparison:
    recipe: str
    tolerance: float
    checks: list[FigureCheck]
    level: str | None = None  # which endpoint level was compared (endpoint mode)
    # what else the measurement says about the comparison (a client that measured its own backlog)
    caveats: list[str] = field(default_factory=list)

    @property
    def misses(self) -> list[FigureCheck]:
        return [c for c in self.checks if c.status == "miss"]

    @property
    def passed(self) -> bool:
        return not self.misses and any(c.status == "pass" for c in self.checks)


def load_expectation(path: str) -> Expectation:
    """Read and validate the recipe; it must carry prediction.figures."""
    from clusteropt_cli.recipe.load import read_recipe_file, validate_recipe
    from clusteropt_cli.recipe.schema import RECIPE_MODELS

    data = read_recipe_file(path)
    task = data.get("task")
    if not isinstance(task, str) or task not in RECIPE_MODELS:
        raise RecipeError(f"--expect {path}: 'task' must be one of {', '.join(RECIPE_MODELS)} (got {task!r}).",
                          hint="Pass a recipe written by 'copt advise --emit-recipe'.")
    recipe = validate_recipe(task, data, origin=f"Recipe '{path}'")
    prediction = getattr(recipe, "prediction", None)
    if prediction is None or not prediction.figures:
        raise BadInputError(f"--expect {path}: the recipe has no prediction.figures to check.",
                            hint="Write one with 'copt advise ... --emit-recipe R.yaml', or add a prediction block.")
    # every figure is an amount (bytes, seconds, tokens/s, a fraction): an error relative to 0 or to a negative
    # prediction is no check (it divided by zero, or passed -931 GiB against 18 MiB measured)
    not_positive = [f"{name} {value:g}" for name, value in prediction.figures.items() if not value > 0]
    if not_positive:
        raise BadInputError(f"--expect {path}: predicted {', '.join(not_positive)}: a predicted figure must be "
                            "positive (the check is the measured figure's error relative to it).",
                            hint="Correct or remove those figures, or emit the recipe again with copt advise "
                                 "--emit-recipe.")
    return Expectation(path=str(path), task=task, figures=dict(prediction.figures), recipe=recipe,
                       gpu=prediction.gpu, budget_bytes=prediction.budget_bytes,
                       assumptions=dict(prediction.assumptions))


# Recipe keys that `profile model` cannot reproduce in one process, and why.
_UNSUPPORTED_TRAIN = {
    "zero": (0, "ZeRO partitions states across processes"),
    "offload": ("none", "optimizer offload needs DeepSpeed"),
    "gpus": (1, "several processes"),
    "nodes": (1, "several nodes"),
    "pipeline_stages": (1, "pipeline stages"),
}


def model_values_from_recipe(exp: Expectation) -> dict[str, Any]:
    """ModelProfileSettings fields implied by the recipe (the command's typed flags win over these)."""
    values: dict[str, Any] = {"model": getattr(exp.recipe, "model", None)}
    if exp.gpu == "cpu":
        values["device"] = "cpu"
    if exp.budget_bytes is not None:
        values["memory_budget_bytes"] = exp.budget_bytes
    if exp.task == "train":
        r = exp.recipe
        problems = [f"{key}={getattr(r, key)} ({why})" for key, (default, why) in _UNSUPPORTED_TRAIN.items()
                    if getattr(r, key, default) != default]
        if r.precision == "fp8":
            problems.append("precision=fp8 (FP8 training runs through copt train)")
        if r.optimizer not in ("adamw", "sgd"):
            problems.append(f"optimizer={r.optimizer} (profile steps use torch AdamW or SGD)")
        if problems:
            raise BadInputError(
                f"--expect {exp.path}: copt profile model measures one process, so it cannot reproduce: "
                + "; ".join(problems) + ".",
                hint="Check this plan against the metrics.jsonl of 'copt train --recipe R.yaml' instead.")
        values.update(mode="train", micro_batch=r.micro_batch, seq_len=r.seq_len, precision=r.precision,
                      activation_checkpointing=r.activation_checkpointing, optimizer=r.optimizer,
                      attn=r.attn if r.attn in ("sdpa", "eager") else "sdpa", seed=r.seed,
                      loss_impl=getattr(r, "loss_impl", "auto"))
        compile_flag = getattr(r, "compile", False)
        values["compile"] = (exp.gpu not in (None, "cpu")) if compile_flag is None else bool(compile_flag)
    else:
        values["mode"] = "infer"
    for key in ("batch", "prompt_len", "gen_len", "dtype", "micro_batch", "seq_len"):
        if key in exp.assumptions and key not in values:
            values[key] = exp.assumptions[key]
    return {k: v for k, v in values.items() if v is not None}


def endpoint_values_from_recipe(exp: Expectation, given: dict[str, Any], rate_given: bool = False) -> dict[str, Any]:
    """What `profile endpoint` sends to check a serve recipe's prediction: the recipe's server (host, port,
    served name) and the workload the figures are for (concurrency, prompt/gen lengths, sampling), wherever the
    command's own flags leave them unset."""
    if exp.task != "serve":
        raise BadInputError(f"--expect {exp.path}: profile endpoint checks a serve recipe (this one is "
                            f"task {exp.task}).", hint="Check a train recipe with 'copt profile model --expect'.")
    r, a = exp.recipe, exp.assumptions
    values = dict(given)
    if not values.get("url"):
        host = "127.0.0.1" if r.host in ("0.0.0.0", "::", "") else r.host
        values["url"] = f"http://{host}:{r.port}"
    values["model"] = values.get("model") or r.served_model_name or r.model
    open_rate = a.get("open_loop_rate")
    if not values.get("concurrency") and not rate_given and positive_number(open_rate):
        # an open loop priced (advise --rate): send that rate for the load it was replayed for
        values["concurrency"], values["rate"] = [], [float(open_rate)]
        if positive_number(a.get("open_loop_duration_s")):
            values.setdefault("duration_s", float(a["open_loop_duration_s"]))
        elif positive_number(a.get("open_loop_requests")):
            values.setdefault("num_requests", int(a["open_loop_requests"]))
    elif not values.get("concurrency") and not rate_given:
        want = a.get("concurrency", a.get("batch"))
        values["concurrency"] = [int(want)] if want else []
    for key in ("prompt_len", "gen_len", "temperature", "top_p", "top_k"):
        if values.get(key) is None and a.get(key) is not None:
            values[key] = a[key]
    return values


def _endpoint_level(report: ProfileReport, exp: Expectation):
    """The endpoint level a prediction speaks of: the open loop's rate (open_loop_rate), else
    assumptions.concurrency (or batch), else the last level."""
    rate = exp.assumptions.get("open_loop_rate")
    if positive_number(rate):
        for level in report.levels:
            if level.concurrency is None and level.rate == rate:
                return level
    want = exp.assumptions.get("concurrency", exp.assumptions.get("batch"))
    if want is not None:
        for level in report.levels:
            if level.concurrency == want:
                return level
    return report.levels[-1] if report.levels else None


def measured_figures(report: ProfileReport, exp: Expectation) -> tuple[dict[str, float | None], Any]:
    """The measured figure for each name, and the endpoint level they come from (the one the prediction speaks
    of; None for a model profile)."""
    figures = dict(report.metrics)
    level = _endpoint_level(report, exp) if report.kind == "endpoint" else None
    if level is not None:
        figures.update(level_figures(level))
    return figures, level


def level_figures(level: Any) -> dict[str, float | None]:
    """The flat figures of one endpoint level (latencies at p50)."""
    return {"ttft_s": level.ttft_s.get("p50"), "tpot_s": level.tpot_s.get("p50"), "itl_s": level.itl_s.get("p50"),
            "e2e_s": level.e2e_s.get("p50"), "output_tokens_per_s": level.output_tokens_per_s,
            "request_throughput": level.request_throughput, "goodput": level.goodput}


def _same_load(report: ProfileReport, level: Any, exp: Expectation) -> bool:
    """Whether the level sent the closed-loop load the prediction replayed: as many requests, or as long."""
    requests, duration = (exp.assumptions.get("closed_loop_requests"),
                          exp.assumptions.get("closed_loop_duration_s"))
    if isinstance(requests, int) and not isinstance(requests, bool):
        return not report.workload.get("duration_s") and level.requests == requests
    return isinstance(duration, (int, float)) and report.workload.get("duration_s") == duration


def _same_open_load(report: ProfileReport, level: Any, exp: Expectation) -> bool:
    """Whether a rate level sent the open loop the prediction replayed: that rate, as long or as many requests."""
    a = exp.assumptions
    if level.rate != a.get("open_loop_rate") or (level.arrivals or "poisson") != a.get("open_loop_arrivals",
                                                                                         "poisson"):
        return False
    if positive_number(a.get("open_loop_duration_s")):
        return report.workload.get("duration_s") == a["open_loop_duration_s"]
    return not report.workload.get("duration_s") and level.requests == a.get("open_loop_requests")


def compare_to_prediction(report: ProfileReport, exp: Expectation, tolerance: float) -> Comparison:
    """Predicted vs measured for every predicted figure. A closed-loop endpoint level (N > 1 clients, each sending
    its next request when one ends) is compared with advise's replay of that loop (closed_loop_*) where the
    prediction has one for the same load; otherwise (an older recipe, another load) its TPOT is compared with
    tpot_out_of_step_s and its TTFT is bounded by the in-step ttft_s (all clients' requests together)."""
    measured, level = measured_figures(report, exp)
    level_name = None if level is None else (f"concurrency {level.concurrency}" if level.concurrency is not None
                                             else f"rate {level.rate}")
    closed_loop = level is not None and (level.concurrency or 0) > 1
    figures = dict(exp.figures)
    out_of_step = figures.pop("tpot_out_of_step_s", None)
    replayed = {name: figures.pop(f"closed_loop_{name}") for name in ("ttft_s", "tpot_s", "output_tokens_per_s")
                if f"closed_loop_{name}" in figures}
    open_replayed = {name: figures.pop(f"open_loop_{name}") for name in ("ttft_s", "tpot_s", "output_tokens_per_s")
                     if f"open_loop_{name}" in figures}
    notes: dict[str, str] = {}
    if level is not None and level.concurrency is None and level.rate is not None:
        # a rate level: only the open loop's replay of the same load speaks of it, never the burst's figures
        for name in ("ttft_s", "tpot_s", "output_tokens_per_s"):
            figures.pop(name, None)
        if open_replayed and _same_open_load(report, level, exp):
            for name, value in open_replayed.items():
                figures[name], notes[name] = value, "open loop"
    elif closed_loop and replayed and _same_load(report, level, exp):
        for name, value in replayed.items():
            figures[name], notes[name] = value, "closed loop"
    elif closed_loop:
        notes["ttft_s"] = "upper"
        if out_of_step is not None and "tpot_s" in figures:
            figures["tpot_s"], notes["tpot_s"] = out_of_step, "out of step"
    checks = []
    for name, predicted in figures.items():
        value = measured.get(name)
        if value is None or not predicted > 0:  # load_expectation refuses those; not a check
            checks.append(FigureCheck(name, float(predicted), value, None, "not-measured", notes.get(name)))
            continue
        err = (float(value) - float(predicted)) / abs(float(predicted))
        ok = err <= tolerance if notes.get(name) == "upper" else abs(err) <= tolerance
        checks.append(FigureCheck(name, float(predicted), float(value), err, "pass" if ok else "miss",
                                  notes.get(name)))
    if not any(c.status != "not-measured" for c in checks) and level is not None and level.concurrency is None \
            and level.rate is not None:
        a = exp.assumptions
        if open_replayed:
            bound = (f"{a['open_loop_duration_s']:g} s" if positive_number(a.get("open_loop_duration_s"))
                     else f"{a.get('open_loop_requests')} requests")
            spacing = {"constant": "evenly spaced", "poisson": "Poisson"}
            raise BadInputError(
                f"--expect {exp.path}: the recipe's open loop is {a.get('open_loop_rate')} requests/s "
                f"({spacing.get(a.get('open_loop_arrivals', 'poisson'), 'Poisson')}) for {bound}; the profile's level "
                f"sent {level.rate}/s ({spacing[level.arrivals or 'poisson']}) for "
                f"{report.workload.get('duration_s') or level.requests}"
                f"{' s' if report.workload.get('duration_s') else ' requests'}.",
                hint="Measure the recipe's load: copt profile endpoint --expect R.yaml with no --rate, --duration "
                     "or --num-requests (they come from the recipe).")
        raise BadInputError(
            f"--expect {exp.path}: the recipe predicts a closed loop of {a.get('concurrency', a.get('batch'))} "
            f"clients; the profile's level sent {level.rate} requests/s whatever the answers did.",
            hint="Measure with --concurrency, or emit the recipe with copt advise --rate R.")
    if not any(c.status != "not-measured" for c in checks):
        offered = sorted(k for k, v in measured.items() if v is not None)
        if report.kind == "endpoint" and exp.task == "serve":
            # the pairing is right: the prediction lacks the figures an endpoint measures
            why = (" (advise has no speed model for a CPU target: the recipe was emitted with --gpu cpu)"
                   if exp.gpu == "cpu" else "")
            raise BadInputError(
                f"--expect {exp.path}: the recipe predicts {', '.join(exp.figures)}, none of which an endpoint "
                f"measures ({', '.join(offered)}){why}.",
                hint="Emit the serve recipe for the GPU the server runs on: copt advise --task infer --gpu NAME ... "
                     "--emit-recipe R.yaml")
        raise BadInputError(
            f"--expect {exp.path}: none of the predicted figures ({', '.join(exp.figures)}) is measured by this "
            f"profile ({report.kind} {report.mode}: {', '.join(offered)}).",
            hint="Pair a train recipe with 'profile model --mode train', a serve recipe with 'profile endpoint'.")
    caveats = client_caveats(level)
    if closed_loop:
        checks, amplified = explain_amplified_ttft(level, checks, tolerance)
        caveats += amplified
    return Comparison(recipe=exp.path, tolerance=tolerance, checks=checks, level=level_name, caveats=caveats)


def explain_amplified_ttft(level: Any, checks: list[FigureCheck],
                           tolerance: float) -> tuple[list[FigureCheck], list[str]]:
    """A closed-loop level whose TTFT missed where the decode is several times the TTFT: each client's cycle
    (1 / the request rate per client) is its TTFT, its decode and its turnaround, so the TTFT is the cycle less the
    decode, and the prediction's errors in tok/s and TPOT alone move it by (cycle / TTFT) and (decode / TTFT) times
    as much (advise's replay: closed_loop.ClosedLoopFigures.ttft_amplification). Returns the checks and a caveat
    that says so; where tok/s and TPOT passed and the TTFT's ratio is within ±tolerance of the ratio they imply, the
    TTFT's status is "explained" (not a miss: its error is theirs, amplified)."""
    from clusteropt_cli.core.advise.closed_loop import ttft_explained

    implied, decode_ttfts, caveats = _amplified_ttft(level, checks)
    if implied is None:
        return checks, caveats
    by_name = {c.name: c for c in checks}
    ttft, tpot, tok = (by_name[name] for name in ("ttft_s", "tpot_s", "output_tokens_per_s"))
    if ttft_explained(ttft.predicted / ttft.measured, implied, decode_ttfts, tok.status == tpot.status == "pass",
                      tolerance):
        checks = [replace(c, status="explained") if c is ttft else c for c in checks]
        caveats = [caveats[0] + f": within ±{tolerance:.0%} of that, so the TTFT is marked explained, not missed"]
    elif tok.status == tpot.status == "pass":
        caveats = [caveats[0] + ": the TTFT misses by more than its tok/s and TPOT errors explain"]
    return checks, caveats


def _amplified_ttft(level: Any, checks: list[FigureCheck]) -> tuple[float | None, float, list[str]]:
    """(the TTFT ratio the tok/s and TPOT ratios imply, the decode in TTFTs, [the caveat]) for a full closed loop's
    missed TTFT; (None, 0, []) for any other level."""
    from clusteropt_cli.core.advise.closed_loop import AMPLIFIED_TTFT, implied_ttft_ratio

    by_name = {c.name: c for c in checks if c.status != "not-measured" and c.note == "closed loop"}
    ttft, tpot, tok = (by_name.get(name) for name in ("ttft_s", "tpot_s", "output_tokens_per_s"))
    if ttft is None or ttft.status != "miss" or tpot is None or tok is None:
        return None, 0.0, []
    ttft_p50, e2e_p50 = level.ttft_s.get("p50"), level.e2e_s.get("p50")
    if not (ttft_p50 and e2e_p50 and level.request_throughput and level.concurrency):
        return None, 0.0, []
    decode_times = (e2e_p50 - ttft_p50) / ttft_p50
    cycle_times = level.concurrency / level.request_throughput / ttft_p50
    if decode_times < AMPLIFIED_TTFT:
        return None, 0.0, []
    implied = implied_ttft_ratio(cycle_times, decode_times, tok.predicted / tok.measured,
                                 tpot.predicted / tpot.measured)
    return implied, decode_times, [
        f"the closed loop kept the engine full: each client's cycle was {cycle_times:.1f}× the TTFT p50 and its "
        f"decode {decode_times:.1f}×, so the TTFT is what the decode leaves of the cycle; the prediction's tok/s "
        f"({tok.predicted / tok.measured - 1:+.1%}) and TPOT ({tpot.predicted / tpot.measured - 1:+.1%}) alone put "
        f"it at {implied:.2f}× the measured TTFT (predicted {ttft.predicted / ttft.measured:.2f}×)"]


def client_caveats(level: Any) -> list[str]:
    """A level measured through a client whose event loop ran late (copt's own client, client_loop_lag_s): its
    TTFT and ITL include the client's backlog, which advise's replay does not price."""
    from clusteropt_cli.core.profile.endpoint import client_backlog_s

    lag = client_backlog_s(level)
    if lag is None:
        return []
    return [f"the client's event loop ran {lag * 1e3:.1f} ms late (p90) against a measured TTFT p50 of "
            f"{level.ttft_s.get('p50', 0.0) * 1e3:.1f} ms: part of the measured TTFT and ITL is the client's own "
            "backlog, which the prediction does not include (more --client-processes share the streams out)"]
