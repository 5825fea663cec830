"""copt quantize refuses bad inputs up front: a clear message, a non-zero exit, nothing written."""

from __future__ import annotations

import json
import struct

import pytest

from clusteropt_cli.app import main
from clusteropt_cli.core.quantize.calib import read_calibration_texts, read_eval_text
from clusteropt_cli.errors import BadInputError


def _copt(capsys, *args: str) -> tuple[int, str, str]:
    """Run the app in process (no subprocess start-up); returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture
def model_dir(tmp_path):
    """A directory that passes the model checks (config.json + a weights file); never loaded by these tests."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128,
                                                 "intermediate_size": 384, "num_attention_heads": 4}))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")  # an empty but readable safetensors
    return path


@pytest.fixture
def calib(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("def f(x):\n    return x + 1\n")
    return path


def _cases(tmp_path, model_dir, calib):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"prompt": "x"}\n')
    m = str(model_dir)
    return {
        "missing model dir": ([str(tmp_path / "nope"), "--method", "rtn"], 2, "no such directory"),
        "empty calib": ([m, "--method", "gptq", "--calib", str(empty)], 2, "holds no text samples"),
        "malformed calib": ([m, "--method", "awq", "--calib", str(broken)], 2, "line 2 is not valid JSON"),
        "calib without text": ([m, "--method", "awq", "--calib", str(no_text)], 2, "no string 'text' field"),
        "missing calib file": ([m, "--method", "awq", "--calib", str(tmp_path / "x.txt")], 2, "no such file"),
        "no calib for awq": ([m, "--method", "awq"], 2, "--calib is required for awq"),
        "fp8 at 3 bits": ([m, "--method", "fp8", "--bits", "3"], 2, "bits must be 8"),
        "unknown method": ([m, "--method", "nf4"], 2, "method"),
        "group does not divide": ([m, "--method", "rtn", "--group-size", "96"], 2, "hidden_size"),
        "compare-rtn without eval": ([m, "--method", "rtn", "--compare-rtn"], 2, "--compare-rtn: needs --eval"),
        "eval file missing": ([m, "--method", "rtn", "--eval", str(tmp_path / "e.txt")], 2, "--eval"),
        "backend cannot run fp8": ([m, "--method", "fp8", "--backend", "gptqmodel"], 2, "does not run --method fp8"),
        "archived backend absent": ([m, "--method", "gptq", "--backend", "auto-gptq", "--calib", str(calib)], 3,
                                    "gptqmodel"),
        "model has no weights": ([str(tmp_path)], 2, "config.json"),
    }


CASE_NAMES = ["missing model dir", "empty calib", "malformed calib", "calib without text", "missing calib file",
              "no calib for awq", "fp8 at 3 bits", "unknown method", "group does not divide",
              "compare-rtn without eval", "eval file missing", "backend cannot run fp8", "archived backend absent",
              "model has no weights"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_is_refused_before_any_work(case, tmp_path, model_dir, calib, capsys):
    args, code, needle = _cases(tmp_path, model_dir, calib)[case]
    if case == "archived backend absent":
        import importlib.util

        if importlib.util.find_spec("auto_gptq") is not None:
            pytest.skip("auto-gptq is installed here")
    out_dir = tmp_path / "out"
    rc, out, err = _copt(capsys, "quantize", *args, "--output", str(out_dir))
    assert rc == code, err
    assert needle in err
    assert "error:" in err and "hint:" in err and "Traceback" not in err
    assert out == ""
    assert not out_dir.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize(("args", "chosen"), [(["--method", "fp8"], "--method fp8"),
                                              (["--method", "int8"], "--method int8"),
                                              (["--scheme", "FP8_DYNAMIC"], "--scheme FP8_DYNAMIC")])
def test_8_bit_methods_with_other_bits_name_the_flags_and_what_goes_together(capsys, model_dir, args, chosen):
    """--method fp8 --bits 4 said 'bits: method fp8 is W8A8' and '- bits must be 8 (got 4)' as two problems."""
    rc, _, err = _copt(capsys, "quantize", str(model_dir), *args, "--bits", "4")
    assert rc == 2 and "1 problem(s)" in err, err
    assert (f"--bits: {chosen} writes 8-bit weights (W8A8), so --bits must be 8 (got 4): leave --bits out, or use "
            "--method awq, gptq or rtn for 4-bit weights") in " ".join(err.split()), err


def test_existing_output_is_not_overwritten(tmp_path, model_dir, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    rc, _, err = _copt(capsys, "quantize", str(model_dir), "--method", "rtn", "--output", str(out_dir))
    assert rc == 2 and "already exists" in err and "--overwrite" in err
    assert (out_dir / "keep.txt").read_text() == "mine"


def test_calibration_files_txt_and_jsonl(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("a\n\nb\nc\n")
    assert read_calibration_texts(txt, 2) == ["a", "b"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "x\\ny"}\n\n{"text": ""}\n{"text": "z"}\n')
    assert read_calibration_texts(jsonl, 10) == ["x\ny", "z"]
    with pytest.raises(BadInputError, match="not valid JSON"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text("[1, 2\n")
        read_calibration_texts(bad, 1)
    with pytest.raises(BadInputError, match="not UTF-8"):
        binary = tmp_path / "b.txt"
        binary.write_bytes(b"\xff\xfe\x00abc")
        read_calibration_texts(binary, 1)
    with pytest.raises(BadInputError, match="is empty"):
        blank = tmp_path / "e.txt"
        blank.write_text("  \n")
        read_eval_text(blank)


def test_schema_defaults_and_cross_checks():
    from clusteropt_cli.recipe.load import load_settings

    s = load_settings("quantize", None, None, {"model": "m", "method": "gptq"})
    assert (s.weight_bits, s.group_size, s.symmetric, s.ignore, s.backend) == (4, 128, True, ["lm_head"],
                                                                               "llmcompressor")
    assert load_settings("quantize", None, None, {"model": "m", "method": "fp8"}).weight_bits == 8
    assert load_settings("quantize", None, ["group_size=64"], {"model": "m", "method": "rtn"}).group_size == 64
    from clusteropt_cli.errors import RecipeError

    with pytest.raises(RecipeError) as exc:
        load_settings("quantize", None, None, {"model": "m", "method": "int8", "bits": 4, "group_size": 0,
                                               "backend": "autoawq"})
    text = str(exc.value)
    assert "--bits must be 8" in text and "--group-size" in text and "autoawq does not run --method int8" in text
    assert load_settings("quantize", None, ["awq_duo_scaling=false"], {"model": "m"}).awq_duo_scaling is False
    with pytest.raises(RecipeError, match="awq_duo_scaling"):
        load_settings("quantize", None, ["awq_duo_scaling=both"], {"model": "m", "method": "gptq"})


def test_awq_modifier_gets_the_duo_scaling_setting():
    from clusteropt_cli.core.quantize.llmc import build_recipe
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

    for value in (True, False, "both"):
        awq = build_recipe("awq", QuantizeRecipe(model="m", awq_duo_scaling=value))[0]
        assert type(awq).__name__ == "AWQModifier" and awq.duo_scaling == value


def test_shipped_quantize_recipes_validate():
    from clusteropt_cli.recipe.load import load_settings

    for name in ("quantize-awq-w4a16", "quantize-gptq-w4a16", "quantize-fp8-w8a8"):
        settings = load_settings("quantize", name, None, {"model": "/some/model"})
        assert settings.model == "/some/model"


def test_help_lists_every_flag(capsys):
    rc, out, _ = _copt(capsys, "quantize", "--help")
    assert rc == 0
    for flag in ("--method", "--bits", "--group-size", "--symmetric", "--calib", "--num-samples", "--seq-len",
                 "--ignore", "--backend", "--eval", "--compare-rtn", "--recipe", "--json", "--overwrite"):
        assert flag in out


def test_observer_reaches_the_weight_scheme_and_the_rtn_baseline_stays_minmax():
    from clusteropt_cli.core.quantize.llmc import build_recipe
    from clusteropt_cli.errors import RecipeError
    from clusteropt_cli.recipe.load import load_settings
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

    def weight_observer(modifier):
        return modifier.config_groups["group_0"].weights.observer or "minmax"  # None: the library default

    settings = QuantizeRecipe(model="m", method="awq")  # AWQ's default: the MSE clipping-range search
    assert settings.weight_observer == "mse" and weight_observer(build_recipe("awq", settings)[1]) == "mse"
    plain = QuantizeRecipe(model="m", method="awq", observer="minmax")
    assert weight_observer(build_recipe("awq", plain)[1]).endswith("minmax")
    assert weight_observer(build_recipe("rtn", settings)[0]).endswith("minmax")  # --compare-rtn's baseline
    assert weight_observer(build_recipe("gptq", QuantizeRecipe(model="m", method="gptq"))[0]).endswith("minmax")
    assert weight_observer(build_recipe("gptq", QuantizeRecipe(model="m", method="gptq",
                                                               observer="imatrix_mse"))[0]) == "imatrix_mse"
    with pytest.raises(RecipeError) as exc:
        load_settings("quantize", None, ["observer=imatrix_mse"], {"model": "m", "method": "rtn"})
    assert "rtn runs none" in str(exc.value)
    with pytest.raises(RecipeError, match="observer: applies to integer weights"):
        load_settings("quantize", None, ["observer=mse"], {"model": "m", "method": "fp8"})


def test_quantize_dot_from_inside_the_model_writes_beside_it(model_dir, monkeypatch, capsys):
    """`copt quantize .` run inside the model directory: the default output goes beside the model, not into it."""
    monkeypatch.chdir(model_dir)
    rc, out, err = _copt(capsys, "quantize", ".", "--method", "rtn", "--dry-run", "--json")
    assert rc == 0, err
    assert json.loads(out)["output"] == str(model_dir.parent / "model-rtn-w4g128")
    monkeypatch.chdir(model_dir.parent)
    rc, out, err = _copt(capsys, "quantize", "model", "--method", "rtn", "--dry-run", "--json")
    assert rc == 0, err
    assert json.loads(out)["output"] == str(model_dir.parent / "model-rtn-w4g128")


def test_ignore_entries_must_match_a_module_of_the_model(fixtures, tmp_path, monkeypatch, capsys):
    """--ignore down_proj (not a module's full name) was accepted and llm-compressor quantized every down_proj: an
    entry that matches no module (exact name, re:REGEX from the start of a name, or a class name) is refused before
    any loading, naming real modules; the default lm_head is not checked."""
    base = ("quantize", str(fixtures.student), "--method", "fp8", "--output", str(tmp_path / "q"), "--dry-run")
    rc, _, err = _copt(capsys, *base, "--ignore", "lm_head", "--ignore", "down_proj")
    assert rc == 2 and "--ignore down_proj: no module" in err, err
    assert r"re:.*\.down_proj$" in err and "model.layers.0.self_attn.q_proj" in err and "lm_head" in err
    rc, _, err = _copt(capsys, *base, "--ignore", r"re:.*\.layers\.7\.", "--ignore", "re:(")
    assert rc == 2 and "--ignore re:(: not a regular expression" in err, err
    rc, _, err = _copt(capsys, *base, "--ignore", r"re:.*\.layers\.7\.")
    assert rc == 2 and "no module of the model" in err, err
    rc, _, err = _copt(capsys, *base, "--ignore", "lm_head", "--ignore", r"re:.*\.down_proj$", "--ignore",
                       "model.layers.1.mlp.up_proj", "--ignore", "LlamaDecoderLayer")
    assert rc == 0, err
    assert not (tmp_path / "q").exists()

    from clusteropt_cli.core.quantize import ignore
    from clusteropt_cli.core.quantize.run import plan, run
    from clusteropt_cli.recipe.load import load_settings

    def no_meta_build(_model_dir):
        raise RuntimeError("cannot be built on the meta device")

    monkeypatch.setattr(ignore, "meta_modules", no_meta_build)
    settings = load_settings("quantize", None, None, {"model": str(fixtures.student), "method": "fp8",
                                                      "ignore": ["down_proj"], "output": str(tmp_path / "q")})
    deferred = plan(settings)
    assert deferred.ignore_after_load  # checked once the model is loaded, before any quantization
    with pytest.raises(BadInputError, match="--ignore down_proj: no module"):
        run(deferred)
    assert not (tmp_path / "q").exists()
    default = load_settings("quantize", None, None, {"model": str(fixtures.student), "method": "fp8",
                                                     "output": str(tmp_path / "q")})
    assert not plan(default).ignore_after_load


def test_loading_gptqmodel_leaves_the_users_device_order_and_caches_alone(monkeypatch):
    """Importing GPTQModel (7.6) sets CUDA_DEVICE_ORDER=PCI_BUS_ID and, through its tokenizer helper, HF_HOME,
    HF_HUB_CACHE, TRANSFORMERS_CACHE and HF_MODULES_CACHE under /tmp where the user had not set them; copt's backend
    loader puts them back and keeps what the user had set. (A stand-in import sets them as GPTQModel's does: the real
    import takes 15 s here.)"""
    import os

    from clusteropt_cli import deps
    from clusteropt_cli.core.quantize import legacy

    def import_as_gptqmodel_does(*_):
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        home = os.environ.setdefault("HF_HOME", "/tmp/tokenicer_hf_home")
        hub = os.environ.setdefault("HF_HUB_CACHE", f"{home}/hub")
        os.environ.setdefault("TRANSFORMERS_CACHE", hub)
        os.environ.setdefault("HF_MODULES_CACHE", f"{home}/modules")
        return "gptqmodel"

    for key in legacy._GPTQMODEL_IMPORT_SETS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", "/mine/hub")
    monkeypatch.setattr(deps, "require", import_as_gptqmodel_does)
    assert legacy._gptqmodel() == "gptqmodel"
    assert {key: os.environ.get(key) for key in legacy._GPTQMODEL_IMPORT_SETS} == {
        "CUDA_DEVICE_ORDER": None, "HF_HOME": None, "HF_HUB_CACHE": "/mine/hub", "TRANSFORMERS_CACHE": None,
        "HF_MODULES_CACHE": None}
