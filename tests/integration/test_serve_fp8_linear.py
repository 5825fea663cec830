"""FP8 checkpoints run through Fp8Linear: the same numbers as compressed-tensors' own forward, in copt serve too."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def fp8_checkpoint(fixtures, tmp_path_factory):
    from clusteropt_cli.core.quantize import plan, run
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

    out = tmp_path_factory.mktemp("fp8") / "teacher-fp8"
    run(plan(QuantizeRecipe(model=str(fixtures.teacher), output=str(out), method="fp8")))
    return out


def _load(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_fp8linear_equals_compressed_tensors_forward(fp8_checkpoint, fixtures):
    import torch

    from clusteropt_cli.core.serve.fp8_linear import fp8_matmul_supported, swap_fp8_linears

    ids = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake_quant = _load(fp8_checkpoint)(ids).logits  # compressed-tensors: dequantize, then fp32 matmul
        model = _load(fp8_checkpoint)
        swapped = swap_fp8_linears(model)
        ours = model(ids).logits
        original = _load(fixtures.teacher)(ids).logits
    # 4 layers × (q, k, v, o, gate, up, down); lm_head stays unquantized (the recipe ignores it)
    assert swapped == 28
    layer = model.model.layers[0].mlp.down_proj
    assert type(layer).__name__ == "Fp8Linear" and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.use_scaled_mm is fp8_matmul_supported("cpu") is False
    torch.testing.assert_close(ours, fake_quant, atol=1e-4, rtol=1e-4)
    # and it is a quantized model, close to but not equal to the original
    cosine = torch.nn.functional.cosine_similarity(ours.flatten(), original.flatten(), dim=0)
    assert 0.99 < cosine < 1.0 - 1e-6


def test_fp8linear_math_against_a_manual_quantization():
    import torch

    from clusteropt_cli.core.serve.fp8_linear import FP8_MAX, fp8_linear

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=gen)
    w_scale = w.abs().amax(dim=1) / FP8_MAX
    w_q = (w / w_scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(3, 5, 64, generator=gen)
    layer = fp8_linear(w_q, w_scale, bias=torch.ones(32), use_scaled_mm=False)
    x2 = x.reshape(-1, 64)
    s = x2.abs().amax(dim=1, keepdim=True) / FP8_MAX
    want = ((x2 / s).to(torch.float8_e4m3fn).float() * s) @ (w_q.float() * w_scale[:, None]).t() + 1
    torch.testing.assert_close(layer(x), want.reshape(3, 5, 32))
    # within FP8's resolution of the unquantized product
    assert (layer(x) - (x @ w.t() + 1)).abs().max() < 0.1 * (x @ w.t()).abs().max()
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(w, w_scale)


def test_copt_serve_engine_runs_fp8_checkpoint(fp8_checkpoint):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig, GenerationRequest

    engine = Engine(EngineConfig(model=str(fp8_checkpoint), max_batch_size=4, max_model_len=256, device="cpu"))
    with engine:
        assert engine.runner.fp8_linears == 28 and engine.runner.fp8_kernels is False
        out = engine.generate([GenerationRequest(prompt_ids=[5, 6, 7, 8], max_new_tokens=8, ignore_eos=True)])
    assert out[0].num_output_tokens == 8


def test_compiled_per_token_quantization_is_exact():
    """The fused (torch.compile) quantization used on FP8 GPUs gives the eager ops' bits."""
    import torch

    from clusteropt_cli.core.serve.fp8_linear import _compiled_quantize_per_token, quantize_per_token

    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)) * 3
    want_q, want_s = quantize_per_token(x)
    got_q, got_s = _compiled_quantize_per_token()(x)
    assert got_q.dtype == torch.float8_e4m3fn and got_s.shape == (7, 1)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=0)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
