"""copt quantize from the command line, atomic output and --overwrite, and the gptqmodel backend."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]




def test_cli_json_report_and_checkpoint(copt, fixtures, tmp_path):
    out = tmp_path / "rtn4"
    proc = copt("quantize", str(fixtures.teacher), "--method", "rtn", "--bits", "4", "--group-size", "64",
                "--eval", str(fixtures.eval_text), "--compare-rtn", "--json", "--output", str(out), "eval_tokens=2048",
                env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # exactly one JSON document on stdout (library logs go to stderr)
    assert report == json.loads((out / "copt_quant_report.json").read_text())
    assert report["scheme"] == "W4A16 int g64 sym" and report["bits"] == 4 and report["group_size"] == 64
    assert report["eval_tokens"] == 2048 - 2048 // 512 and report["eval_block_len"] == 512
    assert report["ppl_rtn"] == report["ppl_after"]  # rtn is its own baseline
    # 4-bit g64 on the fixture: within 3 % of the original perplexity
    assert report["ppl_after"] == pytest.approx(report["ppl_before"], rel=0.03)
    assert report["sample_generation"]
    assert report["compression_ratio"] > 2.0
    assert report["servable_by_vllm"]["servable"] and "W4A16" in report["servable_by_vllm"]["reason"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rtn4"]


def test_unservable_checkpoint_is_announced_before_work_and_reported(copt, fixtures, tmp_path):
    out = tmp_path / "rtn3"
    proc = copt("quantize", str(fixtures.teacher), "--method", "rtn", "--bits", "3", "--group-size", "64",
                "--output", str(out), env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = proc.stderr.index("vLLM will not serve this checkpoint: 3-bit weights")
    assert warning < proc.stderr.index("quantizing")  # before the work starts
    assert "servable by vLLM" in proc.stdout and "no (3-bit weights" in proc.stdout
    report = json.loads((out / "copt_quant_report.json").read_text())
    assert report["servable_by_vllm"]["servable"] is False


def _settings(fixtures, out, **fields):
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

    return QuantizeRecipe(model=str(fixtures.teacher), output=str(out), **fields)


def test_overwrite_replaces_and_failure_leaves_nothing(fixtures, tmp_path, monkeypatch):
    from clusteropt_cli.core.quantize import backends, plan, run
    from clusteropt_cli.errors import BadInputError

    out = tmp_path / "fp8"
    out.mkdir()
    (out / "old.txt").write_text("previous run")
    with pytest.raises(BadInputError, match="already exists"):
        plan(_settings(fixtures, out, method="fp8"))
    with pytest.raises(BadInputError, match="would delete: old.txt"):  # not copt's: --overwrite refuses too
        plan(_settings(fixtures, out, method="fp8"), overwrite=True)
    from clusteropt_cli.core.io import write_output_marker

    write_output_marker(out, "quantize")  # as a previous copt run leaves it
    report = run(plan(_settings(fixtures, out, method="fp8"), overwrite=True))
    assert not (out / "old.txt").exists() and (out / "copt_quant_report.json").is_file()
    assert report.ppl_before is None and report.size_after_bytes < report.size_before_bytes

    def fail_halfway(model, tokenizer, settings, texts, output_dir, **kwargs):
        (output_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("interrupted while saving")

    monkeypatch.setattr(backends, "quantize", fail_halfway)
    fresh = tmp_path / "never"
    with pytest.raises(RuntimeError, match="interrupted"):
        run(plan(_settings(fixtures, fresh, method="fp8")))
    assert not fresh.exists()
    with pytest.raises(RuntimeError):
        run(plan(_settings(fixtures, out, method="fp8"), overwrite=True))
    assert (out / "copt_quant_report.json").is_file()  # the previous output survives a failed --overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


def test_gptqmodel_backend_writes_the_gptq_format(fixtures, tmp_path):
    pytest.importorskip("gptqmodel")
    import torch
    from transformers import AutoModelForCausalLM

    from clusteropt_cli.core.quantize import plan, run

    calib = tmp_path / "calib.txt"
    lines = [line for line in fixtures.train_text.read_text().splitlines() if len(line) > 40]
    calib.write_text("\n".join(lines[:64]) + "\n")
    out = tmp_path / "gptq"
    report = run(plan(_settings(fixtures, out, method="gptq", backend="gptqmodel", bits=4, group_size=64,
                                calib=str(calib), num_samples=64, seq_len=64, eval=str(fixtures.eval_text),
                                eval_tokens=2048)))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bits"], config["group_size"], config["sym"]) == ("gptq", 4, 64, True)
    assert report.backend_version.startswith("gptqmodel 7.") and report.calib_samples == 64
    assert report.ppl_after == pytest.approx(report.ppl_before, rel=0.05)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    reference = AutoModelForCausalLM.from_pretrained(fixtures.teacher)
    ids = torch.arange(1, 65).view(1, 64) * 7 % 1000
    with torch.no_grad():
        ref = torch.log_softmax(reference(input_ids=ids).logits.float(), -1)
        got = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert kl < 0.05, kl
