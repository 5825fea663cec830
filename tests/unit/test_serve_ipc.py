"""The split server's wire format (ipc.py): requests, results and engine stats survive msgpack unchanged; when the
split server is chosen, and what is said (and what a benchmark does) when its packages are missing."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.serve.engine import EngineStats
from clusteropt_cli.core.serve.ipc import (
    pack,
    request_from_wire,
    request_to_wire,
    result_from_wire,
    result_to_wire,
    stats_from_wire,
    stats_to_wire,
    unpack,
)
from clusteropt_cli.core.serve.requests import GenerationRequest, GenerationResult


def test_a_request_round_trips_with_int_keyed_logit_bias_and_a_grammar_spec():
    req = GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                            presence_penalty=0.2, frequency_penalty=-0.3, repetition_penalty=1.1,
                            logit_bias={5: -100.0, 17: 2.5}, seed=2**64 - 1, logprobs=3, prompt_logprobs=0,
                            stop_token_ids=[9], stop=["\n\n"], ignore_eos=True, min_tokens=2, speculative=False)
    spec = ["response_format", {"type": "json_object"}]
    back, got_spec = request_from_wire(unpack(pack(request_to_wire(req, "0-7", spec))))
    assert got_spec == spec
    assert back.request_id == "0-7" and back.grammar is None
    expected = {**vars(req), "request_id": "0-7"}
    assert vars(back) == expected
    assert all(isinstance(k, int) for k in back.logit_bias)


def test_a_result_round_trips_with_logprobs_as_tuples():
    lp = [(4, -0.5, [(4, -0.5), (8, -1.25)]), (6, -0.1, [(6, -0.1), (2, -3.0)])]
    res = GenerationResult(request_id="0-1", prompt_ids=[1, 2], output_ids=[4, 6], finish_reason="stop", text="ab",
                           stop_reason="\n", ttft_s=0.01, latency_s=0.2, spec_drafted=3, spec_accepted=2,
                           logprobs=lp, prompt_logprobs=[None, (2, -2.0, [(2, -2.0)])], prompt_ranks=[None, 1])
    back = result_from_wire(unpack(pack(result_to_wire(res))), "0-1", [1, 2])
    assert back == res


def test_engine_stats_round_trip():
    stats = EngineStats(running=3, waiting=1, num_slots=8, kv_cache_usage=0.25, steps=10, generated_tokens=99,
                        finished={"stop": 2, "abort": 1}, phase_s={"decode_forward": 1.5})
    assert stats_from_wire(unpack(pack(stats_to_wire(stats)))) == stats


def test_api_server_count_defaults_to_one_on_a_gpu_and_zero_on_a_cpu(monkeypatch):
    """Unset, `--api-server-count` splits the server when the engine runs on a GPU (where the split measured
    1.6-1.7x the single process at 256 clients) and not on a CPU; a value the user gave is kept."""
    import torch

    from clusteropt_cli.core.serve.launch import resolve_api_server_count
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    unset = ServeRecipe(model="/m")
    assert unset.api_server_count is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_api_server_count(unset).api_server_count == 1
    assert resolve_api_server_count(ServeRecipe(model="/m", api_server_count=0)).api_server_count == 0
    assert resolve_api_server_count(ServeRecipe(model="/m", api_server_count=3)).api_server_count == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_api_server_count(unset).api_server_count == 0
    assert resolve_api_server_count(ServeRecipe(model="/m", api_server_count=2)).api_server_count == 2


def test_a_gpu_server_without_its_speed_packages_says_so_and_runs_in_one_process(monkeypatch):
    """On a GPU without pyzmq/msgpack (or uvloop/httptools) copt serve still starts, in one process, and says which
    packages it lacks and how to get them: a benchmark or a user would otherwise measure a slower server than the
    defaults without knowing (seen: a GPU run whose wheels lacked them). On a CPU nothing is said."""
    import importlib.util

    import torch

    from clusteropt_cli.core.serve import launch
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("zmq", "uvloop") else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said: list[str] = []
    settings = launch.resolve_api_server_count(ServeRecipe(model="/m"), warn=said.append)
    assert settings.api_server_count == 0
    assert len(said) == 1 and "pyzmq, uvloop not installed" in said[0] and "one process" in said[0]
    assert "pip install 'clusteropt-cli[serve]'" in said[0]
    said.clear()  # a count the user set is kept; the missing loop is still worth a line
    assert launch.resolve_api_server_count(ServeRecipe(model="/m", api_server_count=0),
                                           warn=said.append).api_server_count == 0
    assert len(said) == 1 and "one process" not in said[0]
    said.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.resolve_api_server_count(ServeRecipe(model="/m"), warn=said.append).api_server_count == 0
    assert said == []


def test_gpu_serving_benchmarks_stop_without_copt_serves_speed_packages(monkeypatch):
    """bench/common.require_serve_speed_packages: on a CUDA machine without pyzmq (say) a serving benchmark exits 2
    naming it before it starts (it would measure the single-process fallback); on a CPU nothing is required."""
    import argparse
    import importlib.util
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from common import missing_serve_speed_packages, require_serve_speed_packages

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "zmq" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert missing_serve_speed_packages() == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert missing_serve_speed_packages() == ["pyzmq"]
    with pytest.raises(SystemExit) as stopped:
        require_serve_speed_packages(argparse.ArgumentParser(prog="bench"))
    assert stopped.value.code == 2
