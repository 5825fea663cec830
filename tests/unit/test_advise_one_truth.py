"""advise predicts what copt runs: its plans are copt recipes, priced with copt train's own defaults (compiled
decoder, fused chunked loss) and DeepSpeed config, and its serve plans include sampled requests. Anchors are the
H200 runs committed under bench/results/train-h200-2026-11-30/ (copt train defaults, Llama-3.2-1B shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from clusteropt_cli.core.advise import api
from clusteropt_cli.core.advise import calibration as cal
from clusteropt_cli.core.advise.memory import ds_settings, train_memory, train_options
from clusteropt_cli.core.advise.plan import InferPlan, Target, TrainPlan
from clusteropt_cli.core.advise.timing import infer_time, train_time
from clusteropt_cli.core.train.deepspeed_config import deepspeed_config as train_deepspeed_config
from clusteropt_cli.core.train.loop import loss_kind, runs_compiled
from clusteropt_cli.hardware import get_gpu
from clusteropt_cli.modelspec import load_model_spec
from clusteropt_cli.recipe.load import validate_recipe

GiB = 1024**3
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "train-h200-2026-11-30"


def _case(run: str, name: str) -> dict:
    cases = json.loads((RESULTS / run / f"train_{run}.json").read_text())["cases"]
    return cases[name] if isinstance(cases, dict) else next(c for c in cases if c["name"] == name)


def _predict(model: str, **plan) -> tuple[dict, dict]:
    spec, target = load_model_spec(model), Target(get_gpu("h200"))
    p = TrainPlan(seq_len=2048, **plan)
    mem = train_memory(spec, p, target)
    return {"peak": mem.per_gpu_bytes, "fits": mem.fits, "required": mem.required_bytes}, \
        train_time(spec, p, target).figures


def test_copt_train_defaults_anchor_1b() -> None:
    """explore3 copt_default: 43,496,511,488 bytes peak (40.5 GiB) at 8 × 2048. Its tokens/s (66,122) came from an
    earlier day's machine; absolute speed is checked against the advise-vs-train runs
    (test_advise_vs_train_h200.py), and here only what one run compares: the loss's chunk size."""
    measured = _case("explore3", "copt_default")
    mem, tm = _predict("llama-3.2-1b", micro_batch=8)
    assert mem["peak"] == pytest.approx(measured["peak_mem_bytes"], rel=0.10)
    # the eager HF loop's figure (73.8 GiB) is what advise used to say: +86% over the run
    assert mem["peak"] / GiB < 45


@pytest.mark.parametrize("chunk", [4096, 8192])
def test_fused_loss_chunk_anchor_1b(chunk: int) -> None:
    """explore3 copt_chunk4k / copt_chunk8k: the loss's chunk size is priced (46.07 and 51.33 GB), and so is its
    speed: fewer chunks, fewer passes over the fp32 head-gradient accumulator (+1.0% / +0.8% measured in the run
    against its default's 66,122 tok/s)."""
    measured = _case("explore3", f"copt_chunk{chunk // 1024}k")
    default = _case("explore3", "copt_default")
    mem, tm = _predict("llama-3.2-1b", micro_batch=8, loss_chunk_tokens=chunk)
    _, tm_default = _predict("llama-3.2-1b", micro_batch=8)
    assert mem["peak"] == pytest.approx(measured["peak_mem_bytes"], rel=0.10)
    predicted = tm["tokens_per_s"] / tm_default["tokens_per_s"]
    assert predicted > 1.0
    assert predicted == pytest.approx(measured["tokens_per_s"] / default["tokens_per_s"], abs=0.01)


def test_copt_train_checkpointing_and_fp8_anchors_1b() -> None:
    """Peaks of the checkpointed and fp8 runs; their speed against the default measured in the same run (all with
    the per-step readout of that time): checkpointing 52,183 / 61,602 = 0.85 (the full-forward recompute priced
    before gave 0.79), fp8 70,087 / 61,326 = 1.14."""
    _, tm_default = _predict("llama-3.2-1b", micro_batch=8)
    ckpt = _case("explore2", "copt_checkpointing")  # 22,265,182,208 bytes, 52,183 tok/s
    mem, tm = _predict("llama-3.2-1b", micro_batch=8, activation_checkpointing=True)
    assert mem["peak"] == pytest.approx(ckpt["peak_mem_bytes"], rel=0.10)
    ratio = ckpt["tokens_per_s"] / _case("explore2", "copt_default")["tokens_per_s"]
    assert tm["tokens_per_s"] / tm_default["tokens_per_s"] == pytest.approx(ratio, rel=0.03)
    fp8 = _case("final", "copt_fp8")  # 35,110,114,816 bytes, 70,087 tok/s
    mem, tm = _predict("llama-3.2-1b", micro_batch=8, precision="fp8")
    assert mem["peak"] == pytest.approx(fp8["peak_mem_bytes"], rel=0.10)
    ratio = fp8["tokens_per_s"] / _case("final", "copt_default")["tokens_per_s"]
    assert tm["tokens_per_s"] / tm_default["tokens_per_s"] == pytest.approx(ratio, rel=0.03)


def test_3b_micro_batch_4_as_the_issue_measured_it() -> None:
    """The issue's H200 run of copt train's defaults on the 3B shape, 4 × 2048: the eager-loop model advise used
    then (reproduced here with compile off and the model's loss) was +33% on peak. The prediction for what copt
    train runs must sit within 10% of that measured peak (its speed: test_advise_vs_train_h200.py)."""
    old_mem, _ = _predict("llama-3.2-3b", micro_batch=4, compile=False, loss_impl="hf")
    measured_peak = old_mem["peak"] / 1.33
    mem, _ = _predict("llama-3.2-3b", micro_batch=4)
    assert mem["peak"] == pytest.approx(measured_peak, rel=0.10)


def test_8b_micro_batch_2_fits_one_h200_as_copt_train_ran_it() -> None:
    """Llama-3.1-8B, 2 × 2048, copt train defaults ran on one H200; advise used to say 149 GiB, does NOT fit."""
    spec, target = load_model_spec("llama-3.1-8b"), api.resolve_target("h200")[0]
    result = api.advise(spec, target, TrainPlan(micro_batch=2, seq_len=2048), model_arg="llama-3.1-8b")
    assert result["memory"]["fits"] is True
    assert result["memory"]["required_bytes"] < 139 * GiB
    assert result["top_plan"]["applies"] == []  # no 8-bit optimizer or offload needed


def test_plan_defaults_are_copt_trains_rules() -> None:
    """compile and the loss come from copt train's own functions: compiled + fused on CUDA at ZeRO 0, eager under
    DeepSpeed, the model's loss at ZeRO-3, eager on the CPU."""
    spec = load_model_spec("llama-3.2-1b")
    for zero in (0, 1, 2, 3):
        plan = TrainPlan(zero=zero)
        options = train_options(plan)
        assert plan.runs_compiled("cuda") == runs_compiled(options, "cuda") == (zero == 0)
        assert plan.loss(spec) == loss_kind(options) == ("hf" if zero == 3 else "fused")
    assert TrainPlan().runs_compiled("cpu") is False
    assert TrainPlan(compile=False).runs_compiled("cuda") is False
    gemma = load_model_spec({"model_type": "gemma2", "hidden_size": 256, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
                             "vocab_size": 1000, "final_logit_softcapping": 30.0})
    assert TrainPlan().loss(gemma) == "hf"


def test_fused_loss_prices_no_fp32_logits() -> None:
    spec, target = load_model_spec("llama-3.2-1b"), Target(get_gpu("h200"))
    fused = train_memory(spec, TrainPlan(micro_batch=8, seq_len=2048), target)
    hf = train_memory(spec, TrainPlan(micro_batch=8, seq_len=2048, loss_impl="hf"), target)
    full_fp32_logits = 8 * 2048 * spec.vocab_size * 4
    assert hf.per_gpu_bytes - fused.per_gpu_bytes > full_fp32_logits
    assert fused.breakdown["logits"] < 0.6 * full_fp32_logits  # head gradient + one chunk, not the logits


def test_emitted_train_plan_is_a_copt_train_recipe(tmp_path) -> None:
    spec, target = load_model_spec("llama-3.2-3b"), api.resolve_target("h200")[0]
    result = api.advise(spec, target, TrainPlan(micro_batch=4, seq_len=2048), ["oom"], model_arg="llama-3.2-3b",
                        data="train.txt")
    path = api.emit_recipe(result, "llama-3.2-3b", tmp_path / "plan.yaml")
    data = yaml.safe_load(path.read_text())
    assert "loss_impl" not in data or data["loss_impl"] == "auto"  # no longer pinned to hf
    assert data["compile"] is None  # copt train's per-device default, exactly what was priced
    assert data["data"] == "train.txt"
    recipe = validate_recipe("train", data, origin="test")
    assert recipe.model_dump(mode="json") == data  # validates unchanged
    plan = TrainPlan(**result["top_plan"]["workload"])
    assert runs_compiled(recipe, "cuda") == plan.runs_compiled("cuda")
    assert loss_kind(recipe) == plan.loss(spec)


def test_emitted_serve_plan_is_a_copt_serve_recipe(tmp_path) -> None:
    spec, target = load_model_spec("llama-3.2-1b"), api.resolve_target("h200")[0]
    result = api.advise(spec, target, InferPlan(batch=8, continuous_batching=True, temperature=1.0),
                        ["slow-tpot"], model_arg="llama-3.2-1b")
    data = yaml.safe_load(api.emit_recipe(result, "llama-3.2-1b", tmp_path / "serve.yaml").read_text())
    recipe = validate_recipe("serve", data, origin="test")
    assert recipe.model_dump(mode="json") == data
    assert data["prediction"]["assumptions"]["temperature"] == 1.0
    # what `profile endpoint --expect` checks a closed loop's TPOT against (its clients fall out of step)
    figures = data["prediction"]["figures"]
    assert figures["tpot_out_of_step_s"] > figures["tpot_s"] > 0
    # speculative decoding (the top plan here) is not replayed; the plan as given is: its 8 clients as the closed
    # loop `copt profile endpoint --expect` sends (4 requests each)
    assert not any(name.startswith("closed_loop_") for name in figures)
    plain = api.advise(spec, target, InferPlan(batch=8, continuous_batching=True, temperature=1.0),
                       model_arg="llama-3.2-1b")
    data = yaml.safe_load(api.emit_recipe(plain, "llama-3.2-1b", tmp_path / "plain.yaml").read_text())
    assert data["prediction"]["assumptions"]["closed_loop_requests"] == 32
    assert {"closed_loop_tpot_s", "closed_loop_output_tokens_per_s"} <= set(data["prediction"]["figures"])


def test_one_deepspeed_config_for_prediction_and_emission(tmp_path) -> None:
    spec, target = load_model_spec("llama-3.2-1b"), api.resolve_target("h200", gpus=2)[0]
    for zero in (1, 2, 3):
        plan = TrainPlan(micro_batch=4, seq_len=2048, zero=zero, activation_checkpointing=True)
        result = api.advise(spec, target, plan, model_arg="llama-3.2-1b")
        emitted = json.loads(api.emit_ds_config(result, tmp_path / f"ds{zero}.json").read_text())
        assert emitted == train_deepspeed_config(train_options(plan), 2)  # train's generator, byte for byte
        zcfg = emitted["zero_optimization"]
        assert zcfg["reduce_bucket_size"] == 5e7  # not advise's old 5e8
        assert ds_settings(plan, 2)["reduce_bucket_size"] == zcfg["reduce_bucket_size"]
        buffers = train_memory(spec, plan, target).deepspeed_buffers
        if zero in (1, 2):
            assert buffers["end-of-backward"]["ipg_buckets"] == 2 * zcfg["reduce_bucket_size"] * 2  # overlap_comm
        else:
            assert buffers["loss"]["ipg_bucket"] == zcfg["reduce_bucket_size"] * 2
            assert buffers["loss"]["prefetch_bucket"] == zcfg["stage3_prefetch_bucket_size"] * 2


def test_sampled_requests_cost_more_per_token() -> None:
    """Batch-1 decode on the 1B shape through copt serve, one H200 run: 1.216 ms/token greedy, 1.250 sampled at
    temperature 1.0 (sampling inside the captured step; advise 1.113 and 1.148, 0.92: its decode step is fitted to
    today's engine on two H100 hosts, where the same shape's step differed by 10% between them); the sampling pass
    grows with the batch."""
    spec, target = load_model_spec("llama-3.2-1b"), Target(get_gpu("h200"))

    def tpot(batch: int, temperature: float) -> float:
        plan = InferPlan(batch=batch, prompt_len=144, gen_len=128, continuous_batching=True, temperature=temperature,
                         max_batch_size=batch)
        return infer_time(spec, plan, target).figures["tpot_s"]

    assert tpot(1, 0.0) == pytest.approx(1.216e-3, rel=0.10)
    assert tpot(1, 1.0) == pytest.approx(1.250e-3, rel=0.10)
    assert tpot(1, 1.0) - tpot(1, 0.0) == pytest.approx(cal.SAMPLED_DECODE_STEP_S + cal.SAMPLED_DECODE_PER_SEQ_S)
    def step(batch: int, temperature: float) -> float:
        plan = InferPlan(batch=batch, prompt_len=144, gen_len=128, continuous_batching=True, temperature=temperature,
                         max_batch_size=batch)
        return infer_time(spec, plan, target).figures["decode_step_s"]

    assert step(256, 1.0) - step(256, 0.0) == pytest.approx(cal.SAMPLED_DECODE_STEP_S
                                                            + 256 * cal.SAMPLED_DECODE_PER_SEQ_S)
    sampled = infer_time(spec, InferPlan(batch=1, prompt_len=144, gen_len=128, continuous_batching=True,
                                         temperature=0.7), target)
    assert sampled.assumptions["sampling"].startswith("sampled")



@pytest.mark.parametrize(("top_p", "top_k", "measured_ms"), [
    (1.0, 0, 1.236), (0.95, 0, 1.257), (1.0, 50, 1.269), (0.9, 50, 1.272)])
def test_truncated_sampling_costs_its_selection_step(top_p, top_k, measured_ms) -> None:
    """top-p / top-k add their sampling graph's time over temperature alone. Batch 1, 1B shape, in-process engine on
    an H200, one run (bench/gpu_serve_sampling.py, docs/benchmarks.md#serve, after the draw modes were fused):
    greedy 1.213 ms/token and the sampled settings here, with cuBLAS products (compile mode "default": the run came
    before the autotuned batch-1 kernels); the sampling graphs' times come from a later run of the same sampling
    code; the ms/token are not fitted. Each setting's cost over greedy within 0.015 ms of the measured one, the
    ms/token within 5% (0.95-0.96: the decode step is fitted to today's engine on H100 hosts)."""
    spec, target = load_model_spec("llama-3.2-1b"), Target(get_gpu("h200"))
    plan = InferPlan(batch=1, prompt_len=256, gen_len=256, continuous_batching=True, temperature=1.0, top_p=top_p,
                     top_k=top_k, compile_mode="default")
    sampled = infer_time(spec, plan, target).figures["tpot_s"] * 1e3
    greedy = infer_time(spec, plan.with_(temperature=0.0), target).figures["tpot_s"] * 1e3
    assert sampled - greedy == pytest.approx(measured_ms - 1.213, abs=0.015)
    assert sampled == pytest.approx(measured_ms, rel=0.05)


def test_advise_names_the_selection_mode_copt_serve_runs() -> None:
    """advise's sampling mode is the engine's own choice (device_sampling.selection_for; one row with a wide top-k
    sorts on CUDA), for every kind of truncation a request can ask for."""
    from clusteropt_cli.core.advise.timing import sampling_mode, truncation_step_s
    from clusteropt_cli.core.serve import device_sampling as ds

    names = {ds.PLAIN: "plain", ds.TOP_P: "top_p", ds.TOP_K_DRAW: "top_k_draw", ds.TOP_K_P_DRAW: "top_k_p_draw",
             ds.TOP_K_WIDE: "top_k_wide", ds.TOP_K_WIDE_P: "top_k_wide_p", ds.SORT: "sort"}
    for top_p in (1.0, 0.9):
        for top_k in (0, 1, 50, 64, 65, 1024, 1025, 50_000):
            engine_mode = ds.selection_for([ds.RowSettings(temperature=1.0, top_p=top_p, top_k=top_k)])
            for rows in (1, 64):
                if rows <= ds.SORT_ROWS and engine_mode in (ds.TOP_K_WIDE, ds.TOP_K_WIDE_P):
                    expected = "sort"
                else:
                    expected = names[engine_mode]
                plan = InferPlan(batch=rows, temperature=1.0, top_p=top_p, top_k=top_k)
                assert sampling_mode(plan, rows) == expected, (top_p, top_k, rows)
                assert (truncation_step_s(plan, rows) == 0) == (expected == "plain")
    sort = InferPlan(batch=256, temperature=1.0, top_k=5000)
    draw = InferPlan(batch=256, temperature=1.0, top_k=50)
    assert truncation_step_s(sort, 256) > truncation_step_s(draw, 256) > 0
    assert truncation_step_s(sort, 512) > truncation_step_s(sort, 256)  # beyond the measured rows: extended


def test_top_p_of_zero_is_refused(tmp_path) -> None:
    from typer.testing import CliRunner

    from clusteropt_cli.app import app

    result = CliRunner().invoke(app, ["advise", "-m", "llama-3.2-1b", "--task", "infer", "--temperature", "1",
                                      "--top-p", "0", "--gpu", "h200"])
    from clusteropt_cli.errors import BadInputError

    assert isinstance(result.exception, BadInputError) and "--top-p must be above 0" in str(result.exception)
    ok = CliRunner().invoke(app, ["advise", "-m", "llama-3.2-1b", "--task", "infer", "--temperature", "1",
                                  "--top-p", "0.95", "--top-k", "50", "--gpu", "h200", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["top_plan"]["assumptions"]["sampling"] == "sampled (temperature > 0, top k p draw)"


@pytest.mark.parametrize(("temperature", "top_p", "measured"), [(0.0, 1.0, 22_364), (1.0, 0.95, 21_384)])
def test_256_streams_through_copt_serve_anchor(temperature, top_p, measured) -> None:
    """The load the serve constants were fitted to (cal.SERVING_ENGINES): `copt serve` (one API-server process) on
    the 1B shape, 256 streaming clients sent at once, prompts of 256 new tokens, 128 output tokens,
    --max-batch-size 256 (H200, bench/gpu_serve_frontend.py, docs/benchmarks.md#front-end-processes): greedy and
    sampled with top_p 0.95 within 5%. The held-out checks are bench/gpu_serve_models.py's."""
    spec, target = load_model_spec("llama-3.2-1b"), Target(get_gpu("h200"))
    plan = InferPlan(batch=256, prompt_len=256, gen_len=128, continuous_batching=True, temperature=temperature,
                     top_p=top_p, max_batch_size=256)
    ratio = infer_time(spec, plan, target).figures["output_tokens_per_s"] / measured
    assert 0.95 < ratio < 1.05, ratio


def test_train_recommendations_stay_runnable() -> None:
    """Under DeepSpeed copt train does not compile: advise neither prices nor recommends a compiled ZeRO step."""
    spec, target = load_model_spec("llama-3.2-1b"), api.resolve_target("h200", gpus=2)[0]
    result = api.advise(spec, target, TrainPlan(micro_batch=8, seq_len=2048, zero=2), ["low-mfu"],
                        model_arg="llama-3.2-1b")
    assert "operator-fusion" not in [r["id"] for r in result["recommendations"]]
    assert result["assumptions"]["mfu"] == cal.TRAIN_MFU_EAGER


DATA = Path(__file__).resolve().parents[1] / "data"
GIVEN = {"model": None, "micro_batch": None, "seq_len": None, "precision": None, "grad_accum": None,
         "activation_checkpointing": None, "batch": None, "prompt_len": None, "gen_len": None, "gpu": None,
         "gpus": None, "memory_budget": None, "compile": None, "loss_impl": None, "temperature": None}


def _endpoint_profile(tmp_path: Path) -> Path:
    level = {"requests": 8, "completed": 8, "duration_s": 1.0, "request_throughput": 8.0,
             "ttft_s": {"p50": 0.02}, "tpot_s": {"p50": 0.002}, "itl_s": {"p50": 0.002}, "e2e_s": {"p50": 0.3}}
    report = {"schema_version": "copt.profile/1", "kind": "endpoint", "mode": "endpoint",
              "created_at": "2026-12-01T00:00:00Z", "copt_version": "0", "hardware": {"device": "remote"},
              "model": {"name": "llama-1b"},
              "workload": {"url": "http://127.0.0.1:8000", "concurrency": [1, 8], "prompt_len": 128, "gen_len": 64,
                           "temperature": 1.0},
              "metrics": {"ttft_s": 0.02, "tpot_s": 0.002, "output_tokens_per_s": 900.0},
              "levels": [{**level, "concurrency": 1, "output_tokens_per_s": 400.0},
                         {**level, "concurrency": 8, "output_tokens_per_s": 900.0}],
              "verdict": {"bottleneck": "unknown"}}
    path = tmp_path / "endpoint.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize(("name", "batch", "figures"), [
    ("endpoint", 8, {"ttft_s": 0.02, "tpot_s": 0.002, "output_tokens_per_s": 900.0}),
    ("guidellm_report.json", 16, {"ttft_s": 0.048, "tpot_s": 0.0031, "output_tokens_per_s": 4544.0}),
    ("vllm_bench_serve.json", 64, {"ttft_s": 0.1504, "tpot_s": 0.0175, "output_tokens_per_s": 3320.0}),
])
def test_from_profile_reads_endpoint_guidellm_and_vllm_reports(tmp_path, name, batch, figures) -> None:
    from clusteropt_cli.core.profile.report import load_profile

    path = _endpoint_profile(tmp_path) if name == "endpoint" else DATA / name
    report = load_profile(str(path))
    task, values, _symptoms, measured = api.defaults_from_profile(report, "train", dict(GIVEN))
    assert task == "infer" and values["batch"] == batch  # the level the metrics are from, not the list
    for key, value in figures.items():
        assert measured[key] == pytest.approx(value)
    if name != "endpoint":  # the workload the tool sent
        assert (values["prompt_len"], values["gen_len"]) == (512, 128)
    else:  # sampled requests are priced as sampled
        assert values["temperature"] == 1.0


def _guidellm_0_8(body: dict | None) -> dict:
    """tests/data/guidellm_report.json in guidellm 0.8's layout: no `args`, the backend (its model, the extra body the
    requests carried) under config.spec and each benchmark's config."""
    doc = json.loads((DATA / "guidellm_report.json").read_text())
    doc.pop("args")
    backend = {"kind": "openai_http", "target": "http://127.0.0.1:8000", "model": "/models/llama-1b",
               "extras": {"method": None, "body": body}}
    doc["config"] = {"spec": {"backend": backend}}
    for bench in doc["benchmarks"]:
        bench["config"]["backend"] = backend
    return doc


@pytest.mark.parametrize(("body", "sent"), [
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 40}, {"temperature": 0.7, "top_p": 0.9, "top_k": 40}),
    (None, {"temperature": 1.0}),  # no temperature sent: the server's default, the OpenAI 1.0
])
def test_from_profile_prices_the_sampling_guidellm_sent(body, sent) -> None:
    """guidellm 0.8 keeps what its requests carried in its backend's extra body (`--backend
    kind=openai_http,...,extras.body.temperature=0`); a run without one sent no temperature, so the server's default
    applied: advise prices that (sampled at 1.0) rather than greedy decoding, and reads the model from the backend."""
    from clusteropt_cli.core.profile.external import external_report

    report = external_report(_guidellm_0_8(body), "guidellm")
    assert report.model == {"name": "/models/llama-1b"}
    _task, values, _symptoms, _measured = api.defaults_from_profile(report, "infer", {**GIVEN, "top_p": None,
                                                                                      "top_k": None})
    assert {key: values[key] for key in sent} == sent
    assert ("sampling" in report.workload) == (body is None)


def test_a_tester_that_sent_no_temperature_is_priced_at_the_models_defaults(tmp_path) -> None:
    """No temperature in guidellm's requests: the server applied the model's generation_config.json (vLLM and copt
    serve alike), so a local model directory's temperature / top_p / top_k price the run; a typed flag still wins."""
    from clusteropt_cli.core.profile.external import external_report

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    report = external_report(_guidellm_0_8(None), "guidellm")
    given = {**GIVEN, "model": str(tmp_path), "top_p": None, "top_k": None}
    _task, values, _symptoms, _measured = api.defaults_from_profile(report, "infer", given)
    assert (values["temperature"], values["top_p"], values["top_k"]) == (0.6, 0.9, None)
    _task, values, _symptoms, _measured = api.defaults_from_profile(report, "infer", {**given, "temperature": 0.0})
    assert values["temperature"] == 0.0


def test_from_profile_reads_vllm_bench_serves_greedy_default() -> None:
    """`vllm bench serve` sends temperature 0 unless --temperature is given: its report is priced greedy, or as the
    sampling it records."""
    from clusteropt_cli.core.profile.external import external_report

    doc = json.loads((DATA / "vllm_bench_serve.json").read_text())
    assert external_report(doc, "vllm-bench").workload["temperature"] == 0.0
    assert external_report({**doc, "temperature": 1.0, "top_p": 0.95}, "vllm-bench").workload["top_p"] == 0.95


@pytest.mark.parametrize(("document", "names"), [
    ({"note": "cut", "benchmarks": [{"requests": []}]}, ("guidellm", "vllm bench serve", "copt profile")),
    ([1, 2], ("guidellm", "vllm bench serve", "copt profile")),
    ({"schema_version": "copt.profile/9", "kind": "model"}, ("copt.profile/9", "copt profile")),
])
def test_from_profile_names_the_formats_it_reads(tmp_path, document, names) -> None:
    """A JSON file that is no format --from-profile reads (a guidellm report cut to its requests, a list, a newer
    copt profile) fails with exit code 2, the file named, and a hint naming what it does read."""
    from clusteropt_cli.core.profile.report import load_profile
    from clusteropt_cli.errors import BadInputError

    path = tmp_path / "report.json"
    path.write_text(json.dumps(document))
    with pytest.raises(BadInputError) as info:
        load_profile(str(path))
    text = f"{info.value} {info.value.hint}"
    assert str(path) in text and info.value.exit_code == 2
    for name in names:
        assert name in text, name


def test_profile_endpoint_expect_takes_the_recipes_server_and_workload(tmp_path) -> None:
    from clusteropt_cli.core.profile.expect import endpoint_values_from_recipe, load_expectation

    spec, target = load_model_spec("llama-3.2-1b"), api.resolve_target("h200")[0]
    result = api.advise(spec, target, InferPlan(batch=32, prompt_len=256, gen_len=64, continuous_batching=True,
                                                temperature=0.7), model_arg="llama-3.2-1b")
    exp = load_expectation(str(api.emit_recipe(result, "llama-3.2-1b", tmp_path / "serve.yaml")))
    given = {"url": None, "model": None, "concurrency": [], "prompt_len": None, "gen_len": None, "temperature": None}
    values = endpoint_values_from_recipe(exp, given)
    assert values == {"url": "http://127.0.0.1:8000", "model": "llama-3.2-1b", "concurrency": [32],
                      "prompt_len": 256, "gen_len": 64, "temperature": 0.7}
    typed = endpoint_values_from_recipe(exp, {**given, "concurrency": [4], "url": "http://h:1"})
    assert typed["concurrency"] == [4] and typed["url"] == "http://h:1"
    # truncated sampling: the plan's top_p / top_k are what the check sends
    result = api.advise(spec, target, InferPlan(batch=32, prompt_len=256, gen_len=64, continuous_batching=True,
                                                temperature=1.0, top_p=0.95, top_k=40), model_arg="llama-3.2-1b")
    exp = load_expectation(str(api.emit_recipe(result, "llama-3.2-1b", tmp_path / "serve-topp.yaml")))
    values = endpoint_values_from_recipe(exp, {**given, "top_p": None, "top_k": None})
    assert (values["temperature"], values["top_p"], values["top_k"]) == (1.0, 0.95, 40)


@pytest.mark.parametrize(("precision", "ckpt"), [("fp32", False), ("bf16", False), ("bf16", True)])
def test_cpu_prediction_prices_the_fused_loss_copt_runs(fixtures, precision: str, ckpt: bool) -> None:
    """On the CPU copt train (and profile model) use the fused loss too: advise's CPU quantity follows it
    (measured by copt profile model's counters on the fixture teacher)."""
    import torch

    from clusteropt_cli.core.advise.memory import cpu_training_bytes
    from clusteropt_cli.core.profile.model import profile_model
    from clusteropt_cli.core.profile.settings import ModelProfileSettings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = profile_model(ModelProfileSettings(model=str(fixtures.teacher), mode="train", device="cpu",
                                                    micro_batch=4, seq_len=128, precision=precision,
                                                    activation_checkpointing=ckpt, warmup=0, repeats=1))
    finally:
        torch.set_num_threads(threads)
    plan = TrainPlan(micro_batch=4, seq_len=128, precision=precision, activation_checkpointing=ckpt)
    spec = load_model_spec(str(fixtures.teacher))
    assert plan.loss(spec) == "fused"
    predicted = cpu_training_bytes(spec, plan)["peak_mem_bytes"]
    assert predicted == pytest.approx(report.metrics["peak_mem_bytes"], rel=0.12)


def test_endpoint_expect_names_why_nothing_compares(tmp_path) -> None:
    """A serve recipe emitted for --gpu cpu predicts no latency: the error says so instead of repeating the
    pairing hint."""
    from clusteropt_cli.core.profile.expect import compare_to_prediction, load_expectation
    from clusteropt_cli.core.profile.report import load_profile
    from clusteropt_cli.errors import BadInputError

    spec, target = load_model_spec("llama-3.2-1b"), api.resolve_target("cpu", memory_budget_gib=64)[0]
    result = api.advise(spec, target, InferPlan(batch=4, continuous_batching=True), model_arg="llama-3.2-1b")
    exp = load_expectation(str(api.emit_recipe(result, "llama-3.2-1b", tmp_path / "serve.yaml")))
    report = load_profile(str(_endpoint_profile(tmp_path)))
    with pytest.raises(BadInputError, match="no speed model for a CPU target") as info:
        compare_to_prediction(report, exp, 0.1)
    assert "--gpu NAME" in info.value.hint


def test_clients_beyond_the_engines_concurrency_wait_instead_of_joining_the_step() -> None:
    """256 streaming clients against copt serve at --max-batch-size 64: the decode step runs 64 sequences
    (TPOT and throughput as with 64 clients) and the other clients wait for places in waves of 64: the median
    request's wave starts after (256 / 2) // 64 = 2 rounds — H200 runs of bench/gpu_serve_models.py on the 8B shape:
    TPOT p50 9.7 ms at 64 clients and 13.5 ms at 256 (not the 2-3x a 256-row step would cost); TTFT p50 3.19 s at
    256 against 0.37 s at 64 with rounds of 1.42 s."""
    spec, target = load_model_spec("llama-3.1-8b"), Target(get_gpu("h200"))

    def figures(batch: int, **kw) -> dict:
        plan = InferPlan(batch=batch, prompt_len=256, gen_len=128, continuous_batching=True, **kw)
        return infer_time(spec, plan, target).figures

    at64, at256 = figures(64, max_batch_size=64), figures(256, max_batch_size=64)
    capped, default = figures(256, max_batch_size=256), figures(256)
    assert at256["running_seqs"] == 64 and capped["running_seqs"] == 256
    assert default == capped  # copt serve's default cap is 256 (vLLM's --max-num-seqs below 70 GiB)
    assert at256["decode_step_s"] == pytest.approx(at64["decode_step_s"])
    # a client's TPOT spans the prefill of the requests around it: half a round's when everyone runs at once, the
    # whole round's when clients queue for the places requests free
    assert at64["tpot_s"] == pytest.approx((128 * at64["decode_step_s"] + 0.5 * at64["prefill_s"]) / 127)
    assert at256["tpot_s"] == pytest.approx((128 * at64["decode_step_s"] + at64["prefill_s"]) / 127)
    assert at256["output_tokens_per_s"] == pytest.approx(at64["output_tokens_per_s"])
    # a round: everyone's prompts, 128 decode steps, and what the API process adds per request of it
    round_s = at64["prefill_s"] + 128 * at64["decode_step_s"] + 64 * cal.SERVING_ENGINES["copt"]["http_stream_s"]
    assert at256["ttft_s"] == pytest.approx(at64["ttft_s"] + 2 * round_s)
    assert capped["decode_step_s"] > 1.5 * at64["decode_step_s"]  # 256 rows per step when the engine takes them


@pytest.mark.parametrize(("model", "prompt", "measured_ms"), [
    ("llama-3.2-1b", 32, 3.92), ("llama-3.2-1b", 256, 4.59), ("llama-3.1-8b", 32, 10.43), ("llama-3.1-8b", 256, 13.98)])
def test_batch1_ttft_is_the_captured_prefill_copt_serve_runs(model, prompt, measured_ms) -> None:
    """A lone prompt is prefilled by one captured graph (runner.PrefillGraph): advise prices that, not the packed
    eager step whose host launches made batch-1 TTFT 31-47 ms. Measured: in-process engine on an H200, median of 5
    (docs/benchmarks.md#time-to-first-token)."""
    from clusteropt_cli.core.advise.calibration import SERVING_ENGINES

    server_ms = SERVING_ENGINES["copt"]["http_request_s"] * 1e3  # what `copt serve` adds (HTTP, first SSE event)
    plan = InferPlan(batch=1, prompt_len=prompt, gen_len=1, continuous_batching=True)
    ttft_ms = infer_time(load_model_spec(model), plan, Target(get_gpu("h200"))).figures["ttft_s"] * 1e3
    assert abs((ttft_ms - server_ms) / measured_ms - 1) < 0.15, ttft_ms
    beyond = InferPlan(batch=1, prompt_len=4096, gen_len=1, continuous_batching=True)  # past the largest graph
    assert infer_time(load_model_spec(model), beyond, Target(get_gpu("h200"))).figures["ttft_s"] * 1e3 > 2 * ttft_ms


# One streaming request at a time through `copt serve`, 256-token prompts: TTFT p50 greedy / sampled (temperature 1,
# top_p 0.95 for the script's client and the profile endpoint), H200, 2026-12-02 (bench/gpu_serve_models.py
# --tester-modes sampled,greedy at 8aee225; the script's client median of three).
B1_TTFT_GREEDY_SAMPLED_MS = {
    ("llama-3.1-8b", "copt client"): (16.79, 16.48), ("llama-3.1-8b", "guidellm"): (16.08, 15.96),
    ("llama-3.1-8b", "profile endpoint"): (16.97, 17.04), ("llama-3.2-1b", "copt client"): (8.78, 7.76),
    ("llama-3.2-1b", "guidellm"): (7.37, 6.82), ("llama-3.2-1b", "profile endpoint"): (8.77, 8.66)}


@pytest.mark.parametrize("case", sorted(B1_TTFT_GREEDY_SAMPLED_MS))
def test_batch1_ttft_of_a_sampled_request_through_copt_serve(case) -> None:
    """In-process the sampling graph adds ~0.9 ms to a sampled request's first token; through `copt serve` sampled and
    greedy first tokens come within 1 ms of each other (sampled −0.2 ms on average), so advise prices them the same.
    guidellm's sampled figure on the 1B (6.82 ms) is 1.5-2 ms below the other clients'."""
    model, client = case
    spec, target = load_model_spec(model), Target(get_gpu("h200"))

    def ttft_ms(temperature: float) -> float:
        plan = InferPlan(batch=1, prompt_len=256, gen_len=128, continuous_batching=True, temperature=temperature,
                         top_p=0.95 if temperature else 1.0)
        return infer_time(spec, plan, target).figures["ttft_s"] * 1e3

    assert ttft_ms(1.0) == pytest.approx(ttft_ms(0.0))
    greedy, sampled = B1_TTFT_GREEDY_SAMPLED_MS[case]
    assert ttft_ms(0.0) / greedy == pytest.approx(1.0, abs=0.15)
    if case == ("llama-3.2-1b", "guidellm"):
        assert ttft_ms(1.0) / sampled == pytest.approx(1.20, rel=0.03)
    else:
        assert ttft_ms(1.0) / sampled == pytest.approx(1.0, abs=0.15)


@pytest.mark.parametrize(("model", "measured_ms"), [("llama-3.2-1b", 8.2), ("llama-3.1-8b", 17.0)])
def test_batch1_ttft_through_copt_serve(model, measured_ms) -> None:
    """One streaming greedy request of 256 prompt tokens at a time through `copt serve` on an H200
    (bench/gpu_serve_models.py, docs/benchmarks.md#real-model-sizes-copts-defaults-other-clients)."""
    plan = InferPlan(batch=1, prompt_len=256, gen_len=128, continuous_batching=True)
    ttft_ms = infer_time(load_model_spec(model), plan, Target(get_gpu("h200"))).figures["ttft_s"] * 1e3
    assert abs(ttft_ms / measured_ms - 1) < 0.15, ttft_ms


def test_stacking_skips_plans_copt_train_does_not_take() -> None:
    """The top plan for an out-of-memory case stacks recommendations; a stack copt train's recipe schema refuses
    (pipeline stages on top of ZeRO) is skipped, so the emitted recipe always validates."""
    from clusteropt_cli.core.advise.api import _copt_train_runs
    from clusteropt_cli.core.advise.recommend import Context

    spec = load_model_spec("llama-3.1-70b")
    target = api.resolve_target("h100-sxm", gpus=8)[0]
    ctx = Context(spec, target, TrainPlan(), lambda p: {}, {}, "llama-3.1-70b")
    assert _copt_train_runs(TrainPlan(zero=3, offload="cpu", activation_checkpointing=True), ctx)
    assert not _copt_train_runs(TrainPlan(zero=3, offload="cpu", pp=8), ctx)
    assert _copt_train_runs(TrainPlan(pp=8, pp_micro_batches=8, grad_accum=8), ctx)
