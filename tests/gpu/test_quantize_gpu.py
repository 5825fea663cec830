"""copt quantize on a CUDA GPU (run with -m gpu on the GPU machine): FP8 and GPTQ on the fixture teacher."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def calib_file(fixtures, tmp_path_factory):
    lines = [line for line in fixtures.train_text.read_text().splitlines() if len(line) > 40]
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n".join(lines[:128]) + "\n")
    return path


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq"])
def test_quantize_on_gpu_reloads_on_gpu(method, fixtures, calib_file, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from clusteropt_cli.core.quantize import plan, run
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

    out = tmp_path / method
    settings = QuantizeRecipe(model=str(fixtures.teacher), output=str(out), method=method, group_size=64,
                              calib=str(calib_file), num_samples=64, seq_len=128, eval=str(fixtures.eval_text),
                              eval_tokens=8192)
    report = run(plan(settings))
    assert report.device == "cuda"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    # 4-bit g64 and FP8 stay within 3 % of the original perplexity on the held-out text
    assert report.ppl_after == pytest.approx(report.ppl_before, rel=0.03)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 33, device="cuda").view(1, 32)).logits
    assert torch.isfinite(logits).all()
    if method == "fp8" and torch.cuda.get_device_capability() >= (8, 9):
        assert not report.warnings or all("FP8" not in w for w in report.warnings)
