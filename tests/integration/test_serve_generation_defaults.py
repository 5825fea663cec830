"""copt's engine applies generation_config.json sampling defaults to requests that omit them, as vLLM does."""

from __future__ import annotations

import json

import httpx
import pytest

from clusteropt_cli.core.serve.sampling import generation_defaults
from tests.integration.test_serve_helpers import eval_prompts, hf_greedy, running_server

pytestmark = pytest.mark.slow


def _with_generation_config(src, dst, **values):
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    base = json.loads((src / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**base, **values}))
    return dst


def test_generation_defaults_read_like_vllm(fixtures, tmp_path):
    assert generation_defaults(str(fixtures.teacher)) == {}  # only eos/bos there
    model = _with_generation_config(fixtures.teacher, tmp_path / "m", do_sample=False, temperature=0.6, top_p=0.9,
                                    top_k=20, repetition_penalty=1.1, min_p=0.05)
    assert generation_defaults(str(model)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                               "repetition_penalty": 1.1}  # do_sample ignored


def test_request_without_sampling_options_uses_the_models_defaults(fixtures, tmp_path):
    # top_p 0.01 keeps only the most likely token: a request that takes the model's defaults decodes greedily
    model = _with_generation_config(fixtures.teacher, tmp_path / "m", do_sample=True, temperature=0.7, top_p=0.01)
    prompt = eval_prompts(fixtures, 1, seed=5)[0]
    greedy = hf_greedy(fixtures.teacher, [prompt], 24)[0]
    with running_server(model, "--max-model-len", "256") as (url, _proc):
        def ask(**sampling):
            body = {"model": str(model), "prompt": prompt, "max_tokens": 24, "seed": 1, "return_token_ids": True,
                    "ignore_eos": True, **sampling}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        sampled = ask(temperature=1.0, top_p=1.0)  # what the request got before: T=1, top_p=1
        assert sampled[: len(greedy)] != greedy  # the check below can tell the two apart
        assert ask()[: len(greedy)] == greedy
