"""The compiled decode layers of every engine in a process stay compiled.

Dynamo keeps compiled entries, and its recompile limit, per code object. When the engine compiled transformers'
decoder-layer forward itself, every engine of the process (a test session, a benchmark, a reloading server) added
its entries to one shared cache; past the limit dynamo silently ran the layers eagerly — FlexAttention unfused, which
then failed inside the CUDA graph capture on the GPU. Here dynamo only traces (the eager backend: no inductor on CPU),
with a recompile limit lowered so that three engines would exhaust a shared cache."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("llama-untied", "gemma3-hybrid")  # plain causal layers; windowed and full layers in one model


@pytest.fixture(scope="module")
def model_dirs(fixtures, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.integration.test_serve_architectures import _configs

    tok = AutoTokenizer.from_pretrained(fixtures.tokenizer)
    configs = _configs(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    root = tmp_path_factory.mktemp("compile-cache")
    dirs = {}
    for name in FAMILIES:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def _decode_code_objects(runner) -> set:
    """The code objects dynamo compiles for the runner's decode layers."""
    return {layer.forward.__kwdefaults__["_compiled"]._torchdynamo_orig_callable.__func__.__code__
            for layer in runner.decoder.layers}


def test_each_engine_compiles_its_decode_layers_in_a_cache_of_its_own(model_dirs, monkeypatch):
    import torch
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from clusteropt_cli.core.serve import runner as runner_mod
    from clusteropt_cli.core.serve.runner import ModelRunner, batch_buckets

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, dynamic=kw.get("dynamic"), backend="eager"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 5)
    eager_flex: list[int] = []  # calls of the flex decode path that dynamo did not trace
    flex_decode = runner_mod._flex_decode

    def spy(*args, **kwargs):
        if not torch.compiler.is_compiling():  # traced, the branch folds away (no guard on the list)
            eager_flex.append(1)
        return flex_decode(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "_flex_decode", spy)
    seen: set = set()
    for _ in range(3):  # six engines in one process: a shared cache would exceed the limit of five entries
        for name in FAMILIES:
            runner = ModelRunner(str(model_dirs[name]), device="cpu", dtype="fp32", num_slots=None, max_len=128,
                                 compile_decode=True, decode_attention="flex")
            runner.allocate(4)
            assert runner.compiled_layers == 4 and runner.decode_attention == "flex"
            codes = _decode_code_objects(runner)
            assert len(codes) == 1 and not codes & seen  # one cache for the runner's layers, shared with no one
            seen |= codes
            eager_flex.clear()
            with torch.inference_mode():
                for batch in reversed(batch_buckets(4)):  # as the CUDA graph capture runs them: warm-up ×2, capture
                    ids = torch.zeros(batch, dtype=torch.long)
                    positions = torch.full((batch,), runner.scratch_pos, dtype=torch.long)
                    for _ in range(3):
                        runner._decode_eager(ids, positions, 128)
            # the full-attention layers reached FlexAttention only while dynamo traced them: never run eagerly
            assert not eager_flex, (name, len(eager_flex))
            entries = len(_debug_get_cache_entry_list(next(iter(codes))))
            assert 1 <= entries <= 4, (name, entries)  # batch 1 and the dynamic batch, per kind of layer
