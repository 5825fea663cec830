"""A model's shape from its config.json, without loading weights: parameters, layers, heads, KV heads, FLOPs.

`load_model_spec(source)` takes a built-in preset name (`clusteropt_cli/presets/*.json`, each the model's public
config.json), a model directory, a config.json path or a config dict. Parameter counts are exact for the
architectures transformers implements and copt knows (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe,
qwen3_moe, phi3, gemma, gemma2, gemma3, deepseek_v2/v3, gpt2): embeddings, tied heads, GQA, MoE experts (routed +
shared, dense-first layers), MLA projections, q/k norms, Gemma's four norms per layer and biases are all counted as
the HF modules allocate them (buffers such as DeepSeek's `e_score_correction_bias` are not parameters). Other
decoder-only configs with the usual keys are treated as llama-like and marked `exact=False`.

Sliding-window layers (Mistral-style, or hybrid local/global through `layer_types` / `sliding_window_pattern` as
in Gemma-2/3, Qwen2/3's `max_window_layers`) are listed per layer in `layer_windows`, the way transformers builds
its masks: their KV cache and attention cost stop growing at the window.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError

PRESET_DIR = Path(__file__).resolve().parent / "presets"

# families whose parameter layout we count exactly
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmo2", "granite", "phi3",
              "gemma", "gemma2", "gemma3_text"}
GEMMA_FAMILIES = {"gemma", "gemma2", "gemma3_text"}  # tied embeddings by default, (1 + w) RMSNorms
# families whose config defaults to tied input/output embeddings when config.json omits tie_word_embeddings
TIED_BY_DEFAULT = GEMMA_FAMILIES | {"gpt2"}
MLA_FAMILIES = {"deepseek_v2", "deepseek_v3", "kimi_k2"}
GPT2_LIKE = {"gpt2"}


def list_presets() -> list[str]:
    """Names of the built-in model presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the memory and time models need (all counts exact for known families)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_params: int
    num_active_params: int
    embedding_params: int  # input token (+ position) embeddings: a lookup, no FLOPs
    exact: bool = True
    # attention details
    qkv_bias: bool = False
    v_head_dim: int = 0  # value head dim (differs from head_dim only for MLA)
    qk_rope_head_dim: int = 0  # MLA: decoupled RoPE part of q/k
    kv_lora_rank: int = 0  # MLA: compressed KV latent width (0 = not MLA)
    q_lora_rank: int = 0
    sliding_window: int | None = None
    # per layer: the sliding window (None = full attention); empty = every layer full
    layer_windows: tuple[int | None, ...] = ()
    # MLP / MoE
    mlp_gated: bool = True  # SwiGLU (gate, up, down) vs 2-matrix GELU MLP
    num_experts: int = 0  # routed experts per MoE layer (0 = dense)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # total width of the shared expert(s) per MoE layer
    num_moe_layers: int = 0
    norm_with_bias: bool = False  # LayerNorm (weight + bias) vs RMSNorm (weight)
    torch_dtype: str | None = None
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def q_width(self) -> int:
        """Columns of the query projection output (heads × q/k head dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Columns of one of K or V per token as attention sees them (after MLA up-projection)."""
        return self.num_kv_heads * self.head_dim

    @property
    def matmul_params_active(self) -> int:
        """Parameters that take part in a matmul per token: active params minus embedding lookups (+ tied head)."""
        head = self.vocab_size * self.hidden_size if self.tie_word_embeddings else 0
        return self.num_active_params - self.embedding_params + head

    @property
    def num_sliding_layers(self) -> int:
        return sum(w is not None for w in self.layer_windows)

    def layer_contexts(self, context_len: float, windowed: bool = True, window_slack: int = 0) -> float:
        """Sum over layers of the keys one layer holds/attends for a sequence of `context_len` tokens: a
        sliding-window layer keeps min(window + window_slack, context), a full layer the whole context."""
        if not windowed or not self.layer_windows:
            return self.num_layers * context_len
        return sum(context_len if w is None else min(w + window_slack, context_len) for w in self.layer_windows)

    def kv_cache_bytes_per_seq(self, context_len: float, dtype_bytes: float, windowed: bool = True,
                               window_slack: int = 0) -> float:
        """KV cache bytes of one sequence of `context_len` tokens over all layers; with `windowed`, a
        sliding-window layer holds only its window (+ `window_slack` tokens: copt's rings hold a prefill chunk
        next to the window)."""
        per_layer_token = self.kv_cache_bytes_per_token(dtype_bytes) / self.num_layers
        return per_layer_token * self.layer_contexts(context_len, windowed, window_slack)

    def kv_cache_bytes_per_token(self, dtype_bytes: float, mla_compressed: bool = True) -> float:
        """KV cache bytes per token over all layers: 2·layers·kv_heads·head_dim·bytes.

        MLA models store the compressed latent (kv_lora_rank + qk_rope_head_dim per layer, as vLLM/SGLang do)
        when `mla_compressed`; transformers' eager cache stores the decompressed K and V instead.
        """
        if self.is_mla:
            if mla_compressed:
                return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
            return self.num_layers * self.num_heads * (self.head_dim + self.v_head_dim) * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def attention_flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs of QKᵀ and AV for one query token attending to `context_len` keys, all layers (a
        sliding-window layer attends at most its window)."""
        v_dim = self.v_head_dim or self.head_dim
        return 2.0 * self.num_heads * (self.head_dim + v_dim) * self.layer_contexts(context_len)

    def forward_flops_per_token(self, context_len: int) -> float:
        """2·N_active (matmul parameters) + attention over `context_len` keys."""
        return 2.0 * self.matmul_params_active + self.attention_flops_per_token(context_len)

    def training_flops_per_token(self, seq_len: int) -> float:
        """3× forward (forward + backward): 6·N + attention over the full sequence (PaLM's MFU convention)."""
        return 3.0 * self.forward_flops_per_token(seq_len)

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict transformers can build a random-weight model from (AutoConfig.for_model)."""
        cfg = copy.deepcopy(self.config)
        cfg.setdefault("model_type", self.model_type)
        if "architectures" not in cfg:
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel",
                    "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(self.model_type)
            if arch:
                cfg["architectures"] = [arch]
        return cfg

    def summary(self) -> dict[str, Any]:
        """Plain facts for JSON output."""
        return {
            "name": self.name, "model_type": self.model_type, "num_params": self.num_params,
            "num_active_params": self.num_active_params, "num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token, "mla": self.is_mla, "exact": self.exact,
            "sliding_window_layers": self.num_sliding_layers,
            "sliding_window": sorted({w for w in self.layer_windows if w is not None}) or None,
        }


# ---- parsing ----------------------------------------------------------------------------------------------
def _get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def text_config_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs nest the language model under text_config."""
    if "hidden_size" not in cfg and "n_embd" not in cfg and isinstance(cfg.get("text_config"), dict):
        return {**cfg["text_config"], "architectures": cfg.get("architectures")}
    return cfg


def _require_int(cfg: dict[str, Any], name: str, *keys: str, default: Any = None) -> int:
    value = _get(cfg, *keys, default=default)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**31:
        shown = f"{value!r}" if len(repr(value)) < 40 else f"{repr(value)[:20]}… ({len(repr(value))} digits)"
        raise BadInputError(
            f"Model config for {name} has no valid {keys[0]} (got {shown}; a positive count below 2**31).",
            hint="Pass a Hugging Face config.json of a decoder-only LLM, or a preset (copt advise --list-presets).",
        )
    return value


def _spec_gpt2(cfg: dict[str, Any], name: str) -> ModelSpec:
    h = _require_int(cfg, name, "n_embd", "hidden_size")
    layers = _require_int(cfg, name, "n_layer", "num_hidden_layers")
    heads = _require_int(cfg, name, "n_head", "num_attention_heads")
    vocab = _require_int(cfg, name, "vocab_size")
    positions = _require_int(cfg, name, "n_positions", "max_position_embeddings", default=1024)
    inner = int(_get(cfg, "n_inner", default=None) or 4 * h)
    per_layer = (2 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (2 * h) + (h * inner + inner) + (inner * h + h)
    tied = bool(cfg.get("tie_word_embeddings", True))
    embed = vocab * h + positions * h
    total = embed + layers * per_layer + 2 * h + (0 if tied else vocab * h)
    return ModelSpec(name=name, model_type="gpt2", num_layers=layers, hidden_size=h, num_heads=heads,
                     num_kv_heads=heads, head_dim=h // heads, intermediate_size=inner, vocab_size=vocab,
                     tie_word_embeddings=tied, max_position_embeddings=positions, num_params=total,
                     num_active_params=total, embedding_params=embed, qkv_bias=True, v_head_dim=h // heads,
                     mlp_gated=False, norm_with_bias=True, torch_dtype=cfg.get("torch_dtype"), config=cfg)


def _spec_decoder(cfg: dict[str, Any], name: str) -> ModelSpec:
    mtype = str(cfg.get("model_type", "llama"))
    h = _require_int(cfg, name, "hidden_size")
    layers = _require_int(cfg, name, "num_hidden_layers")
    heads = _require_int(cfg, name, "num_attention_heads")
    vocab = _require_int(cfg, name, "vocab_size")
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    inter = int(_get(cfg, "intermediate_size", default=4 * h))
    tied = bool(cfg.get("tie_word_embeddings", mtype in TIED_BY_DEFAULT))
    max_pos = int(_get(cfg, "max_position_embeddings", default=4096))
    mla = mtype in MLA_FAMILIES or bool(cfg.get("kv_lora_rank"))

    # ---- attention ----
    q_lora = kv_lora = rope_dim = 0
    if mla:
        q_lora = int(cfg.get("q_lora_rank") or 0)
        kv_lora = int(cfg["kv_lora_rank"])
        nope = int(cfg["qk_nope_head_dim"])
        rope_dim = int(cfg["qk_rope_head_dim"])
        v_dim = int(cfg["v_head_dim"])
        head_dim = nope + rope_dim
        bias = bool(cfg.get("attention_bias", False))
        if q_lora:
            q_params = h * q_lora + (q_lora if bias else 0) + q_lora + q_lora * heads * head_dim
        else:
            q_params = h * heads * head_dim
        kv_params = (h * (kv_lora + rope_dim) + ((kv_lora + rope_dim) if bias else 0) + kv_lora
                     + kv_lora * heads * (nope + v_dim))
        o_params = heads * v_dim * h + (h if bias else 0)
        attn = q_params + kv_params + o_params
        kv_heads = heads
        qkv_bias = bias
    else:
        head_dim = int(_get(cfg, "head_dim", default=h // heads))
        v_dim = head_dim
        # Qwen2 and Qwen2-MoE: biases on q, k and v only (Qwen2-MoE's `qkv_bias`, on unless switched off)
        qkv_bias = (mtype == "qwen2" or (mtype == "qwen2_moe" and cfg.get("qkv_bias", True))
                    or bool(cfg.get("attention_bias", False)))
        o_bias = bool(cfg.get("attention_bias", False)) and mtype not in ("qwen2", "qwen2_moe")
        attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
        if qkv_bias:
            attn += heads * head_dim + 2 * kv_heads * head_dim
        if o_bias:
            attn += h
        if mtype in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"):  # per-head RMSNorm on q and k
            attn += 2 * head_dim if mtype != "olmo2" else heads * head_dim + kv_heads * head_dim

    mlp_bias = bool(cfg.get("mlp_bias", False))

    def gated(width: int) -> int:
        return 3 * h * width + ((2 * width + h) if mlp_bias else 0)

    # ---- MoE layout ----
    num_experts = int(_get(cfg, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0)
    top_k = int(_get(cfg, "num_experts_per_tok", default=0) or 0)
    moe_inter = shared_inter = 0
    router = 0
    moe_layers: list[bool] = [False] * layers
    if num_experts:
        moe_inter = int(_get(cfg, "moe_intermediate_size", default=inter))
        router = num_experts * h
        if mtype in MLA_FAMILIES:
            first_dense = int(cfg.get("first_k_dense_replace", 0))
            freq = int(cfg.get("moe_layer_freq", 1))
            moe_layers = [i >= first_dense and i % freq == 0 for i in range(layers)]
            shared_inter = moe_inter * int(cfg.get("n_shared_experts") or 0)
        elif mtype in ("qwen2_moe", "qwen3_moe"):
            step = int(cfg.get("decoder_sparse_step", 1))
            skip = set(cfg.get("mlp_only_layers") or [])
            moe_layers = [i not in skip and (i + 1) % step == 0 for i in range(layers)]
            shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
            if shared_inter:
                router += h  # shared_expert_gate: Linear(h, 1)
        else:  # mixtral: every layer sparse
            moe_inter = int(_get(cfg, "moe_intermediate_size", default=inter))
            moe_layers = [True] * layers
    n_moe = sum(moe_layers)

    norms = 4 * h if mtype in ("gemma2", "gemma3_text") else 2 * h  # Gemma-2/3: pre and post norms around both
    dense_layer = attn + gated(inter) + norms
    moe_total = attn + norms + router + num_experts * gated(moe_inter) + (gated(shared_inter) if shared_inter else 0)
    moe_active = attn + norms + router + top_k * gated(moe_inter) + (gated(shared_inter) if shared_inter else 0)

    embed = vocab * h
    outer = embed + h + (0 if tied else vocab * h)  # embeddings, final norm, lm_head
    total = outer + (layers - n_moe) * dense_layer + n_moe * moe_total
    active = outer + (layers - n_moe) * dense_layer + n_moe * moe_active

    exact = mtype in LLAMA_LIKE or mtype in MLA_FAMILIES
    windows = layer_windows(cfg, mtype, layers)
    sliding = next((w for w in windows if w is not None), None)
    return ModelSpec(
        name=name, model_type=mtype, num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=max_pos, num_params=total, num_active_params=active, embedding_params=embed,
        exact=exact, qkv_bias=qkv_bias, v_head_dim=v_dim, qk_rope_head_dim=rope_dim, kv_lora_rank=kv_lora,
        q_lora_rank=q_lora, sliding_window=sliding, layer_windows=tuple(windows) if sliding else (), mlp_gated=True,
        num_experts=num_experts, experts_per_token=top_k, moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter, num_moe_layers=n_moe, torch_dtype=cfg.get("torch_dtype",
                                                                                                 cfg.get("dtype")),
        config=cfg,
    )


# the hybrid pattern a family's config class fills in when config.json has no layer_types (transformers 5)
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3_text": 6, "cohere2": 4}


def layer_windows(cfg: dict[str, Any], mtype: str, layers: int) -> list[int | None]:
    """Per layer, the sliding window transformers' masks apply (None: full attention), from a config.json dict.

    `layer_types` when present; otherwise the family's rule: Gemma-2/3 (and Cohere2) alternate local and global
    layers by `sliding_window_pattern`, Qwen2/Qwen3 window the layers from `max_window_layers` on (only with
    `use_sliding_window`), Qwen2-MoE every other layer below `max_window_layers`; Mistral, Mixtral, Phi-3 and
    Qwen3-MoE window every layer."""
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return [None] * layers
    if "use_sliding_window" in cfg and not cfg.get("use_sliding_window"):
        return [None] * layers
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [window if t == "sliding_attention" else None for t in types]
    if mtype in _DEFAULT_PATTERN:
        pattern = int(cfg.get("sliding_window_pattern") or _DEFAULT_PATTERN[mtype])
        return [window if (i + 1) % pattern else None for i in range(layers)]
    if mtype in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", layers) or 0)
        return [window if i >= first else None for i in range(layers)]
    if mtype == "qwen2_moe":
        below = int(cfg.get("max_window_layers", layers) or 0)
        return [window if (i + 1) % 2 and i < below else None for i in range(layers)]
    return [window] * layers


def spec_from_config(config: dict[str, Any], name: str = "config") -> ModelSpec:
    """A ModelSpec from a config.json dict."""
    if not isinstance(config, dict):
        raise BadInputError(f"Model config {name} is not a JSON object.", hint="Pass a Hugging Face config.json.")
    cfg = text_config_of(copy.deepcopy(config))
    if str(cfg.get("model_type", "")) in GPT2_LIKE or ("n_embd" in cfg and "hidden_size" not in cfg):
        return _spec_gpt2(cfg, name)
    return _spec_decoder(cfg, name)


def _read_config(path: Path) -> dict[str, Any]:
    return read_config_json(path)


def read_config_json(path: Path, flag: str = "--model") -> dict[str, Any]:
    """A config.json as a dict; a file that is not UTF-8 JSON holding an object is a bad input (exit 2) named."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise BadInputError(f"Cannot read model config {path}: {exc.strerror}", hint=f"Check the {flag} path.") from exc
    except UnicodeDecodeError as exc:
        raise BadInputError(f"Model config {path} is not UTF-8 text (byte {exc.start} is not valid UTF-8).",
                            hint="config.json must be the JSON file save_pretrained writes; restore it from the "
                                 "model's source.") from None
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON, a number too long, nested too deep
        why = exc if isinstance(exc, json.JSONDecodeError) else (
            "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:160])
        raise BadInputError(f"Model config {path} is not valid JSON: {why}",
                            hint="config.json must be the JSON file save_pretrained writes; restore it from the "
                                 "model's source.") from None
    if not isinstance(config, dict):
        raise BadInputError(f"Model config {path} is not a JSON object (it is a {type(config).__name__}).",
                            hint="config.json must hold one JSON object of the model's settings.")
    return config


def refuse_config_file(path: str | Path | None, flag: str) -> None:
    """Where a model directory is wanted (serve, quantize, distill's teacher and on-policy student), a path to a file
    in one (its config.json) is refused naming the directory to pass instead."""
    if not path:
        return
    p = Path(path).expanduser()
    if p.is_file() and (p.name == "config.json" or (p.parent / "config.json").is_file()):
        what = "its config.json" if p.name == "config.json" else p.name
        raise BadInputError(f"{flag} {path} is a file in a model directory ({what}); {flag} takes the directory.",
                            hint=f"Pass the directory instead: {p.parent}")


# the files AutoTokenizer.from_pretrained reads a tokenizer from (one of them is enough): what save_pretrained writes,
# and the vocabulary files of tokenizers saved without tokenizer_config.json (their class comes from config.json):
# WordPiece's vocab.txt, SentencePiece's spiece.model and sentencepiece.bpe.model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def has_tokenizer_files(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES)


def tokenizer_code_problem(directory: Path) -> str | None:
    """Why transformers would have to run Python code shipped in `directory` to load its tokenizer (None when it
    would not): tokenizer_config.json maps AutoTokenizer to the directory's own code (auto_map) and names no class
    transformers has. transformers then asks on the terminal whether to run that code (and refuses where nobody can
    answer); copt never runs it (trust_remote_code stays off)."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return None  # absent or unreadable: check_model_files names an unreadable one
    if not isinstance(config, dict):
        return None
    auto_map = config.get("auto_map")
    if not (isinstance(auto_map, (list, tuple)) or (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map)):
        return None
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = config.get("tokenizer_class")
    if isinstance(name, str) and name and tokenizer_class_from_name(name) is not None:
        return None  # transformers' own class: it loads without the shipped code
    lacks = (f"transformers has no tokenizer class '{name}'" if isinstance(name, str) and name
             else "it names no tokenizer_class")
    return (f"tokenizer_config.json maps AutoTokenizer to Python code shipped in the directory (auto_map) and {lacks}; "
            "copt does not run code from model directories (trust_remote_code is off)")


TOKENIZER_CODE_HINT = ("Save the tokenizer as a class transformers implements into the directory (e.g. load it once "
                       "where you trust its code and save_pretrained a PreTrainedTokenizerFast built from its "
                       "tokenizer.json).")


def tokenizer_dir_problem(path: str | Path, flag: str = "--tokenizer") -> str | None:
    """Why `path` is not a local tokenizer directory (None when it has tokenizer files): it is missing, not a
    directory, or holds none of TOKENIZER_FILES (transformers' own error then reads like a broken model)."""
    p = Path(path).expanduser()
    if not p.exists():
        return f"{flag} {path}: no such directory (a local tokenizer directory; copt never downloads)"
    if not p.is_dir():
        return f"{flag} {path} is not a directory (pass the directory that holds the tokenizer files)"
    if not has_tokenizer_files(p):
        return (f"{flag} {path} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); pass the model "
                "directory save_pretrained wrote the tokenizer into")
    if (problem := json_files_problem(p) or tokenizer_code_problem(p)) is not None:
        return f"{flag} {path}: {problem}"
    return None


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
CONVERT_HINT = ("python -c \"from transformers import AutoModelForCausalLM as M; "
                "M.from_pretrained('{src}').save_pretrained('{src}-safetensors')\"")


MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on the header


# the JSON files a model or tokenizer load reads beside the weights (transformers' own JSONDecodeError surfaced as
# an internal error, the file unnamed)
LOAD_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "generation_config.json")


def json_files_problem(directory: Path) -> str | None:
    """The first of LOAD_JSON_FILES in `directory` that is not a regular file of valid JSON (None when all are)."""
    for name in LOAD_JSON_FILES:
        path = directory / name
        if not os.path.lexists(path):
            continue
        try:
            if not path.is_file():
                raise ValueError("not a regular file")
            json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            return f"{name} is not valid JSON ({str(exc)[:160]})"
    return None


def check_model_files(model_dir: Path, flag: str = "--model") -> None:
    """The files a load reads first, checked without loading anything: every *.safetensors is a regular file whose
    header parses (a truncated copy or a download cut short fails here, not minutes into a run), and the JSON
    files a load reads (LOAD_JSON_FILES: the tokenizer's, the generation defaults) parse."""
    import struct

    where = f"{flag} {model_dir}"
    hint = "Restore the file from the model's source (a copy or a download was cut short?)."
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        if not path.is_file():
            raise BadInputError(f"{where}: {path.name} is not a regular file (a pipe, a device or a broken link).",
                                hint=hint)
        try:
            with path.open("rb") as handle:
                head = handle.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < length <= min(MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
                    raise ValueError(f"header length {length} in a file of {path.stat().st_size:,} bytes")
                header = json.loads(handle.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (OSError, ValueError, RecursionError) as exc:
            raise BadInputError(f"{where}: {path.name} is not a readable safetensors file ({str(exc)[:160]}).",
                                hint=hint) from None
    if (problem := json_files_problem(Path(model_dir))) is not None:
        raise BadInputError(f"{where}: {problem}.", hint=hint)


def check_loadable_model(model_dir: Path | None, config: dict[str, Any], flag: str = "--model",
                         need_weights: bool = True, tokenizer: bool = False) -> None:
    """What transformers would fail on (or run) when loading this model, as exit-2 errors naming the file and the
    fix: an architecture transformers does not implement (custom code: copt never sets trust_remote_code), and
    weights only in pickle files (copt loads safetensors only: a pickle can run code); with `tokenizer` (a command
    that loads the directory's tokenizer), a tokenizer only its own shipped code implements."""
    where = f"{flag} {model_dir}" if model_dir is not None else flag
    model_type = config.get("model_type")
    text_type = (config.get("text_config") or {}).get("model_type") if isinstance(config.get("text_config"),
                                                                                  dict) else None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES and text_type not in CONFIG_MAPPING_NAMES:
        if config.get("auto_map"):
            raise BadInputError(
                f"{where}: model_type '{model_type}' needs the Python code shipped with the model (config.json has "
                "auto_map); copt does not run code from model directories (trust_remote_code is off).",
                hint="Use a version of the model in an architecture transformers implements (many custom models "
                     "have one; e.g. convert it with the model's own conversion script), then pass that directory.")
        raise BadInputError(
            f"{where}: unknown model_type '{model_type}' in config.json (this transformers does not implement it).",
            hint="Check config.json's model_type (e.g. llama, qwen2, mistral), or upgrade transformers if the "
                 "architecture is newer than it.")
    if model_dir is None or not Path(model_dir).is_dir():
        return
    check_model_files(Path(model_dir), flag)
    if tokenizer and (problem := tokenizer_code_problem(Path(model_dir))) is not None:  # the command loads it
        raise BadInputError(f"{where}: {problem}.", hint=TOKENIZER_CODE_HINT)
    if not need_weights:
        return
    directory = Path(model_dir)
    if any(directory.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in directory.glob(pattern))
    if pickles:
        raise BadInputError(
            f"{where} has its weights only as pickle files ({', '.join(pickles[:3])}); copt loads safetensors "
            "only (unpickling a file can run code).",
            hint="Convert it once, where you trust the file: " + CONVERT_HINT.format(src=directory) +
                 " and pass the new directory.")


def load_model_spec(source: str | Path | dict[str, Any]) -> ModelSpec:
    """A preset name, a model directory, a config.json path or a config dict → ModelSpec (no weights loaded)."""
    if isinstance(source, dict):
        return spec_from_config(source, str(source.get("_name_or_path") or source.get("model_type") or "config"))
    text = str(source)
    preset = PRESET_DIR / f"{text.lower()}.json"
    if preset.is_file() and not Path(text).exists():
        return spec_from_config(_read_config(preset), text.lower())
    path = Path(text).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise BadInputError(f"Model directory {path} has no config.json.",
                                hint="Pass a Hugging Face model directory, a config.json or a preset name.")
        return spec_from_config(_read_config(config), path.name)
    if path.is_file():
        return spec_from_config(_read_config(path), path.parent.name if path.name == "config.json" else path.stem)
    raise BadInputError(
        f"Model '{text}' is neither a preset nor a config.json file or model directory.",
        hint=f"Presets: {', '.join(list_presets())}",
    )
