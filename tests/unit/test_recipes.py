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
