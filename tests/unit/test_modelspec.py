"""modelspec: exact parameter counts from config.json, presets, KV cache, FLOPs, bad input."""

from __future__ import annotations

import json

import pytest

from clusteropt_cli.errors import BadInputError
from clusteropt_cli.modelspec import list_presets, load_model_spec

# published / HF-reported totals
EXACT = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize(("name", "expected"), sorted(EXACT.items()))
def test_exact_parameter_counts(name: str, expected: int) -> None:
    assert load_model_spec(name).num_params == expected


def test_moe_active_parameters() -> None:
    mixtral = load_model_spec("mixtral-8x7b")
    assert mixtral.num_active_params == 12_879_925_248  # 2 of 8 experts
    ds = load_model_spec("deepseek-v3")
    assert ds.is_moe and ds.is_mla
    assert ds.num_moe_layers == 58 and ds.num_dense_layers == 3
    assert abs(ds.num_params - 671e9) / 671e9 < 0.005  # 671B without the MTP module
    assert abs(ds.num_active_params - 37e9) / 37e9 < 0.03  # 37B activated


def test_gpt3_weights_350gb_fp16() -> None:
    gpt3 = load_model_spec("gpt3-175b")
    assert abs(gpt3.num_params * 2 / 1e9 - 350) / 350 < 0.01


def test_kv_cache_per_token() -> None:
    llama2_7b = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000}
    spec = load_model_spec(llama2_7b)
    assert spec.num_params == 6_738_415_616
    assert spec.kv_cache_bytes_per_token(2) == 0.5 * 2**20  # 0.5 MiB per token in fp16
    assert load_model_spec("llama-3.1-8b").kv_cache_bytes_per_token(2) == 128 * 1024  # GQA: 8 KV heads
    ds = load_model_spec("deepseek-v3")
    assert ds.kv_cache_bytes_per_token(1) == 61 * (512 + 64)  # MLA latent + rope key
    assert ds.kv_cache_bytes_per_token(2, mla_compressed=False) == 61 * 128 * (192 + 128) * 2


def test_flops_per_token() -> None:
    spec = load_model_spec("llama-3.1-8b")
    non_embedding = spec.num_params - spec.vocab_size * spec.hidden_size
    assert spec.forward_flops_per_token(0) == 2 * non_embedding
    attn = 2 * 32 * 32 * (128 + 128) * 4096
    assert spec.forward_flops_per_token(4096) == 2 * non_embedding + attn
    assert spec.training_flops_per_token(4096) == 3 * spec.forward_flops_per_token(4096)
    tied = load_model_spec("llama-3.2-1b")  # tied head: the matmul still happens
    assert tied.forward_flops_per_token(0) == 2 * tied.num_params


def test_sources_dir_file_dict(tmp_path) -> None:
    cfg = load_model_spec("qwen2.5-0.5b").to_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_spec(tmp_path).num_params == 494_032_768
    assert load_model_spec(tmp_path / "config.json").num_params == 494_032_768
    assert load_model_spec(cfg).num_params == 494_032_768
    assert load_model_spec("LLAMA-3.2-1B").tie_word_embeddings


def test_fixture_model_matches_torch(fixtures) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = load_model_spec(fixtures.teacher)
    model = AutoModelForCausalLM.from_pretrained(fixtures.teacher, dtype=torch.float32)
    assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_presets_match_transformers_modules() -> None:
    """Build every preset on the meta device with transformers and count its parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in list_presets():
        spec = load_model_spec(name)
        if name == "llama-3.1-405b":
            continue  # same family as 8b/70b; skip to keep the test fast
        cfg = spec.to_hf_config()
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == spec.num_params, name


def test_presets_listed() -> None:
    names = set(list_presets())
    assert {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen2.5-0.5b",
            "qwen2.5-7b", "qwen2.5-72b", "mistral-7b", "mixtral-8x7b", "deepseek-v3", "gpt3-175b"} <= names


def test_bad_sources(tmp_path) -> None:
    with pytest.raises(BadInputError, match="neither a preset"):
        load_model_spec("llama-9")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(BadInputError, match="not valid JSON"):
        load_model_spec(bad)
    with pytest.raises(BadInputError, match="no config.json"):
        load_model_spec(tmp_path / "..")
    with pytest.raises(BadInputError, match="hidden_size"):
        load_model_spec({"model_type": "llama", "num_hidden_layers": 2})


@pytest.mark.parametrize("vocab_file", ["vocab.txt", "spiece.model", "sentencepiece.bpe.model"])
def test_a_tokenizer_saved_as_its_vocabulary_file_alone_is_a_tokenizer_directory(tmp_path, vocab_file):
    """AutoTokenizer loads a directory holding config.json and a WordPiece or SentencePiece vocabulary file without
    tokenizer_config.json (older checkpoints): --tokenizer such a directory was refused as holding no tokenizer."""
    from clusteropt_cli.modelspec import has_tokenizer_files, tokenizer_dir_problem

    (tmp_path / "config.json").write_text('{"model_type": "bert", "vocab_size": 7}')
    assert tokenizer_dir_problem(tmp_path) is not None
    (tmp_path / vocab_file).write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\n")
    assert tokenizer_dir_problem(tmp_path) is None and has_tokenizer_files(tmp_path)
    if vocab_file == "vocab.txt":  # the directory is one transformers reads
        transformers = pytest.importorskip("transformers")
        assert len(transformers.AutoTokenizer.from_pretrained(str(tmp_path))) == 7


def _tokenizer_with_code(directory, tokenizer_class: str | None = "MyTokenizer", model_type: str | None = None):
    """A word-level fast tokenizer whose tokenizer_config.json maps AutoTokenizer to the directory's own code: a
    module that, imported, would leave a file behind."""
    import json

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(directory)
    (directory / "my_tokenizer.py").write_text(
        f"open({str(directory / 'RAN')!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\nclass MyTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    config["auto_map"] = {"AutoTokenizer": [None, "my_tokenizer.MyTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))


def test_a_tokenizer_only_its_shipped_code_implements_is_named_before_transformers_asks(tmp_path):
    """transformers asks on the terminal whether to run a tokenizer's shipped code when it has no class of that
    name (copt's engine process reported the refusal as an internal error): copt names it first and never runs it.
    A class transformers has loads without the code: not refused."""
    transformers = pytest.importorskip("transformers")
    from clusteropt_cli.modelspec import tokenizer_code_problem, tokenizer_dir_problem

    custom = tmp_path / "custom"
    _tokenizer_with_code(custom)
    assert "auto_map" in tokenizer_code_problem(custom) and "'MyTokenizer'" in tokenizer_code_problem(custom)
    assert tokenizer_dir_problem(custom).startswith(f"--tokenizer {custom}: tokenizer_config.json maps AutoTokenizer")
    with pytest.raises(ValueError, match="trust_remote_code"):  # what transformers does in a non-interactive run
        transformers.AutoTokenizer.from_pretrained(str(custom))
    assert not (custom / "RAN").exists()
    no_class = tmp_path / "no-class"  # even beside a model_type transformers knows, it asks
    _tokenizer_with_code(no_class, tokenizer_class=None, model_type="llama")
    assert "it names no tokenizer_class" in tokenizer_code_problem(no_class)
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoTokenizer.from_pretrained(str(no_class))

    loads = tmp_path / "known-class"
    _tokenizer_with_code(loads, tokenizer_class="PreTrainedTokenizerFast")
    assert tokenizer_code_problem(loads) is None and tokenizer_dir_problem(loads) is None
    transformers.AutoTokenizer.from_pretrained(str(loads))  # transformers' own class; the code is not run
    assert not (loads / "RAN").exists() and not (custom / "RAN").exists()
    plain = tmp_path / "plain"
    _tokenizer_with_code(plain)
    (plain / "tokenizer_config.json").write_text('{"tokenizer_class": "MyTokenizer"}')  # no auto_map: not code
    assert tokenizer_code_problem(plain) is None


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                  "added_tokens.json", "generation_config.json"])
def test_every_json_file_a_load_reads_is_checked_before_loading(tmp_path, name):
    """A broken special_tokens_map.json reached copt serve's engine as "internal error: JSONDecodeError" (no file
    named); a broken generation_config.json was dropped without a word (the model's sampling defaults with it)."""
    from clusteropt_cli.modelspec import check_model_files, tokenizer_dir_problem

    (tmp_path / "tokenizer.json").write_text("{}")
    check_model_files(tmp_path)
    (tmp_path / name).write_text('{"bos_token": ')
    with pytest.raises(BadInputError, match=f"--model {tmp_path}: {name} is not valid JSON"):
        check_model_files(tmp_path)
    assert tokenizer_dir_problem(tmp_path).startswith(f"--tokenizer {tmp_path}: {name} is not valid JSON")
