"""`copt serve --engine vllm`: the command is built for the vLLM version at hand and checked against the flags and
speculative-config keys recorded from vLLM 0.10.0's, 0.11.0's, 0.13.0's and 0.33.0's sources (tests/data/vllm_args/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusteropt_cli.core.serve.vllm import VllmCaps, parse_version, plan_vllm_command
from clusteropt_cli.errors import BadInputError
from clusteropt_cli.recipe.load import load_settings
from clusteropt_cli.recipe.schema.serve import ServeRecipe

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_args"
RECORDED = {v: json.loads((DATA / f"{v}.json").read_text()) for v in ("0.10.0", "0.11.0", "0.13.0", "0.33.0")}


def _accepted(argv: list[str], version: str) -> None:
    """Every flag is one that vLLM's parser of that version defines; the speculative config has only its keys."""
    rec = RECORDED[version]
    flags = [a for a in argv[3:] if a.startswith("--")]
    assert flags and not set(flags) - set(rec["flags"]), set(flags) - set(rec["flags"])
    if "--speculative-config" in argv:
        keys = json.loads(argv[argv.index("--speculative-config") + 1])
        assert not set(keys) - set(rec["speculative_config_keys"])


EVERYTHING = dict(model="/m", engine="vllm", port=9000, api_key="k", dtype="bf16", served_model_name="m",
                  tokenizer="/t", max_batch_tokens=4096, max_batch_size=128, max_model_len=8192, block_size=16,
                  gpu_memory_utilization=0.8, kv_cache_memory=20.0, kv_cache_dtype="fp8",
                  quantization="compressed-tensors", tensor_parallel=4, pipeline_parallel=2, compile=False,
                  async_scheduling=False, api_server_count=4)


@pytest.mark.parametrize("version", sorted(RECORDED))
def test_every_flag_is_one_that_version_accepts(version):
    everything = {**EVERYTHING, "kv_cache_memory": None} if version == "0.10.0" else EVERYTHING  # 0.11 on
    _accepted(plan_vllm_command(ServeRecipe(**everything), version).argv, version)
    ngram = plan_vllm_command(ServeRecipe(model="/m", prompt_lookup=3, speculative_max_batch=8), version)
    _accepted(ngram.argv, version)
    _accepted(plan_vllm_command(ServeRecipe(model="/m", async_scheduling=True), version).argv, version)
    _accepted(plan_vllm_command(ServeRecipe(model="/m", kv_cache_blocks=100), version).argv, version)


def test_the_recorded_sets_tell_the_versions_apart():
    """The builder's per-version choices follow the recorded sources (a wrong table would fail here)."""
    old, new = RECORDED["0.11.0"], RECORDED["0.33.0"]
    assert "disable_by_batch_size" in old["speculative_config_keys"]
    assert "disable_by_batch_size" not in new["speculative_config_keys"]
    assert "num_speculative_tokens_per_batch_size" in new["speculative_config_keys"]
    assert "num_speculative_tokens_per_batch_size" not in old["speculative_config_keys"]
    assert not VllmCaps((0, 11)).spec_batch_schedule and VllmCaps((0, 33)).spec_batch_schedule
    assert "--kv-cache-memory-bytes" not in RECORDED["0.10.0"]["flags"] and "--kv-cache-memory-bytes" in old["flags"]


def test_draft_model_per_version():
    settings = ServeRecipe(model="/m", draft_model="/d", num_speculative_tokens=3)
    for version in ("0.10.2", "0.11", "0.13.0", "0.14.1"):
        with pytest.raises(BadInputError, match="not supported yet"):
            plan_vllm_command(settings, version)
    argv = plan_vllm_command(settings, "0.33.0").argv
    _accepted(argv, "0.33.0")
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}


def test_speculative_max_batch_is_mapped_or_dropped_with_a_warning():
    settings = ServeRecipe(model="/m", prompt_lookup=3, num_speculative_tokens=2, speculative_max_batch=8)
    old = plan_vllm_command(settings, "0.11.0")
    assert "disable_by_batch_size" not in " ".join(old.argv)
    assert any("--speculative-max-batch 8 dropped" in w for w in old.warnings)
    new = plan_vllm_command(settings, "0.33.0")
    spec = json.loads(new.argv[new.argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 8, 2], [9, 9, 0]] and not new.warnings
    # copt's default (4) is copt's engine's policy, not forwarded
    default = plan_vllm_command(ServeRecipe(model="/m", prompt_lookup=3), "0.33.0")
    assert "per_batch_size" not in " ".join(default.argv) and not default.warnings


def test_only_what_the_user_set_is_forwarded():
    argv = plan_vllm_command(ServeRecipe(model="/m"), "0.33.0").argv
    assert argv == ["vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "8000", "--dtype", "auto"]
    via_recipe = load_settings("serve", None, ["max_batch_size=64", "block_size=32"], {"model": "/m"})
    argv = plan_vllm_command(via_recipe, "0.33.0").argv
    assert argv[argv.index("--max-num-seqs") + 1] == "64" and argv[argv.index("--block-size") + 1] == "32"


def test_async_scheduling_is_validated_against_speculation_and_pipeline_parallelism():
    with pytest.raises(BadInputError, match="n-gram"):
        plan_vllm_command(ServeRecipe(model="/m", prompt_lookup=3, async_scheduling=True), "0.33.0")
    with pytest.raises(BadInputError, match="pipeline"):
        plan_vllm_command(ServeRecipe(model="/m", pipeline_parallel=2, async_scheduling=True), "0.11.0")
    with pytest.raises(BadInputError, match="pipeline"):
        plan_vllm_command(ServeRecipe(model="/m", pipeline_parallel=2, async_scheduling=True), "0.33.0")
    assert "--async-scheduling" in plan_vllm_command(
        ServeRecipe(model="/m", pipeline_parallel=2, async_scheduling=True), "0.20.0").argv
    assert "--async-scheduling" in plan_vllm_command(
        ServeRecipe(model="/m", draft_model="/d", async_scheduling=True), "0.33.0").argv
    # unset: vLLM decides (it turns async scheduling off itself where it cannot combine it)
    assert not any("async" in a for a in plan_vllm_command(
        ServeRecipe(model="/m", prompt_lookup=3, pipeline_parallel=2), "0.11.0").argv)


def test_versions():
    assert parse_version("0.11") == (0, 11) and parse_version("0.13.0rc1") == (0, 13)
    assert parse_version("0.14.0+cu129") == (0, 14) and parse_version("v0.33.0") == (0, 33)
    with pytest.raises(ValueError):
        parse_version("eleven")
    with pytest.raises(BadInputError, match="arrives in 0.11"):
        plan_vllm_command(ServeRecipe(model="/m", kv_cache_memory=8.0), "0.10.2")
    with pytest.raises(BadInputError, match="predates"):
        plan_vllm_command(ServeRecipe(model="/m"), "0.9.2")
    assert plan_vllm_command(ServeRecipe(model="/m"), "0.40").warnings


def test_cli_aliases_version_and_engine_name(copt):
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--vllm-version", "0.11",
             "--max-num-seqs", "32", "--max-num-batched-tokens", "2048", "--tensor-parallel-size", "2",
             "--pipeline-parallel-size", "2", "--gpu-memory-utilization", "0.85", "--kv-cache-memory-bytes", "8G",
             "--prompt-lookup", "3", "--speculative-max-batch", "8")
    assert r.returncode == 0, r.stderr
    assert "vLLM 0.11 (--vllm-version)" in r.stderr and "--speculative-max-batch 8 dropped" in r.stderr
    argv = r.stdout.split()
    pairs = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--max-num-seqs"] == "32" and pairs["--max-num-batched-tokens"] == "2048"
    assert pairs["--tensor-parallel-size"] == "2" and pairs["--pipeline-parallel-size"] == "2"
    assert pairs["--gpu-memory-utilization"] == "0.85" and pairs["--kv-cache-memory-bytes"] == str(8 * 2**30)
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--json", "--draft-model", "/d")
    out = json.loads(r.stdout)
    assert out["vllm_version"] and out["vllm_version_source"].startswith(("installed", "assumed"))
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--vllm-version", "0.12", "--draft-model", "/d")
    assert r.returncode == 2 and "not supported yet" in r.stderr
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--vllm-version", "twelve")
    assert r.returncode == 2 and "--vllm-version" in r.stderr
    assert ServeRecipe(model="/m", engine="transformers").engine == "copt"
    r = copt("serve", "/no/such/model", "--engine", "transformers")
    assert r.returncode == 2 and "not a local model directory" in r.stderr


def test_api_server_count_is_forwarded_only_when_set():
    argv = plan_vllm_command(ServeRecipe(model="/m", engine="vllm", api_server_count=4), "0.11").argv
    assert argv[argv.index("--api-server-count") + 1] == "4"
    assert "--api-server-count" not in plan_vllm_command(ServeRecipe(model="/m", engine="vllm"), "0.11").argv


def test_copt_server_limits_are_refused_with_the_vllm_engine():
    """--write-timeout, --read-timeout, --max-connections, body and prompt limits, public metrics: copt's own HTTP
    server's settings, silently dropped when vLLM's server ran; refused by name (defaults stay accepted)."""
    from clusteropt_cli.errors import RecipeError
    from clusteropt_cli.recipe.schema.serve import COPT_SERVER_KEYS

    load_settings("serve", None, None, {"model": "m", "engine": "vllm"})
    values = {"write_timeout": 5.0, "read_timeout": 5.0, "max_connections": 9, "max_request_bytes": 2**20,
              "max_prompt_chars": 1000, "metrics_public": True}
    assert set(values) == set(COPT_SERVER_KEYS)
    with pytest.raises(RecipeError) as info:
        load_settings("serve", None, None, {"model": "m", "engine": "vllm", **values})
    assert len(info.value.problems) == len(values)
    assert all("copt's own HTTP server" in problem for problem in info.value.problems)
    load_settings("serve", None, None, {"model": "m", **values})  # the copt engine takes them
