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
from clusteropt_cli.core.profile.report import SYMPTOM_TASK, SYMPTOMS


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
             ("train", ["--gpu", "h200", "--gpus", "8", "--nodes", "2", "--micro-batch", "4", "--seq-len", "128"]),
             # a pipeline copt train runs (one stage per GPU): what is stacked on it runs too (ZeRO replaces the
             # stages; no fp8 or gradient compression on the pipeline)
             ("train", ["--gpu", "h200", "--gpus", "2", "--pipeline-stages", "2", "--micro-batch", "4",
                        "--grad-accum", "2", "--seq-len", "128"]),
             # a layout copt train does not run (stages × data parallelism): re-planned by advise, never printed
             # as a copt train command that fails
             ("train", ["--gpu", "h200", "--gpus", "8", "--pipeline-stages", "2", "--micro-batch", "4",
                        "--seq-len", "128"]),
             # the user's tensor parallelism: the pipeline recommendation takes the GPUs it leaves
             ("train", ["--gpu", "h200", "--gpus", "2", "--tensor-parallel", "2", "--micro-batch", "4",
                        "--seq-len", "128"])]
    for task, args in cases:
        for symptom in (None, *(s for s in SYMPTOMS if SYMPTOM_TASK.get(s, task) == task)):
            extra = ["--symptom", symptom] if symptom else []
            result = _advise_json(cli, "--model", model, "--task", task, "--data", str(fixtures.train_text),
                                  *args, *extra)
            for command in _commands(result):
                assert model in command, f"the command does not name the user's model: {command}"
                seen.add(command)
    assert len(seen) >= 15
    _run_all(cli, seen, substitutions, model)


def test_commands_for_a_preset_or_a_config_json_run(cli, fixtures, substitutions, tmp_path, monkeypatch) -> None:
    """copt serve, quantize and distill take a model directory: for a preset (or a config.json without weights
    beside it) advise prints MODEL_DIR, for a config.json inside a model directory that directory."""
    monkeypatch.chdir(tmp_path)
    seen: set[str] = set()
    bare = tmp_path / "shape" / "config.json"
    bare.parent.mkdir()
    bare.write_text((fixtures.teacher / "config.json").read_text())
    for model, named in (("llama-3.2-1b", recipes.MODEL_DIR_PLACEHOLDER), (str(bare), recipes.MODEL_DIR_PLACEHOLDER),
                         (str(fixtures.teacher / "config.json"), str(fixtures.teacher))):
        for symptom in ("slow-tpot", "low-throughput", "high-ttft", "oom"):
            result = _advise_json(cli, "--model", model, "--task", "infer", "--gpu", "h200", "--batch", "4",
                                  "--prompt-len", "64", "--gen-len", "32", "--symptom", symptom)
            for command in _commands(result):
                served = [w for step in _steps(command, {}) if step[0] in ("serve", "quantize") for w in step[1:2]]
                assert all(w == named or w.endswith(("-awq", "-gptq", "-fp8", "-int8")) for w in served), command
                if "copt serve" in command or "copt quantize" in command:
                    assert named in command, command
                seen.add(command)
    substitutions = {**substitutions, recipes.MODEL_DIR_PLACEHOLDER: str(fixtures.teacher)}
    _run_all(cli, seen, substitutions, str(fixtures.teacher))


def _run_all(cli, commands: set[str], substitutions: dict[str, str], model: str) -> None:
    seen = commands
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


def test_layouts_copt_train_does_not_run_are_never_printed_as_train_commands(cli) -> None:
    """A user's pipeline over 8 GPUs with 2 stages (data parallelism across stages) or in fp16 is a layout copt
    train refuses: its figures stand, its commands re-plan it with advise (naming why), no recipe is written. On a
    pipeline copt train runs, ZeRO replaces the stages and nothing train refuses (fp8, DDP compression) is stacked."""
    base = ("--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--micro-batch", "2", "--seq-len", "4096")
    megatron = _advise_json(cli, *base, "--gpus", "8", "--pipeline-stages", "2", "--symptom", "oom")
    assert megatron["top_plan"]["command"] is None
    assert any("copt train cannot run this layout (pipeline_stages: 2 stages need gpus × nodes = 2" in n
               for n in megatron["notes"])
    for rec in megatron["recommendations"]:
        assert rec["command"].startswith("copt advise ") and "copt train cannot run this layout" in rec["command"], rec
    runs = _advise_json(cli, *base, "--gpus", "2", "--pipeline-stages", "2", "--grad-accum", "4",
                        "--symptom", "oom", "--symptom", "low-mfu")
    assert runs["top_plan"]["command"].startswith("copt train ")
    ids = {rec["id"]: rec for rec in runs["recommendations"]}
    assert "fp8" not in ids and "gradient-compression" not in ids
    for rid in ("zero-1", "zero-2", "cpu-offload"):
        if rid in ids:
            assert "--pipeline-stages" not in ids[rid]["command"] and "--zero" in ids[rid]["command"], ids[rid]
    for rec in runs["recommendations"]:
        assert rec["command"].startswith(("copt train ", "PYTORCH_CUDA_ALLOC_CONF")) or rec["id"] == "tensor-parallel"


def test_what_no_trainer_or_server_runs_is_refused(cli) -> None:
    """Beyond the model's positions (copt train and copt serve refuse it; advise allowed 4× before), gradient
    compression on one GPU, several GPUs on `--gpu cpu`: exit 2 naming the flag."""
    cases = [(["--model", "llama-3.2-1b", "--gpu", "h200", "--seq-len", "262144"], "max_position_embeddings"),
             (["--model", "llama-3.2-1b", "--gpu", "h200", "gradient_compression=powersgd"], "gradient_compression"),
             (["--model", "llama-3.2-1b", "--gpu", "h200", "--task", "infer", "--prompt-len", "131072",
               "--gen-len", "64"], "max_position_embeddings"),
             # a CPU plan is one process: --gpus was dropped silently and the error named "the 1 GPUs"
             (["--model", "llama-3.2-1b", "--gpu", "cpu", "--gpus", "2", "--pipeline-stages", "2"], "--gpu cpu")]
    for args, named in cases:
        proc = cli("advise", *args)
        assert proc.returncode == 2 and named in proc.stderr, (args, proc.stderr)


def test_symptoms_pick_or_check_the_task(cli) -> None:
    """A serving symptom without --task advises serving; with --task train it is refused (it ranked tensor
    parallelism first, whose recipe copt train refused); mixed serving and training symptoms are refused."""
    served = _advise_json(cli, "--model", "llama-3.2-1b", "--gpu", "h200", "--symptom", "slow-tpot")
    assert served["task"] == "infer" and served["recommendations"]
    assert _advise_json(cli, "--model", "llama-3.2-1b", "--gpu", "h200", "--symptom", "oom")["task"] == "train"
    wrong = cli("advise", "--model", "llama-3.2-1b", "--gpu", "h200", "--task", "train", "--symptom", "slow-tpot")
    assert wrong.returncode == 2 and "--task infer" in wrong.stderr
    mixed = cli("advise", "--model", "llama-3.2-1b", "--gpu", "h200", "--symptom", "slow-tpot", "--symptom", "low-mfu")
    assert mixed.returncode == 2 and "mixes" in mixed.stderr


def test_an_emitted_train_recipe_runs_as_its_header_says(cli, fixtures, tmp_path, monkeypatch) -> None:
    """`copt advise --emit-recipe plan.yaml` for a preset: the recipe names its output and the placeholders for
    what advise cannot know (listed in the header); `copt train --recipe plan.yaml --data D --tokenizer T` runs."""
    import yaml

    monkeypatch.chdir(tmp_path)
    proc = cli("advise", "--model", "llama-3.2-1b", "--gpu", "h200", "--micro-batch", "2", "--seq-len", "128",
               "--emit-recipe", "plan.yaml")
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "plan.yaml").read_text()
    header = text.splitlines()[:3]
    assert header[0] == "# copt train --recipe plan.yaml"
    assert "DATA.txt (--data)" in header[2] and "TOKENIZER_DIR (--tokenizer)" in header[2]
    data = yaml.safe_load(text)
    assert data["output"] == "runs/plan" and data["data"] == recipes.DATA_PLACEHOLDER
    run = cli("train", "--recipe", "plan.yaml", "--data", str(fixtures.train_text), "--tokenizer",
              str(fixtures.tokenizer), "--dry-run")
    assert run.returncode == 0, run.stderr
    serve = cli("advise", "--model", "llama-3.2-1b", "--gpu", "h200", "--task", "infer", "--emit-recipe", "s.yaml")
    assert serve.returncode == 0, serve.stderr
    served = yaml.safe_load((tmp_path / "s.yaml").read_text())
    assert served["model"] == recipes.MODEL_DIR_PLACEHOLDER and served["served_model_name"] == "llama-3.2-1b"
    run = cli("serve", "--recipe", "s.yaml", str(fixtures.teacher), "--dry-run")
    assert run.returncode == 0, run.stderr
    pipeline = cli("advise", "--model", "llama-3.1-8b", "--gpu", "h200", "--gpus", "8", "--pipeline-stages", "2",
                   "--emit-recipe", "pp.yaml")
    assert pipeline.returncode == 2 and "pipeline_stages" in pipeline.stderr and not (tmp_path / "pp.yaml").exists()


def test_a_pipeline_over_every_gpu_is_priced_as_copt_train_splits_it(cli, tmp_path, monkeypatch) -> None:
    """`--gpus 4 --pipeline-stages 4 --micro-batch 4` is what copt train runs with its default micro-batches (one
    per sequence): advise prices that split and prints copt train, where it had pinned one micro-batch per step
    (fewer than the stages, so copt train refused its recipe)."""
    monkeypatch.chdir(tmp_path)
    args = ("--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--gpus", "4", "--pipeline-stages", "4",
            "--micro-batch", "4", "--seq-len", "1024")
    result = _advise_json(cli, *args)
    assert result["top_plan"]["command"].startswith("copt train ")
    assert "--pipeline-micro-batches" not in result["top_plan"]["command"]
    assert any("stage 0 holds 4 micro-batches" in n for n in result["notes"])
    assert cli("advise", *args, "--emit-recipe", "pp.yaml").returncode == 0


def test_the_top_plan_is_one_copt_train_runs(cli, tmp_path, monkeypatch) -> None:
    """comm-bound on ZeRO-3 with offload ranked tensor parallelism first: the top plan (and its recipe) is the
    best one copt train runs; tensor parallelism stays a ranked recommendation with its advise command."""
    monkeypatch.chdir(tmp_path)
    args = ("--model", "llama-3.1-8b", "--task", "train", "--gpu", "h100-sxm", "--gpus", "2", "--symptom",
            "comm-bound", "--zero", "3", "--offload", "cpu")
    result = _advise_json(cli, *args)
    assert "tensor-parallel" not in result["top_plan"]["applies"]
    assert result["top_plan"]["command"] is None or result["top_plan"]["command"].startswith("copt train ")
    proc = cli("advise", *args, "--emit-recipe", "plan.yaml")
    assert proc.returncode == 0, proc.stderr


def test_an_emitted_quantized_serve_recipe_names_its_quantize_step(cli, fixtures, substitutions, tmp_path,
                                                                   monkeypatch) -> None:
    """A serve recipe for int8/fp8 weights serves a checkpoint copt quantize writes: the header chains that step
    (its placeholders listed), and the step and the recipe run as the header says."""
    monkeypatch.chdir(tmp_path)
    for model, weights in ((str(fixtures.teacher), "int8"), ("llama-3.2-1b", "fp8")):
        name = f"{weights}.yaml"
        proc = cli("advise", "--model", model, "--task", "infer", "--gpu", "h100-sxm", "--weights", weights,
                   "--emit-recipe", name)
        assert proc.returncode == 0, proc.stderr
        lines = (tmp_path / name).read_text().splitlines()
        assert lines[0].startswith("# copt quantize ") and lines[0].endswith(f"&& copt serve --recipe {name}")
        steps = _steps(lines[0][2:], {**substitutions, recipes.MODEL_DIR_PLACEHOLDER: str(fixtures.teacher)})
        if model == "llama-3.2-1b":
            assert recipes.MODEL_DIR_PLACEHOLDER in lines[2]
        _run_step(cli, steps[0], lines[0])
        output = steps[0][steps[0].index("--output") + 1]
        # quantize's dry run writes nothing: the recipe's serve dry run takes the original in its place
        assert f"model: {output}" in lines
        _run_step(cli, [*steps[1], str(fixtures.teacher)], lines[0])
