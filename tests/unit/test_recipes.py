"""Recipes: every shipped YAML validates through the real parser; errors are all reported at once."""

from __future__ import annotations

import json

import pytest

from clusteropt_cli.errors import RecipeError
from clusteropt_cli.recipe.load import apply_overrides, load_settings, parse_override
from clusteropt_cli.recipe.registry import list_recipes, recipe_dirs
from clusteropt_cli.recipe.schema import RECIPE_MODELS

SHIPPED = list_recipes()


def test_recipes_are_shipped():
    assert len(SHIPPED) >= 8
    assert {r.task for r in SHIPPED} >= {"train", "serve", "quantize", "distill"}


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda r: r.name)
def test_shipped_recipe_validates_and_opens_with_its_command(recipe):
    settings = load_settings(recipe.task, str(recipe.path))
    assert isinstance(settings, RECIPE_MODELS[recipe.task])
    first = recipe.path.read_text().splitlines()[0]
    assert first.startswith("# copt ") and recipe.name in first, "line 1 must show the command that runs it"
    assert recipe.description


def test_decision_matrix_rows_have_recipes():
    names = {r.name for r in SHIPPED}
    assert {"train-oom-checkpointing", "serve-high-ttft", "serve-low-throughput", "serve-slow-tpot"} <= names


def test_all_errors_reported_at_once(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task: train\nmodel: x\nmicro_batch: 0\nprecison: bf16\nzero: 7\n")
    with pytest.raises(RecipeError) as info:
        load_settings("train", str(path))
    problems = info.value.problems
    keys = {p.split(":")[0] for p in problems}
    assert {"micro_batch", "precison", "zero"} <= keys, problems
    assert any("unknown key" in p for p in problems)


def test_cross_field_rules_name_their_key():
    with pytest.raises(RecipeError) as info:
        load_settings("train", None, ["zero=3", "pipeline_stages=2"], {"model": "m"})
    assert any(p.startswith("zero:") for p in info.value.problems)


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "sgd"])
def test_offload_refuses_an_optimizer_deepspeed_would_replace(optimizer):
    """Under offload DeepSpeed's CPU AdamW updates the weights on the host: another optimizer would be ignored."""
    with pytest.raises(RecipeError) as info:
        load_settings("train", None, [f"optimizer={optimizer}"], {"model": "m", "zero": 3, "offload": "cpu"})
    assert any(p.startswith("optimizer:") and "CPU AdamW" in p for p in info.value.problems), info.value.problems
    assert load_settings("train", None, [f"optimizer={optimizer}"], {"model": "m", "zero": 3}).optimizer == optimizer


def test_overrides_parse_yaml_scalars_and_nest():
    assert parse_override("lr=3e-4") == (["lr"], 3e-4)
    assert parse_override("ignore=[lm_head, embed]") == (["ignore"], ["lm_head", "embed"])
    merged = apply_overrides({"a": {"b": 1}}, ["a.c=true", "d=x"])
    assert merged == {"a": {"b": 1, "c": True}, "d": "x"}
    with pytest.raises(RecipeError):
        parse_override("novalue")


def test_cli_values_override_recipe_and_none_is_not_given(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("task: quantize\nmodel: m\nmethod: gptq\nbits: 3\n")
    settings = load_settings("quantize", str(path), ["group_size=64"], {"method": "awq", "bits": None})
    assert (settings.method, settings.bits, settings.group_size) == ("awq", 3, 64)


def test_wrong_task_recipe_is_refused():
    with pytest.raises(RecipeError, match="is a 'serve' recipe"):
        load_settings("train", "serve-high-ttft")


def test_cli_validate_unknown_key_exits_2_with_one_message(copt, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task: serve\nmodel: m\nmax_batch_sise: 3\n")
    result = copt("recipes", "validate", str(path))
    assert result.returncode == 2
    assert "max_batch_sise: unknown key" in result.stderr and "Traceback" not in result.stderr


def test_cli_validate_bad_yaml_names_line(copt, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task: serve\nmodel: [unclosed\n")
    result = copt("recipes", "validate", str(path))
    assert result.returncode == 2 and "line" in result.stderr


def test_cli_list_show_cp(copt, tmp_path):
    listed = json.loads(copt("recipes", "list", "--json").stdout)
    assert listed["schema_version"] == "copt.recipes/1"
    assert {r["name"] for r in listed["recipes"]} == {r.name for r in SHIPPED}
    shown = copt("recipes", "show", "serve-high-ttft")
    assert shown.returncode == 0 and shown.stdout.startswith("# copt serve")
    dest = tmp_path / "mine.yaml"
    assert copt("recipes", "cp", "serve-high-ttft", str(dest)).returncode == 0
    assert dest.read_text() == shown.stdout
    again = copt("recipes", "cp", "serve-high-ttft", str(dest))
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert copt("recipes", "cp", "serve-high-ttft", str(dest), "--overwrite").returncode == 0
    missing = copt("recipes", "show", "no-such-recipe")
    assert missing.returncode == 2 and "copt recipes list" in missing.stderr
    # cp copies built-in recipes only: a path (any readable file, or a name walking out of recipes/) is refused
    secret = tmp_path / "secret.yaml"
    secret.write_text("token: abc\n")
    for name in (str(secret), "../recipes/serve-high-ttft", "./serve-high-ttft.yaml"):
        refused = copt("recipes", "cp", name, str(tmp_path / "copy.yaml"))
        assert refused.returncode == 2 and "not a built-in recipe" in refused.stderr, name
        assert not (tmp_path / "copy.yaml").exists()
    assert copt("recipes", "cp", "serve-high-ttft.yaml", str(tmp_path / "named.yaml")).returncode == 0


def test_recipes_are_packaged_in_the_wheel_config():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    assert config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]["recipes"] == "clusteropt_cli/_recipes"
    assert any(d.name == "recipes" for d in recipe_dirs())


def _copt_in_process(capsys, *args: str) -> tuple[int, str]:
    from clusteropt_cli.app import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(list(args))
    return int(info.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize(("args", "shown", "hidden"), [
    (["distill", "traces", "--teacher", "t", "--temperature", "-1", "-o", "x.jsonl"], "--temperature: ",
     "sample_temperature"),
    (["train", "--data", "d.txt"], "--model is required", "Field required"),
    (["quantize", "--method", "rtn"], "MODEL is required", "Field required"),
    (["distill", "logits", "--student", "s"], "--teacher: required for distill logits", "teacher: distill"),
    (["distill", "onpolicy", "--teacher", "t", "--student", "s", "--beta", "2"], "--beta: ", "- beta:"),
    (["train", "--model", "m", "--micro-batch", "0"], "--micro-batch: ", "micro_batch"),
    (["serve", "m", "--kv-cache-blocks", "8", "--kv-cache-memory", "1"],
     "--kv-cache-blocks: give --kv-cache-blocks or --kv-cache-memory, not both", "kv_cache_memory"),
    (["advise", "--model", "llama-3.2-1b", "--gpu", "h100-sxm", "--task", "train", "--seq-len", "1"], "--seq-len: ",
     "seq_len"),
])
def test_command_line_problems_name_the_flags_typed(capsys, args, shown, hidden):
    """Values typed as flags are validated through the recipe schema; its problems name the flag the user typed
    (--temperature, MODEL), not the recipe key (sample_temperature, model)."""
    code, err = _copt_in_process(capsys, *args)
    assert code == 2 and shown in err and hidden not in err, err
    assert "Fix the flags named above" in err


def test_recipe_problems_keep_the_keys_and_flags_next_to_them_name_the_flags(capsys, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("task: train\nmodel: m\nmicro_batch: 0\n")
    code, err = _copt_in_process(capsys, "train", "--recipe", str(path), "--lr", "0", "seq_len=1")
    assert code == 2 and "  - micro_batch: " in err and "  - --lr: " in err and "  - seq_len: " in err, err
    assert "Fix the flags and keys named above" in err
    code, err = _copt_in_process(capsys, "recipes", "validate", str(path))
    assert code == 2 and "  - micro_batch: " in err and "--" not in err.split("hint:")[0], err
    path.write_text("task: train\nmicro_batch: 2\n")  # a recipe may leave the model to the command line
    code, err = _copt_in_process(capsys, "train", "--recipe", str(path))
    assert code == 2 and "  - --model is required" in err, err


@pytest.mark.parametrize(("data", "problem"), [
    ({"offload": "cpu"}, "offload: CPU/NVMe offload needs DeepSpeed ZeRO (set zero to 1, 2 or 3)"),
    ({"scheme": "W4A16", "bits": 8}, "scheme: W4A16 sets bits=4, group_size=128, symmetric=True; it disagrees with "
                                     "bits=8"),
    ({"method": "gptq", "backend": "autoawq"}, "backend: autoawq does not run method gptq (it runs awq; "
                                               "llmcompressor runs all)"),
    ({"method": "fp8", "scheme": "W4A16"}, "scheme: W4A16 is weight-only; method fp8 writes W8A8 (use method awq, "
                                           "gptq or rtn, or scheme W8A8/FP8_DYNAMIC)"),
])
def test_one_problem_is_reported_once(data, problem):
    """A problem whose message has a ';' in it was split in two ('- set zero to 1, 2 or 3' as a second problem)."""
    task = "train" if "offload" in data else "quantize"
    with pytest.raises(RecipeError) as info:
        load_settings(task, None, [f"{k}={v}" for k, v in data.items()], {"model": "m"})
    assert info.value.problems == [problem]


def _recorded_load_settings(monkeypatch) -> list[tuple[str, dict, dict | None]]:
    import clusteropt_cli.recipe.load as load

    calls: list[tuple[str, dict, dict | None]] = []

    class Recorded(Exception):
        pass

    def record(task, recipe=None, overrides=None, cli_values=None, flags=None):
        calls.append((task, dict(cli_values or {}), flags))
        raise Recorded

    monkeypatch.setattr(load, "load_settings", record)
    return calls


@pytest.mark.parametrize("args", [
    ["train"], ["quantize", "m"], ["serve", "m"], ["distill", "logits"], ["distill", "traces"], ["distill", "sft"],
    ["distill", "onpolicy"], ["advise", "--model", "llama-3.2-1b", "--gpu", "h100-sxm", "--task", "train"],
    ["advise", "--model", "llama-3.2-1b", "--gpu", "h100-sxm", "--task", "infer"],
])
def test_every_value_a_command_validates_names_a_flag_of_that_command(monkeypatch, args):
    """The key → flag mapping each command passes (recipe.load.flag_names) names options the command has."""
    import typer

    from clusteropt_cli.app import build_app
    from clusteropt_cli.recipe.load import flag_names

    calls = _recorded_load_settings(monkeypatch)
    command = typer.main.get_command(build_app(args[0]))
    with pytest.raises(Exception):  # noqa: B017, PT011 - the recorder stops the command at load_settings
        command.main(args=args, prog_name="copt", standalone_mode=False)
    assert len(calls) == 1, calls
    for word in [a for a in args[:2] if not a.startswith("-") and a not in ("m",)]:
        command = getattr(command, "commands", {}).get(word, command)
    spelled = {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
    spelled |= {p.name.upper() for p in command.params if p.param_type_name == "argument"}
    task, cli_values, flags = calls[0]
    names = flag_names(cli_values, flags)
    assert {flag for flag in names.values() if flag not in spelled} == set(), (task, names)
    assert RECIPE_MODELS[task].model_fields.keys() >= cli_values.keys()
