"""Which checkpoints vLLM can serve (checked before quantizing), and llm-compressor's scheme presets."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.quantize.servable import vllm_servability
from clusteropt_cli.errors import RecipeError
from clusteropt_cli.recipe.load import load_settings
from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe


def _q(**fields):
    return QuantizeRecipe(model="m", **fields)


@pytest.mark.parametrize(("fields", "servable", "why"), [
    ({"method": "awq"}, True, "W4A16"),
    ({"method": "gptq", "bits": 8, "group_size": -1}, True, "W8A16, per-channel"),
    ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}, True, "W4A16_ASYM"),
    ({"method": "awq", "bits": 3}, False, "3-bit weights"),
    ({"method": "gptq", "bits": 2}, False, "2-bit weights"),
    ({"method": "rtn", "group_size": 256}, False, "group size 256"),
    ({"method": "rtn", "group_size": 16}, False, "group size 16"),
    ({"method": "rtn", "bits": 8, "symmetric": False}, False, "asymmetric 8-bit"),
    ({"method": "fp8"}, True, "FP8_DYNAMIC"),
    ({"method": "int8"}, True, "W8A8"),
    ({"method": "gptq", "backend": "gptqmodel", "bits": 3}, True, "GPTQ format"),
    ({"method": "awq", "backend": "gptqmodel", "bits": 8}, False, "AWQ kernels take 4"),
])
def test_servability(fields, servable, why):
    result = vllm_servability(_q(**fields))
    assert result.servable is servable and why in result.reason
    assert result.line().startswith("yes (" if servable else "no (")


def test_scheme_presets_as_llm_compressor_names_them():
    s = _q(scheme="W4A16_ASYM", method="gptq")
    assert (s.method, s.weight_bits, s.group_size, s.symmetric) == ("gptq", 4, 128, False)
    assert _q(scheme="w8a16").weight_bits == 8 and _q(scheme="W8A16").group_size == 128
    assert _q(scheme="W8A8").method == "int8" and _q(scheme="FP8_DYNAMIC").method == "fp8"
    assert _q(scheme="W4A16", bits=4).weight_bits == 4  # agreeing keys are fine
    for bad, message in [({"scheme": "W4A16", "bits": 8}, "disagrees with --bits=8"),
                         ({"scheme": "W4A16", "method": "fp8"}, "weight-only"),
                         ({"scheme": "FP8"}, "FP8_DYNAMIC"),
                         ({"scheme": "NF4"}, "unknown"),
                         ({"scheme": "W8A8", "method": "awq"}, "disagrees with --method=awq")]:
        with pytest.raises(RecipeError, match=message):
            load_settings("quantize", None, [], {"model": "m", **bad})
