"""The serve engine in-process: speculation rules, prompt lookup, text streaming, sampling options, vLLM argv."""

from __future__ import annotations

import json

import pytest

from clusteropt_cli.core.serve.engine import Engine, EngineConfig
from clusteropt_cli.core.serve.requests import GenerationRequest, QueueFullError, TextStream
from clusteropt_cli.core.serve.speculative import _ngram_draft
from clusteropt_cli.core.serve.vllm import build_vllm_command
from clusteropt_cli.errors import BadInputError
from clusteropt_cli.recipe.schema.serve import ServeRecipe


@pytest.fixture(scope="module")
def engine(fixtures):
    import torch

    torch.set_num_threads(1)
    eng = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=8, max_model_len=256, prompt_lookup=3,
                              speculative_max_batch=8, num_speculative_tokens=4, max_queue=4))
    eng.start()
    yield eng
    eng.stop()


def test_greedy_speculative_acceptance_and_prompt_lookup():
    import torch

    from clusteropt_cli.core.serve.device_sampling import RowSettings, speculative_accept

    logits = torch.full((3, 8), -5.0)
    logits[0, 4] = logits[1, 6] = logits[2, 1] = 5.0
    greedy = RowSettings(temperature=0.0)
    assert speculative_accept(logits, {}, None, [4, 6], None, greedy) == [4, 6, 1]  # all accepted + bonus
    assert speculative_accept(logits, {}, None, [4, 2], None, greedy) == [4, 6]  # mismatch → the target's
    assert _ngram_draft([1, 2, 3, 9, 9, 1, 2, 3], 3, 2) == [9, 9]
    assert _ngram_draft([5, 6, 7], 3, 2) == []


def test_text_stream_never_leaks_a_stop_string(fixtures):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures.tokenizer)
    ids = tok.encode("return self.value\n\ndef other():", add_special_tokens=False)
    stream = TextStream(tok, stop=["\n\ndef"])
    text = "".join(stream.push([i]) for i in ids)
    assert text == "return self.value"
    assert stream.finish("return self.value") == ""


def test_plain_decoder_gives_the_tokenizers_text(fixtures):
    """The streams' detokenizer skips transformers' decode wrapper only where the text is the same."""
    import random

    from transformers import AutoTokenizer

    from clusteropt_cli.core.serve.requests import plain_decoder

    tok = AutoTokenizer.from_pretrained(fixtures.tokenizer)
    decode = plain_decoder(tok)
    assert decode.func == tok._tokenizer.decode  # the backend itself
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok))
               for _ in range(rng.randint(0, 6))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)

    class Custom(type(tok)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "custom"

    tok.__class__ = Custom
    assert plain_decoder(tok)([5, 6]) == "custom"  # a tokenizer with its own decode keeps it
    tok.__class__ = Custom.__mro__[1]
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert plain_decoder(tok).func == tok.decode  # clean-up asked for: transformers' decode



def test_frozen_startup_heap_keeps_startup_objects_out_of_collections():
    import gc
    import weakref

    from clusteropt_cli.core.serve.requests import frozen_startup_heap

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle
    assert gc.get_freeze_count() == 0
    with frozen_startup_heap():
        assert gone() is None  # start-up's cyclic garbage is collected before the freeze
        assert gc.get_freeze_count() > 1000  # everything alive now is left out of the collections
        late = Node()
        late.self = late
        late_ref = weakref.ref(late)
        del late
        gc.collect()
        assert late_ref() is None  # what serving makes is still collected
    assert gc.get_freeze_count() == 0

def test_prompt_lookup_gives_identical_greedy_output(fixtures, engine):
    from tests.integration.test_serve_helpers import eval_prompts, hf_greedy

    prompts = [p + p[:12] for p in eval_prompts(fixtures, 6, seed=31)]  # repetition gives lookups something to find
    expected = hf_greedy(fixtures.teacher, prompts, 20)
    before = (engine.stats.spec_drafted, engine.stats.spec_accepted)
    results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=20) for p in prompts])
    assert [r.output_ids for r in results] == expected
    assert engine.stats.spec_drafted > before[0] and engine.stats.spec_accepted > before[1]


def test_sampling_options(engine):
    prompt = list(range(40, 60))
    a, b, c = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0.8, seed=s)
                               for s in (1, 1, 2)])
    assert a.output_ids == b.output_ids and len(a.output_ids) > 0
    forced = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=30, min_tokens=30)])[0]
    assert forced.num_output_tokens == 30 and forced.finish_reason == "length"
    handle = engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=200, ignore_eos=True))
    first = next(iter(handle))
    handle.cancel()
    result = handle.result(timeout=30)
    assert first and result.finish_reason == "abort" and result.num_output_tokens < 200
    with pytest.raises(BadInputError):
        engine.submit(GenerationRequest(prompt_ids=list(range(2, 300))))
    with pytest.raises(BadInputError):
        engine.submit(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=0))


def test_queue_full_is_refused(engine):
    handles = []
    with pytest.raises(QueueFullError):
        for _ in range(8 + 4 + 1):  # 8 free slots + max_queue 4 → the 13th is refused
            handles.append(engine.submit(GenerationRequest(prompt_ids=[3, 4, 5], max_new_tokens=50, ignore_eos=True)))
    for h in handles:
        h.cancel()
    for h in handles:
        h.result(timeout=30)


def test_vllm_command_translation():
    settings = ServeRecipe(model="/models/llama", engine="vllm", port=9000, api_key="k", dtype="bf16",
                           max_batch_tokens=4096, max_batch_size=128, max_model_len=8192, kv_cache_dtype="fp8",
                           quantization="compressed-tensors", tensor_parallel=4, pipeline_parallel=2,
                           draft_model="/models/draft", num_speculative_tokens=3, speculative_max_batch=8,
                           kv_cache_memory=20.0)
    cmd = build_vllm_command(settings, "0.33.0")
    assert cmd[:3] == ["vllm", "serve", "/models/llama"]
    pairs = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "9000" and pairs["--dtype"] == "bfloat16"
    assert pairs["--max-num-batched-tokens"] == "4096" and pairs["--max-num-seqs"] == "128"
    assert pairs["--tensor-parallel-size"] == "4" and pairs["--pipeline-parallel-size"] == "2"
    assert pairs["--kv-cache-dtype"] == "fp8" and pairs["--quantization"] == "compressed-tensors"
    assert pairs["--kv-cache-memory-bytes"] == str(20 * 2**30) and pairs["--api-key"] == "k"
    spec = json.loads(pairs["--speculative-config"])
    assert spec == {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 9, 0]]}
    ngram = build_vllm_command(ServeRecipe(model="m", prompt_lookup=4))
    spec = json.loads(ngram[ngram.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["prompt_lookup_max"] == 4
    # vLLM's graphs + compile are on unless either copt switch turns them off
    assert "--enforce-eager" not in cmd
    assert "--enforce-eager" in build_vllm_command(ServeRecipe(model="m", compile=False))
    assert "--enforce-eager" in build_vllm_command(ServeRecipe(model="m", cuda_graphs=False))
    assert not any("async-scheduling" in arg for arg in cmd)  # unset: vLLM's own default (on since 0.14)
    assert "--async-scheduling" in build_vllm_command(ServeRecipe(model="m", async_scheduling=True))
    assert "--no-async-scheduling" in build_vllm_command(ServeRecipe(model="m", async_scheduling=False))


def test_cli_dry_run_and_validation(copt, fixtures):
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--prompt-lookup", "3", "--port", "9001")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("vllm serve /models/llama --host 127.0.0.1 --port 9001")
    assert '"method":"ngram"' in r.stdout
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--json")
    assert json.loads(r.stdout)["command"][:2] == ["vllm", "serve"]
    r = copt("serve", "/no/such/model", "--engine", "copt")
    assert r.returncode == 2 and "not a local model directory" in r.stderr
    r = copt("serve", str(fixtures.teacher), "--draft-model", str(fixtures.draft), "--prompt-lookup", "2")
    assert r.returncode == 2 and "--draft-model" in r.stderr
    r = copt("serve", str(fixtures.teacher), "--engine", "vllm")
    assert r.returncode == 2 and "vLLM" in r.stderr
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--tokenizer", "/models/tok")
    assert r.returncode == 0 and "--tokenizer /models/tok" in r.stdout, r.stderr
    for bad, message in (("/no/such/tokenizer", "no such directory"), (str(fixtures.root), "holds no tokenizer")):
        r = copt("serve", str(fixtures.teacher), "--engine", "copt", "--tokenizer", bad)
        assert r.returncode == 2 and message in " ".join(r.stderr.split()), r.stderr


def test_engine_tuning_switches_are_accepted_but_hidden(copt):
    """--cuda-graphs, --compile, --async-scheduling and --decode-attention are experiment switches: off --help,
    still parsed (and passed on); --compile-mode stays listed."""
    r = copt("serve", "--help")
    assert r.returncode == 0 and "--compile-mode" in r.stdout
    for flag in ("--cuda-graphs", "--no-compile", "--async-scheduling", "--decode-attention"):
        assert flag not in r.stdout
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--no-async-scheduling", "--no-cuda-graphs",
             "--no-compile")
    assert r.returncode == 0, r.stderr
    assert "--no-async-scheduling" in r.stdout and "--enforce-eager" in r.stdout
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--enforce-eager", "--json")
    assert r.returncode == 0, r.stderr
    assert "--enforce-eager" in json.loads(r.stdout)["command"]  # vLLM's own spelling: graphs and compile off
    r = copt("serve", "/models/llama", "--dry-run", "--enforce-eager", "--compile")
    assert r.returncode == 2 and "--enforce-eager" in r.stderr
    r = copt("serve", "/models/llama", "--engine", "vllm", "--dry-run", "--decode-attention", "flex")
    assert r.returncode == 2 and "--decode-attention" in r.stderr


def _tiny_causal_lm(model_type: str = "llama"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    return AutoModelForCausalLM.from_config(config).eval()


def test_merged_projections_give_the_same_logits_in_one_gemm_each():
    import torch

    from clusteropt_cli.core.serve.fusion import fuse_projections

    model = _tiny_causal_lm()
    ids = torch.randint(0, 100, (2, 12))
    params_before = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        assert fuse_projections(model) == 4  # 2 layers × (q/k/v, gate/up)
        calls = []
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda mod, _args, _out: calls.append(type(mod).__name__) if isinstance(mod, torch.nn.Linear) else None)
        try:
            merged = model(input_ids=ids).logits
        finally:
            handle.remove()
    assert torch.equal(merged, reference)
    assert sum(p.numel() for p in model.parameters()) == params_before  # weights moved, not copied
    assert len(calls) == 2 * 2 + 1  # o_proj + down_proj per layer, the LM head; q/k/v/gate/up are merged GEMMs
    group = model.model.layers[0].self_attn.k_proj.group
    assert group.pending == 0 and group.output is None and group.input is None  # nothing kept between forwards
    # a forward that stopped after q (an exception half-way) leaves no stale output for the next input
    x1, x2 = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    attn = model.model.layers[0].self_attn
    attn.q_proj(x1)
    start, end = group.bounds[1]
    assert torch.equal(attn.k_proj(x2), torch.nn.functional.linear(x2, group.weight)[..., start:end])


def test_projections_of_unlisted_architectures_and_fp8_layers_stay_separate():
    import torch

    from clusteropt_cli.core.serve.fusion import fuse_projections

    assert fuse_projections(_tiny_causal_lm("olmo2")) == 0  # not on the allowlist of same-input call patterns
    model = _tiny_causal_lm()
    attn = model.model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(64, attn.k_proj.out_features, bias=True)  # bias on k only: not mergeable
    assert fuse_projections(model) == 3
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


def test_compile_mode_reaches_torch_compile_of_the_decode_layers(fixtures, monkeypatch):
    import torch

    from clusteropt_cli.core.serve.runner import ModelRunner
    from clusteropt_cli.errors import RecipeError
    from clusteropt_cli.recipe.load import load_settings

    modes = []
    real_compile = torch.compile

    def recording_compile(fn, **kwargs):
        modes.append(kwargs.get("mode"))
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    runner = ModelRunner(str(fixtures.teacher), device="cpu", num_slots=2, max_len=64, compile_decode=True,
                         compile_mode="max-autotune-no-cudagraphs")
    assert runner.compiled_layers == 4 and modes == ["max-autotune-no-cudagraphs"] * 4
    modes.clear()
    ModelRunner(str(fixtures.teacher), device="cpu", num_slots=2, max_len=64, compile_decode=True)
    assert modes == [None] * 4  # torch.compile's default mode
    modes.clear()
    ModelRunner(str(fixtures.teacher), device="cpu", num_slots=2, max_len=64, compile_decode=True, compile_mode="auto")
    assert modes == [None] * 4  # auto autotunes batch-1 steps on CUDA only
    settings = load_settings("serve", None, ["compile_mode=max-autotune-no-cudagraphs"], {"model": "m"})
    assert settings.compile_mode == "max-autotune-no-cudagraphs"
    assert load_settings("serve", None, ["compile_mode=auto"], {"model": "m"}).compile_mode == "auto"
    with pytest.raises(RecipeError, match="compile_mode"):
        load_settings("serve", None, ["compile_mode=max-autotune-no-cudagraphs", "engine=vllm"], {"model": "m"})


def test_auto_compile_mode_sends_batch_one_decode_steps_to_the_autotuned_layers(fixtures, monkeypatch):
    import torch

    from clusteropt_cli.core.serve import runner as runner_module
    from clusteropt_cli.core.serve.runner import ModelRunner, decode_compile_modes

    assert decode_compile_modes("auto", "cuda") == (None, "max-autotune-no-cudagraphs")
    assert decode_compile_modes("auto", "cpu") == (None, None)
    assert decode_compile_modes("default", "cuda") == (None, None)
    assert decode_compile_modes("max-autotune-no-cudagraphs", "cuda") == ("max-autotune-no-cudagraphs",) * 2
    calls = []

    def recording_compile(fn, mode=None, **kwargs):
        def run(*args, **kw):
            calls.append((mode, (args[0] if args else kw["hidden_states"]).shape[0]))
            return fn(*args, **kw)
        return run

    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(runner_module, "decode_compile_modes", lambda *_: (None, "max-autotune-no-cudagraphs"))
    runner = ModelRunner(str(fixtures.teacher), device="cpu", num_slots=2, max_len=64, compile_decode=True,
                         compile_mode="auto")
    runner.forward_packed([(0, 0, [5, 6, 7]), (1, 0, [8, 9])], [[2], [1]])
    assert calls == []  # packed prefill stays eager
    runner.forward_decode([0], [3], [11])
    assert {c for c in calls} == {("max-autotune-no-cudagraphs", 1)} and len(calls) == runner.compiled_layers
    calls.clear()
    runner.forward_decode([0, 1], [4, 2], [12, 13])
    assert {c for c in calls} == {(None, 2)} and len(calls) == runner.compiled_layers


def test_a_tokenizer_directory_of_its_own_is_what_the_engine_and_its_api_processes_load(fixtures, tmp_path):
    """--tokenizer DIR (vLLM's flag): the engine tokenizes and renders chats with DIR's tokenizer, and the API
    processes of the split server are told DIR, not MODEL."""
    import shutil

    from clusteropt_cli.core.serve.engine import Engine
    from clusteropt_cli.core.serve.engine_core import client_info
    from clusteropt_cli.recipe.load import load_settings

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (fixtures.teacher / name).exists():
            shutil.copy(fixtures.teacher / name, tokenizer / name)
    marker = "{% for m in messages %}[own tokenizer] {{ m['content'] }}{% endfor %}"
    (tokenizer / "chat_template.jinja").write_text(marker)
    config = tokenizer / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_chat_template"'))
    settings = load_settings("serve", None, [], {"model": str(fixtures.teacher), "tokenizer": str(tokenizer)})
    engine = Engine.from_settings(settings, device="cpu")
    engine.load()
    try:
        assert engine.tokenizer.chat_template == marker
        assert client_info(engine)["tokenizer"] == str(tokenizer)
    finally:
        engine.stop()


def test_decode_attention_setting_reaches_the_runner(fixtures):
    from clusteropt_cli.core.serve.engine import Engine
    from clusteropt_cli.core.serve.loading import resolve_decode_attention
    from clusteropt_cli.errors import RecipeError
    from clusteropt_cli.recipe.load import load_settings

    settings = load_settings("serve", None, ["decode_attention=math"], {"model": str(fixtures.teacher)})
    engine = Engine.from_settings(settings, device="cpu")
    assert engine.config.decode_attention == "math"
    assert resolve_decode_attention("auto") in ("sdpa", "flex", "math")
    assert resolve_decode_attention("flex") == "flex"
    for bad in (["decode_attention=math", "engine=vllm"], ["decode_attention=flex", "compile=false"]):
        with pytest.raises(RecipeError, match="decode_attention"):
            load_settings("serve", None, bad, {"model": "m"})
    with pytest.raises(RecipeError, match="decode_attention"):
        load_settings("serve", None, ["decode_attention=fast"], {"model": "m"})


@pytest.mark.parametrize("vocab", [128256, 50257, 4096, 1000])
def test_greedy_tokens_equal_argmax_with_ties(vocab):
    import torch

    from clusteropt_cli.core.serve.runner import greedy_tokens

    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab).to(torch.bfloat16)
    logits[0, 3] = logits[0, vocab - 1] = 50.0  # a tie across chunks: the first index wins, as in argmax
    logits[1, vocab // 2] = logits[1, vocab // 2 + 1] = 50.0  # a tie inside one chunk
    logits[2] = 0.0  # all equal
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(logits)[0] == 3 and greedy_tokens(logits)[2] == 0


def test_cpu_kv_cache_is_sized_from_the_model_and_the_machine():
    from clusteropt_cli.core.serve.loading import cpu_kv_capacity

    per_token = 46_080  # SmolLM2-135M in fp32: 30 layers × 2 × 3 KV heads × 64 × 4 bytes
    gib = 2**30
    # 64 × 4096 tokens would be 11.25 GiB: 10 % of 16 GiB available instead
    tokens, why = cpu_kv_capacity(per_token, 4096, 64, available=16 * gib)
    assert tokens == int(1.6 * gib) // per_token and "10% of 16.0 GiB" in why
    # a large machine: 4 GiB at most
    tokens, why = cpu_kv_capacity(per_token, 4096, 64, available=512 * gib)
    assert tokens == 4 * gib // per_token and "4 GiB" in why
    # what the batch needs when that is less
    assert cpu_kv_capacity(per_token, 512, 2, available=16 * gib) == (1024, "--max-batch-size 2 full sequences")
    # always one full sequence while it fits in half of what is available
    tokens, why = cpu_kv_capacity(per_token, 4096, 64, available=1 * gib)
    assert tokens == 4096 and why.startswith("one sequence")


def test_paged_kernel_decode_takes_one_context_bucket_and_idle_rows_read_one_key(fixtures, monkeypatch):
    """With the paged kernel (its cost follows each row's own blocks), decode steps use one context bucket — graphs
    per batch size only — and rows whose slot is not decoding attend one key, not the bucket: greedy generations
    stay those of the bucketed cache."""
    from clusteropt_cli.core.serve import paged_attention
    from clusteropt_cli.core.serve.runner import ModelRunner

    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]]
    original = paged_attention.paged_decode_attention

    def generations(single_bucket: bool):
        monkeypatch.setattr(ModelRunner, "_paged_kernel_available", lambda self: single_bucket)
        seen = []

        def spy(query, k_pool, v_pool, tables, positions, num_blocks, scale):
            seen.append((positions.clone(), num_blocks))
            return original(query, k_pool, v_pool, tables, positions, num_blocks, scale)

        monkeypatch.setattr(paged_attention, "paged_decode_attention", spy)
        eng = Engine(EngineConfig(model=str(fixtures.teacher), max_batch_size=4, max_model_len=512,
                                  decode_attention="paged", dtype="fp32", cuda_graphs=False, compile=False))
        with eng:
            lengths = list(eng.runner.kv_lengths)
            # one request alone, then three that finish apart (the last decodes with two idle rows below it)
            out = [eng.generate([GenerationRequest(prompt_ids=prompts[0], max_new_tokens=6)])[0].output_ids]
            out += [r.output_ids for r in eng.generate([GenerationRequest(prompt_ids=p, max_new_tokens=n)
                                                        for p, n in zip(prompts, (2, 3, 8), strict=True)])]
            eng.runner._uncompile()  # a compile that fails at capture: SDPA reads the bucket, so buckets return
            after_fallback = list(eng.runner.kv_lengths)
        assert len(after_fallback) > 1 and eng.runner.decode_attention == "sdpa"
        return lengths, out, seen

    bucketed, expected, _ = generations(False)
    single, got, seen = generations(True)
    assert len(bucketed) > 1 and single == [bucketed[-1]]
    assert got == expected and [len(o) for o in got] == [6, 2, 3, 8]
    block_size = 16
    assert seen and all(n == single[0] // block_size for _, n in seen)
    assert all(int(p.max()) < 512 for p, _ in seen)  # no idle row attends from the scratch column (512)
    assert any(len(p) == 3 and (p == 0).sum() == 2 for p, _ in seen)  # the last row decodes alone: two idle rows
