"""Every command copt advise prints (recommendations, the top plan; human output and JSON `command` fields) is
complete, names the user's model and runs as printed: each `copt` step is executed with --dry-run (train, serve,
quantize), run as is (advise), or parsed by the subcommand's own option parser (distill, which has no dry run).
Placeholders advise cannot know (the training text, calibration text, ...) are replaced by fixture files."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest
import typer

from clusteropt_cli.app import app, main
from clusteropt_cli.core.advise import recipes
from clusteropt_cli.core.profile.report import SYMPTOMS


@pytest.fixture
def cli(capsys):
    def run(*args: str) -> subprocess.CompletedProcess:
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, int(exit_info.value.code or 0), captured.out, captured.err)

    return run


def _advise_json(cli, *args: str) -> dict:
    proc = cli("advise", *args, "--json")
    assert proc.returncode == 0, (args, proc.stderr)
    return json.loads(proc.stdout)


def _commands(result: dict) -> list[str]:
    out = [rec["command"] for rec in result["recommendations"]]
    if result["top_plan"].get("command"):
        out.append(result["top_plan"]["command"])
    return out


def _steps(command: str, substitutions: dict[str, str]) -> list[list[str]]:
    """The `copt ...` steps of a printed command (`&&`-chained; a trailing `# note` and an env prefix dropped)."""
    command = command.split("  # ")[0]
    steps = []
    for part in command.split("&&"):
        words = shlex.split(part)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]  # VAR=value prefix
        assert words[:1] == ["copt"], f"not a copt command: {part!r} in {command!r}"
        steps.append([substitutions.get(w, w) for w in words[1:]])
    return steps


def _run_step(cli, argv: list[str], command: str) -> None:
    sub = argv[0]
    if sub == "distill":  # no dry run: the subcommand's own parser checks every flag and value
        group = typer.main.get_command(app)
        ctx = group.make_context("copt", list(argv), resilient_parsing=False)
        distill = group.get_command(ctx, "distill")
        dctx = distill.make_context("distill", list(argv[1:]), parent=ctx)
        leaf = distill.get_command(dctx, argv[1])
        leaf.make_context(argv[1], list(argv[2:]), parent=dctx)
        return
    if sub in ("train", "serve", "quantize"):
        argv = [*argv, "--dry-run"]
    proc = cli(*argv)
    assert proc.returncode == 0, f"{command}\n→ copt {' '.join(argv)}\n{proc.stderr}"


@pytest.fixture(scope="module")
def substitutions(fixtures, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("advise-commands")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    (tmp / "nvme").mkdir()
    hostfile = tmp / "hosts"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    return {recipes.HOSTFILE_PLACEHOLDER: str(hostfile),
            recipes.DATA_PLACEHOLDER: str(fixtures.train_text), recipes.TOKENIZER_PLACEHOLDER: str(fixtures.tokenizer),
            recipes.PROMPTS_PLACEHOLDER: str(prompts), recipes.STUDENT_PLACEHOLDER: str(fixtures.student),
            recipes.CALIB_PLACEHOLDER: str(fixtures.train_text), recipes.NVME_PLACEHOLDER: str(tmp / "nvme")}


def test_every_printed_command_runs(cli, fixtures, substitutions, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # quantize/train outputs named relative to here (dry runs write nothing)
    model = str(fixtures.teacher)
    seen: set[str] = set()
    cases = [("train", ["--gpu", "h200", "--micro-batch", "4", "--seq-len", "128"]),
             ("train", ["--gpu", "h200", "--gpus", "8", "--micro-batch", "4", "--seq-len", "128",
                        "--memory-budget", "0.05"]),
             ("train", ["--gpu", "cpu", "--memory-budget", "0.02", "--micro-batch", "4", "--seq-len", "128"]),
             ("infer", ["--gpu", "h200", "--batch", "4", "--prompt-len", "64", "--gen-len", "32"]),
             ("infer", ["--gpu", "h200", "--gpus", "2", "--batch", "64", "--prompt-len", "64", "--gen-len", "32"]),
             # the user's own options that a recommendation's layout rules out (offload runs DeepSpeed's CPU AdamW,
             # ZeRO-3 has no fused loss) are reset in its command; int8 weights are quantized with calibration
             ("train", ["--gpu", "h200", "--micro-batch", "4", "--seq-len", "128", "--optimizer", "sgd"]),
             ("train", ["--gpu", "h200", "--gpus", "8", "--micro-batch", "4", "--seq-len", "128",
                        "--memory-budget", "0.05", "--optimizer", "adamw-8bit", "loss_impl=fused"]),
             ("infer", ["--gpu", "h200", "--batch", "4", "--prompt-len", "64", "--gen-len", "32", "--weights", "int8"]),
             # two nodes: the hosts come from a hostfile advise cannot know (HOSTFILE)
             ("train", ["--gpu", "h200", "--gpus", "8", "--nodes", "2", "--micro-batch", "4", "--seq-len", "128"])]
    for task, args in cases:
        for symptom in (None, *SYMPTOMS):
            extra = ["--symptom", symptom] if symptom else []
            result = _advise_json(cli, "--model", model, "--task", task, "--data", str(fixtures.train_text),
                                  *args, *extra)
            for command in _commands(result):
                assert model in command, f"the command does not name the user's model: {command}"
                seen.add(command)
    assert len(seen) >= 15
    for command in sorted(seen):
        steps = _steps(command, substitutions)
        for i, argv in enumerate(steps):
            if i and steps[0][0] == "quantize" and argv[0] == "serve":
                # the dry run of `copt quantize` writes no checkpoint: serve's dry run checks the original in its
                # place (the output path itself was checked by quantize's dry run)
                assert argv[1] == steps[0][steps[0].index("--output") + 1]
                argv = [argv[0], model, *argv[2:]]
            _run_step(cli, argv, command)


def test_human_output_prints_the_json_commands(cli, fixtures) -> None:
    args = ("--model", str(fixtures.teacher), "--task", "infer", "--gpu", "h200", "--symptom", "slow-tpot")
    result = _advise_json(cli, *args)
    proc = cli("advise", *args)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for rec in result["recommendations"][:10]:
        assert " ".join(rec["command"].split()) in text


def test_placeholders_are_named_when_advise_is_not_told(cli) -> None:
    """Without --data a train command names the placeholder, never a made-up path."""
    result = _advise_json(cli, "--model", "llama-3.2-1b", "--gpu", "h200", "--symptom", "oom")
    commands = [c for c in _commands(result) if c.startswith("copt train")]
    assert commands and all(f"--data {recipes.DATA_PLACEHOLDER}" in c for c in commands)
    assert all(f"--tokenizer {recipes.TOKENIZER_PLACEHOLDER}" in c for c in commands)  # a preset has none


def test_train_and_serve_spellings_with_hidden_old_aliases(cli) -> None:
    base = ("--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "4096")
    new = _advise_json(cli, *base, "--tensor-parallel", "8", "--attn", "flash_attention_2")
    old = _advise_json(cli, *base, "--tp", "8", "--attn", "flash")
    assert new["workload"] == old["workload"] and new["workload"]["tp"] == 8
    pipe_new = _advise_json(cli, *base, "--pipeline-stages", "4", "--pipeline-micro-batches", "8")
    pipe_old = _advise_json(cli, *base, "--pp", "4", "--pp-micro-batches", "8")
    assert pipe_new["workload"] == pipe_old["workload"] and pipe_new["workload"]["pp"] == 4
    kv_new = _advise_json(cli, "--model", "llama-3.2-1b", "--gpu", "h200", "--task", "infer",
                          "--kv-cache-dtype", "fp8")
    kv_old = _advise_json(cli, "--model", "llama-3.2-1b", "--gpu", "h200", "--task", "infer", "--kv-cache", "fp8")
    assert kv_new["workload"]["kv_cache"] == kv_old["workload"]["kv_cache"] == "fp8"
    command = typer.main.get_command(app).commands["advise"]
    shown = {o for p in command.params if not getattr(p, "hidden", False) for o in p.opts}
    hidden = {o for p in command.params if getattr(p, "hidden", False) for o in p.opts}
    assert {"--tensor-parallel", "--pipeline-stages", "--pipeline-micro-batches", "--kv-cache-dtype"} <= shown
    assert {"--tp", "--pp", "--pp-micro-batches", "--pp-virtual-stages", "--kv-cache"} <= hidden
    bad = cli("advise", "--model", "llama-3.2-1b", "--gpu", "h200", "--attn", "flash3")
    assert bad.returncode == 2 and "flash_attention_2" in bad.stderr  # the schema's values
    clash = cli("advise", *base, "--tp", "8", "--tensor-parallel", "4")
    assert clash.returncode == 2 and "--tensor-parallel" in clash.stderr


@pytest.mark.parametrize("name", ["guidellm_report.json", "vllm_bench_serve.json"])
def test_from_profile_third_party_reports(cli, name) -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / name
    result = _advise_json(cli, "--from-profile", str(path), "--model", "llama-3.2-1b", "--gpu", "h200")
    assert result["task"] == "infer"
    assert {row["metric"] for row in result["measured"]} >= {"ttft_s", "tpot_s", "output_tokens_per_s"}


def test_plans_beyond_one_gpu_print_vllm_commands_that_run(cli, fixtures, substitutions, tmp_path, monkeypatch) -> None:
    """A budget just below what the fixture needs on copt's engine: what vLLM runs as well is printed with
    --tensor-parallel N --engine vllm (and runs), the rest is not applicable; a copt-engine command is printed only
    for a plan predicted to fit one GPU (FP8 weights, an fp8 KV cache)."""
    from clusteropt_cli.core.advise.api import evaluate_infer, resolve_target
    from clusteropt_cli.core.advise.plan import InferPlan
    from clusteropt_cli.modelspec import load_model_spec

    monkeypatch.chdir(tmp_path)
    model = str(fixtures.teacher)
    target, _ = resolve_target("h200", gpus=4)
    plan = InferPlan(batch=4, prompt_len=64, gen_len=32, continuous_batching=True)
    required = evaluate_infer(load_model_spec(model), plan, target)["memory"]["required_bytes"]
    budget = f"{(required - 2048) / 1024**3:.12f}"
    result = _advise_json(cli, "--model", model, "--task", "infer", "--gpu", "h200", "--gpus", "4",
                          "--memory-budget", budget, "--batch", "4", "--prompt-len", "64", "--gen-len", "32",
                          "--symptom", "slow-tpot")
    assert result["memory"]["fits"] is False
    commands = _commands(result)
    for rec in result["recommendations"]:
        assert "--engine copt" not in rec["command"] or rec["predicted"]["fits"] is True, rec
    assert any("--tensor-parallel 2 --engine vllm --prompt-lookup 3" in c for c in commands), commands
    assert "operator-fusion" not in {n["id"] for n in result["not_applicable"]}  # copt serve's default already
    for command in commands:
        for i, argv in enumerate(_steps(command, substitutions)):
            if i and argv[0] == "serve":
                argv = [argv[0], model, *argv[2:]]  # quantize's dry run wrote no checkpoint
            _run_step(cli, argv, command)


def test_no_plan_advise_cannot_print_and_no_negative_capacity(cli) -> None:
    """An int8 KV cache is served by neither engine copt runs: refused up front. Weights beyond the GPU leave a KV
    cache of nothing, not of a negative size."""
    refused = cli("advise", "--model", "llama-3.2-1b", "--task", "infer", "--gpu", "h100-sxm", "--kv-cache-dtype",
                  "int8")
    assert refused.returncode == 2 and "fp8" in refused.stderr
    result = _advise_json(cli, "--model", "gpt3-175b", "--task", "infer", "--gpu", "h100-sxm", "--gpus", "8",
                          "--batch", "1")
    assert result["time"]["max_concurrent_seqs"] == 0
    assert result["kv_cache"]["capacity_tokens"] == 0 and "exceed" in result["kv_cache"]["budget"]
