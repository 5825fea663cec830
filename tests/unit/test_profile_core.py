"""Unit tests of copt profile's core: statistics, saved-tensor memory tracking, settings, verdicts, --expect."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.profile.endpoint import RequestResult, completions_url, summarize_level
from clusteropt_cli.core.profile.expect import (
    Expectation,
    compare_to_prediction,
    load_expectation,
    model_values_from_recipe,
)
from clusteropt_cli.core.profile.report import SYMPTOMS, HardwareInfo, ProfileReport, Verdict
from clusteropt_cli.core.profile.settings import EndpointSettings, ModelProfileSettings
from clusteropt_cli.core.profile.stats import latency_summary, percentile, spread
from clusteropt_cli.core.profile.verdict import endpoint_verdict, model_verdict
from clusteropt_cli.errors import BadInputError


def test_percentiles_match_linear_interpolation():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    sp = spread(values)
    assert (sp.median, sp.min, sp.max, sp.n) == (3.0, 1.0, 5.0, 5)
    assert latency_summary([]) == {}
    assert latency_summary([1.0, 3.0])["mean"] == 2.0


def test_saved_tensor_tracker_counts_live_storages_once_and_releases_them():
    import torch

    from clusteropt_cli.core.profile.memory import SavedTensorTracker

    weight = torch.nn.Parameter(torch.randn(256, 256))
    tracker = SavedTensorTracker({weight.untyped_storage().data_ptr()})
    x = torch.randn(64, 256, requires_grad=True)
    with tracker.hooks():
        h = x @ weight  # saves x (64×256 fp32 = 64 KiB) and the parameter (excluded)
        y = torch.tanh(h)  # saves its output y (64 KiB)
        z = (y * y).sum()  # saves y twice: same storage, counted once
        assert tracker.current == 2 * 64 * 256 * 4
        z.backward()
    assert tracker.peak == 2 * 64 * 256 * 4
    del z, y, h
    assert tracker.current == 0
    assert weight.grad is not None


def test_model_settings_report_every_problem_naming_flags():
    with pytest.raises(BadInputError) as info:
        ModelProfileSettings(model="m", batch=0, repeats=0, warmup=-1, trace=__import__("pathlib").Path("t.txt"),
                             memory_budget_bytes=-1).validate()
    text = info.value.message
    for flag in ("--batch", "--repeats", "--warmup", "--trace", "--memory-budget"):
        assert flag in text


def test_endpoint_settings_defaults_and_problems():
    s = EndpointSettings(url="http://h:1", model="m")
    s.validate()
    assert s.concurrency == [1] and s.requests_for(1) == 8 and s.requests_for(32) == 128 and s.requests_for(None) == 32
    assert EndpointSettings(url="http://h", model="m", duration_s=2).requests_for(4) is None
    with pytest.raises(BadInputError) as info:
        EndpointSettings(url="ftp://h", model="", concurrency=[0], rate=[-1], prompt_len=0).validate()
    for flag in ("--url", "--model", "--concurrency", "--rate", "--prompt-len"):
        assert flag in info.value.message
    assert completions_url("http://h:8000") == "http://h:8000/v1/completions"
    assert completions_url("http://h:8000/v1/") == "http://h:8000/v1/completions"


def _result(ttft: float, e2e: float, tokens: int) -> RequestResult:
    return RequestResult(ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, itl_s=[(e2e - ttft) / (tokens - 1)]
                         * (tokens - 1))


def test_summarize_level_percentiles_goodput_and_errors():
    results = [_result(0.1, 1.1, 11), _result(0.3, 2.3, 11), RequestResult(ok=False, error="http_500"),
               RequestResult(ok=False, error="connect"), RequestResult(ok=False, error="connect")]
    level = summarize_level(results, 2.0, concurrency=4, slo_ttft_s=0.2, slo_tpot_s=0.15)
    assert (level.requests, level.completed) == (5, 2)
    assert level.errors == {"http_500": 1, "connect": 2}
    assert level.output_tokens_per_s == pytest.approx(22 / 2.0)
    assert level.tpot_s["p50"] == pytest.approx((0.1 + 0.2) / 2)
    assert level.ttft_s["p90"] == pytest.approx(0.1 + 0.9 * 0.2)
    assert level.goodput == pytest.approx(0.5)  # only the first meets TTFT ≤ 200 ms


def test_model_verdicts():
    budget = model_verdict("train", {"peak_mem_bytes": 3e9, "mfu": 0.5}, device="cuda", memory_bytes=80e9,
                           budget_bytes=2 * 1024**3, oom=False, batch=1)
    assert budget.bottleneck == "memory-capacity-bound" and budget.symptoms == ["oom"]
    near = model_verdict("train", {"peak_mem_bytes": 70e9, "peak_reserved_bytes": 79e9}, device="cuda",
                         memory_bytes=80e9, budget_bytes=None, oom=False, batch=1)
    assert near.bottleneck == "memory-capacity-bound"
    compute = model_verdict("train", {"mfu": 0.5, "device_busy_frac": 0.95}, device="cuda", memory_bytes=80e9,
                            budget_bytes=None, oom=False, batch=8)
    assert compute.bottleneck == "compute-bound" and compute.symptoms == []
    idle = model_verdict("train", {"mfu": 0.05, "device_busy_frac": 0.3}, device="cuda", memory_bytes=80e9,
                         budget_bytes=None, oom=False, batch=1)
    assert idle.bottleneck == "overhead-bound" and "low-mfu" in idle.symptoms
    decode = model_verdict("infer", {"ttft_s": 0.01, "decode_s": 1.0, "mbu": 0.7, "mfu": 0.2,
                                     "device_busy_frac": 0.9}, device="cuda", memory_bytes=80e9, budget_bytes=None,
                           oom=False, batch=1)
    assert decode.bottleneck == "memory-bandwidth-bound" and decode.symptoms == ["slow-tpot", "low-throughput"]
    prefill = model_verdict("infer", {"ttft_s": 2.0, "decode_s": 0.5, "mbu": 0.1, "mfu": 0.6,
                                      "device_busy_frac": 0.95}, device="cuda", memory_bytes=80e9,
                            budget_bytes=None, oom=False, batch=64)
    assert prefill.bottleneck == "compute-bound" and prefill.symptoms == ["high-ttft"]
    for v in (budget, near, compute, idle, decode, prefill):
        assert set(v.symptoms) <= set(SYMPTOMS)


def test_endpoint_verdict_saturation_and_slo():
    lo = summarize_level([_result(0.05, 0.5, 11)] * 4, 2.0, concurrency=1)
    hi = summarize_level([_result(0.9, 3.0, 11)] * 4, 2.0, concurrency=16)
    v = endpoint_verdict([lo, hi], slo_ttft_s=0.5, slo_tpot_s=None)
    assert v.bottleneck == "compute-bound"
    assert "high-ttft" in v.symptoms and "low-throughput" in v.symptoms


def _report(metrics: dict) -> ProfileReport:
    return ProfileReport(kind="model", mode="train", created_at="2026-01-01T00:00:00+00:00", copt_version="0",
                         hardware=HardwareInfo(device="cpu"), metrics=metrics,
                         verdict=Verdict(bottleneck="unknown"))


def test_compare_to_prediction_pass_miss_and_unmeasured():
    exp = Expectation(path="r.yaml", task="train", recipe=None,
                      figures={"peak_mem_bytes": 100.0, "tokens_per_s": 1000.0, "mfu": 0.4})
    comparison = compare_to_prediction(_report({"peak_mem_bytes": 108.0, "tokens_per_s": 500.0, "mfu": None}),
                                       exp, tolerance=0.10)
    by_name = {c.name: c for c in comparison.checks}
    assert by_name["peak_mem_bytes"].status == "pass" and by_name["peak_mem_bytes"].rel_error == pytest.approx(0.08)
    assert by_name["tokens_per_s"].status == "miss" and by_name["tokens_per_s"].rel_error == pytest.approx(-0.5)
    assert by_name["mfu"].status == "not-measured"
    assert not comparison.passed and [c.name for c in comparison.misses] == ["tokens_per_s"]
    assert compare_to_prediction(_report({"peak_mem_bytes": 95.0}), Expectation(
        path="r", task="train", recipe=None, figures={"peak_mem_bytes": 100.0}), 0.10).passed
    with pytest.raises(BadInputError, match="none of the predicted figures"):
        compare_to_prediction(_report({}), Expectation(path="r", task="train", recipe=None,
                                                       figures={"ttft_s": 1.0}), 0.1)


def test_expect_recipe_to_settings(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: train\nmodel: some/dir\nmicro_batch: 4\nseq_len: 256\nprecision: fp32\n"
                      "activation_checkpointing: true\nprediction:\n  gpu: cpu\n  budget_bytes: 1000000\n"
                      "  figures:\n    peak_mem_bytes: 123456\n")
    exp = load_expectation(str(recipe))
    values = model_values_from_recipe(exp)
    assert values["mode"] == "train" and values["device"] == "cpu" and values["memory_budget_bytes"] == 1000000
    assert (values["micro_batch"], values["seq_len"], values["activation_checkpointing"]) == (4, 256, True)
    zero = tmp_path / "z.yaml"
    zero.write_text("task: train\nmodel: m\nzero: 3\ngpus: 2\nprediction:\n  figures:\n    step_time_s: 1.0\n")
    with pytest.raises(BadInputError, match="zero=3"):
        model_values_from_recipe(load_expectation(str(zero)))
    bare = tmp_path / "b.yaml"
    bare.write_text("task: train\nmodel: m\n")
    with pytest.raises(BadInputError, match="no prediction.figures"):
        load_expectation(str(bare))


def _profile_in_process(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """copt profile ARGS in this process; a load test or a model measurement that starts fails the test."""
    from clusteropt_cli.app import main
    from clusteropt_cli.core.profile import endpoint, model

    def started(*_args, **_kwargs):
        raise AssertionError("the measurement started")

    monkeypatch.setattr(endpoint, "profile_endpoint", started)
    monkeypatch.setattr(model, "profile_model", started)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(list(args))
    return int(info.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize(("figures", "named"), [
    ("    peak_mem_bytes: -1.0e12\n    step_time_s: 0.05\n", "peak_mem_bytes -1e+12"),
    ("    peak_mem_bytes: 1.0e9\n    step_time_s: 0\n", "step_time_s 0"),
])
@pytest.mark.parametrize("command", ["model", "endpoint"])
def test_expect_refuses_a_prediction_of_zero_or_below_before_measuring(capsys, monkeypatch, tmp_path, figures,
                                                                        named, command):
    """A predicted 0 was reported as 'not measured' (it was), and a negative one passed at --tolerance 1.5
    (-931 GiB predicted, 18 MiB measured: +100%)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"task: {'train' if command == 'model' else 'serve'}\nmodel: m\nprediction:\n  figures:\n"
                      f"{figures}")
    code, err = _profile_in_process(capsys, monkeypatch, "profile", command, "--expect", str(recipe),
                                    "--tolerance", "1.5")
    assert code == 2 and f"--expect {recipe}: predicted {named}: a predicted figure must be positive" in err, err
    # a figure compare_to_prediction is handed anyway is never a check
    exp = Expectation(path="r", task="train", recipe=None, figures={"peak_mem_bytes": -1e12, "step_time_s": 0.05})
    checks = compare_to_prediction(_report({"peak_mem_bytes": 1.8e7, "step_time_s": 0.05}), exp, 1.5).checks
    assert [(c.name, c.status) for c in checks] == [("peak_mem_bytes", "not-measured"), ("step_time_s", "pass")]


@pytest.mark.parametrize(("args", "message"), [
    (["--gen-len", "0"], "--gen-len must be at least 1 token (got 0)"),
    (["--prompt-len", "0"], "--prompt-len must be at least 1 token (got 0)"),
    (["--concurrency", ","], "--concurrency ',' names no value"),
    (["--concurrency", ""], "--concurrency '' names no value"),
    (["--concurrency", " , "], "--concurrency ' , ' names no value"),
    (["--rate", ","], "--rate ',' names no value"),
    (["--tokenizer", "{empty}"], "holds no tokenizer files (none of tokenizer.json, tokenizer_config.json"),
    (["--tokenizer", "{missing}"], "no such directory (a local tokenizer directory; copt never downloads)"),
])
def test_endpoint_load_flags_that_cannot_mean_what_was_typed_are_refused_before_any_request(
        capsys, monkeypatch, tmp_path, args, message):
    """--gen-len 0 and --prompt-len 0 were replaced by the defaults, --concurrency ',' ran the default level 1, and
    a --tokenizer directory without tokenizer files failed as a broken model directory (a missing one: exit 1)."""
    (tmp_path / "empty").mkdir()
    args = [a.format(empty=tmp_path / "empty", missing=tmp_path / "missing") for a in args]
    code, err = _profile_in_process(capsys, monkeypatch, "profile", "endpoint", "--url", "http://127.0.0.1:9",
                                    "--model", "m", *args)
    assert code == 2 and message in " ".join(err.split()), err


def test_a_tokenizer_that_encodes_the_prompt_words_to_nothing_is_refused_not_looped_on(capsys, tmp_path):
    """A --tokenizer whose vocabulary has no token for the synthetic prompts' words (a byte-level class rebuilt over
    another tokenizer's vocabulary did this) made the profile endpoint double an empty token list forever, before
    any request and without a word: exit 2 naming the tokenizer instead."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={"q": 0, "z": 1}, merges=[]))  # no unknown token: other words vanish
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "tok")
    import signal

    from clusteropt_cli.app import main

    def hung(*_args) -> None:
        raise AssertionError("the synthetic prompts never reached --prompt-len")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as info:  # nothing listens on port 9: no request can succeed either
            main(["profile", "endpoint", "--url", "http://127.0.0.1:9", "--model", "m", "--tokenizer",
                  str(tmp_path / "tok"), "--duration", "1"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    code, err = int(info.value.code or 0), capsys.readouterr().err
    assert code == 2 and "turns the prompts' English words into no tokens" in " ".join(err.split()), err
    assert "served model's own tokenizer directory" in " ".join(err.split())


def test_a_rate_level_keeps_its_poisson_schedule_on_a_busy_loop():
    """Every request of a --rate level goes out at its own Poisson time, measured from the level's start: a loop that
    spends 1 ms of CPU on each request (a client busy with its streams) sends late but catches up. Sleeping the gaps
    one after another (as the profile endpoint did) sent a share fewer in the level's time."""
    import asyncio
    import gc
    import time

    from clusteropt_cli.core.profile.endpoint import _Runner, poisson_send_times, quiet_heap

    settings = EndpointSettings(url="http://127.0.0.1:9", model="m", rate=[400.0], duration_s=0.5, warmup=0)
    runner = _Runner(settings, client=None, prompts=["a prompt"])
    sent: list[float] = []

    async def busy_request() -> RequestResult:
        sent.append(time.perf_counter())
        time.sleep(0.001)  # the loop's own work: not a yield
        await asyncio.sleep(0.02)
        return RequestResult(ok=True, ttft_s=0.01, output_tokens=4)

    runner.request = busy_request
    quiet_heap()  # as profile_endpoint runs a level: a full garbage collection mid-level would stall the sends
    try:
        results, duration = asyncio.run(runner.by_rate(400.0))
    finally:
        gc.unfreeze()
    schedule = list(poisson_send_times(400.0, duration_s=0.5, seed=settings.seed))
    assert len(results) == len(schedule) > 150
    assert len(runner.send_lag_s) == len(schedule)
    assert sorted(runner.send_lag_s)[len(schedule) // 2] < 0.005  # the median request went out on time
    assert sent[-1] - sent[0] == pytest.approx(schedule[-1], abs=0.05)
    assert duration >= schedule[-1]


def test_the_loop_lag_sampler_sees_a_blocked_event_loop():
    """LoopLag: a coroutine that holds the event loop for 60 ms (a client parsing a burst of streamed tokens) makes the
    sampler wake at least ~50 ms late once; a loop that only sleeps wakes late by far less."""
    import asyncio
    import time

    from clusteropt_cli.core.profile.endpoint import LoopLag

    async def blocked() -> list[float]:
        async with LoopLag(interval_s=0.005) as lag:
            await asyncio.sleep(0.03)
            time.sleep(0.06)  # not a yield: the loop can do nothing else meanwhile
            await asyncio.sleep(0.03)
        return lag.samples

    async def idle() -> list[float]:
        async with LoopLag(interval_s=0.005) as lag:
            await asyncio.sleep(0.1)
        return lag.samples

    samples = asyncio.run(blocked())
    assert max(samples) >= 0.05 and all(s >= 0 for s in samples)
    quiet = asyncio.run(idle())
    assert len(quiet) >= 5 and sorted(quiet)[len(quiet) // 2] < 0.05


def test_a_level_on_a_busy_client_loop_records_the_lag_and_says_so(monkeypatch, tmp_path):
    """A concurrency level whose requests hold the client's event loop (each 30 ms of work without a yield, a TTFT
    of 5 ms): the level records the loop's lag (`client_loop_lag_s`) and the run warns that its TTFT includes the
    client's own backlog, and `--expect` on that level says so too."""
    import asyncio
    import time

    from clusteropt_cli.core.profile import endpoint

    async def busy_request(self) -> RequestResult:
        time.sleep(0.03)
        await asyncio.sleep(0.001)
        return RequestResult(ok=True, ttft_s=0.005, e2e_s=0.02, output_tokens=4)

    async def no_cache(*_args, **_kwargs):
        return None

    monkeypatch.setattr(endpoint._Runner, "request", busy_request)
    monkeypatch.setattr(endpoint, "read_prefix_cache", no_cache)
    lines: list[str] = []
    settings = EndpointSettings(url="http://127.0.0.1:9", model="m", concurrency=[4], num_requests=12, warmup=0,
                                client_processes=1)
    report = endpoint.profile_endpoint(settings, log=lines.append)
    lag = report.levels[0].client_loop_lag_s
    assert lag is not None and lag["p90"] >= endpoint.LOOP_LAG_WARN_S
    assert any("the client's event loop ran late" in line and "--client-processes" in line for line in lines)
    # --expect against that level: the comparison carries the caveat (the client's backlog is not predicted)
    recipe = tmp_path / "serve.yaml"
    recipe.write_text("task: serve\nmodel: m\nprediction:\n  figures:\n    closed_loop_ttft_s: 0.005\n"
                      "    closed_loop_tpot_s: 0.005\n    closed_loop_output_tokens_per_s: 100.0\n"
                      "  assumptions:\n    concurrency: 4\n    closed_loop_requests: 12\n")
    comparison = compare_to_prediction(report, load_expectation(str(recipe)), 0.15)
    assert comparison.level == "concurrency 4" and len(comparison.caveats) == 1
    assert "client's own backlog" in comparison.caveats[0]
    report.levels[0].client_loop_lag_s = {"p50": 0.0, "p90": 0.001, "p99": 0.002, "mean": 0.0}
    assert compare_to_prediction(report, load_expectation(str(recipe)), 0.15).caveats == []


def test_poisson_send_times_follow_the_seed_and_the_bounds():
    from clusteropt_cli.core.profile.endpoint import poisson_send_times

    times = list(poisson_send_times(50.0, duration_s=4.0, seed=3))
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 4.0
    assert 150 < len(times) < 250  # 200 expected
    assert times == list(poisson_send_times(50.0, duration_s=4.0, seed=3))
    assert times != list(poisson_send_times(50.0, duration_s=4.0, seed=4))
    assert list(poisson_send_times(50.0, requests=7, seed=3)) == times[:7]
    with pytest.raises(ValueError):
        next(poisson_send_times(0.0, requests=1))


@pytest.mark.parametrize("load", [{"rate": [200.0]}, {"concurrency": [4]}])
def test_a_level_runs_with_the_heap_out_of_the_collectors_way(monkeypatch, load):
    """While a level runs, what existed before it (tokenizer, prompts, earlier results) is frozen out of the garbage
    collector's full collections, which stop the loop that sends and times every request (on the H200 host one held
    a rate level's sends up to 0.28 s); the run gives it back when it ends, also when it fails."""
    import gc

    import clusteropt_cli.core.profile.endpoint as endpoint

    frozen: list[int] = []

    async def fake_request(client, url, payload, options, timeout_s):
        frozen.append(gc.get_freeze_count())
        return RequestResult(ok=True, ttft_s=0.001, e2e_s=0.002, output_tokens=2)

    async def no_metrics(client, url, options):
        return None

    monkeypatch.setattr(endpoint, "one_request", fake_request)
    monkeypatch.setattr(endpoint, "read_prefix_cache", no_metrics)
    settings = EndpointSettings(url="http://127.0.0.1:9", model="m", num_requests=6, warmup=0, gen_len=2,
                                client_processes=1, **load)
    report = endpoint.profile_endpoint(settings)
    assert report.levels[0].completed == 6 and len(frozen) == 6
    assert min(frozen) > 1000  # the run's objects, frozen
    assert gc.get_freeze_count() == 0

    async def failing(client, url, payload, options, timeout_s):
        raise RuntimeError("boom")

    monkeypatch.setattr(endpoint, "one_request", failing)
    with pytest.raises(RuntimeError):
        endpoint.profile_endpoint(settings)
    assert gc.get_freeze_count() == 0


def test_a_full_closed_loops_missed_ttft_says_what_its_tok_s_and_tpot_imply():
    """A closed-loop level whose decode is several times its TTFT (the H200's 1B shape at 256 clients, sampled, 30 s:
    22,475 tok/s, TTFT p50 167 ms, e2e p50 1.44 s): a missed TTFT gets a caveat with the cycle and decode in TTFTs and
    the TTFT the prediction's tok/s and TPOT errors alone imply; a level whose TTFT is most of the request, or whose
    TTFT passed, gets none."""
    from types import SimpleNamespace

    from clusteropt_cli.core.profile.expect import FigureCheck, explain_amplified_ttft

    def checks(ttft_pred, ttft, status="miss"):
        return [FigureCheck("ttft_s", ttft_pred, ttft, ttft_pred / ttft - 1, status, "closed loop"),
                FigureCheck("tpot_s", 7.42e-3, 10.056e-3, -0.262, "miss", "closed loop"),
                FigureCheck("output_tokens_per_s", 26_770.0, 22_475.0, 0.191, "miss", "closed loop")]

    level = SimpleNamespace(concurrency=256, request_throughput=22_475 / 128, ttft_s={"p50": 0.1671},
                            e2e_s={"p50": 0.1671 + 127 * 10.056e-3})
    caveats = explain_amplified_ttft(level, checks(0.2854, 0.1671), 0.15)[1]
    assert len(caveats) == 1
    assert "cycle was 8.7× the TTFT p50" in caveats[0] and "decode 7.6×" in caveats[0]
    assert "2.2" in caveats[0].split("alone put it at ")[1][:5]  # exp(-8.7 ln 1.19 + 7.6 ln 1.355) ≈ 2.2
    assert explain_amplified_ttft(level, checks(0.17, 0.1671, "pass"), 0.15)[1] == []
    lone = SimpleNamespace(concurrency=2, request_throughput=2 / 1.0, ttft_s={"p50": 0.8}, e2e_s={"p50": 1.0})
    assert explain_amplified_ttft(lone, checks(0.5, 0.8), 0.15)[1] == []


def test_a_full_closed_loops_ttft_missed_by_what_its_tok_s_and_tpot_imply_is_explained_not_missed():
    """The 3B shape on an H100, 256 greedy clients, 15 s (docs/benchmarks.md): 13,288 tok/s, TTFT p50 213 ms, TPOT
    17.3 ms, replayed 1.00 / 0.60 / 1.05. tok/s and TPOT pass, and 1.05 on the TPOT alone implies a TTFT at 0.60×
    through the loop's cycle (11.6 TTFTs) and decode (10.3): the TTFT's 0.60 is marked explained and the check
    passes. A TTFT its tok/s and TPOT do not explain, or one beside a failed tok/s, stays a miss."""
    from types import SimpleNamespace

    from clusteropt_cli.core.profile.expect import Comparison, FigureCheck, explain_amplified_ttft

    def checks(ttft_pred, tok_pred=13_288.0, tol=0.15):
        made = [(("ttft_s", ttft_pred, 0.213)), ("tpot_s", 17.3e-3 * 1.05, 17.3e-3),
                ("output_tokens_per_s", tok_pred, 13_288.0)]
        return [FigureCheck(name, pred, meas, pred / meas - 1, "pass" if abs(pred / meas - 1) <= tol else "miss",
                            "closed loop") for name, pred, meas in made]

    level = SimpleNamespace(concurrency=256, request_throughput=13_288 / 128, ttft_s={"p50": 0.213},
                            e2e_s={"p50": 0.213 + 127 * 17.3e-3})
    explained, caveats = explain_amplified_ttft(level, checks(0.213 * 0.60), 0.15)
    assert [c.status for c in explained] == ["explained", "pass", "pass"]
    assert "0.60× the measured TTFT (predicted 0.60×)" in caveats[0] and "marked explained" in caveats[0]
    assert Comparison("r.yaml", 0.15, explained).passed

    unexplained, caveats = explain_amplified_ttft(level, checks(0.213 * 1.5), 0.15)
    assert unexplained[0].status == "miss" and "more than its tok/s and TPOT errors explain" in caveats[0]
    assert not Comparison("r.yaml", 0.15, unexplained).passed
    beside_a_miss, caveats = explain_amplified_ttft(level, checks(0.213 * 0.60, tok_pred=13_288 * 1.3), 0.15)
    assert beside_a_miss[0].status == "miss" and "explained" not in caveats[0]


def test_a_password_in_the_url_is_never_shown() -> None:
    """`--url http://user:secret@host` was echoed whole in errors and written into the report's workload."""
    from clusteropt_cli.core.profile.settings import shown_url
    from clusteropt_cli.errors import BadInputError

    assert shown_url("http://user:s3cret@127.0.0.1:8000/v1") == "http://user:***@127.0.0.1:8000/v1"
    assert shown_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    with pytest.raises(BadInputError) as info:
        EndpointSettings(url="http://user:s3cret@host:0", model="m").validate()
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


def test_all_failed_names_a_non_openai_server_only_where_its_responses_said_so():
    """With no request sent there is no response to judge: the hint must not blame the server's format."""
    from clusteropt_cli.core.profile.endpoint import _all_failed
    from clusteropt_cli.errors import CheckFailedError

    s = EndpointSettings(url="http://127.0.0.1:9", model="m", concurrency=[1])
    malformed = _all_failed(s, [], {"bad_stream": "an event is not JSON (JSONDecodeError)"})
    assert isinstance(malformed, CheckFailedError) and "OpenAI-compatible" in malformed.hint
    nothing = _all_failed(s, [], {})
    assert isinstance(nothing, CheckFailedError) and "no requests sent" in nothing.message
    assert "OpenAI-compatible" not in nothing.hint
