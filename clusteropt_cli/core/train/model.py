"""Load what `copt train` trains: a local HF model directory (fine-tune) or a config.json / preset (from scratch
with random weights), plus its tokenizer. Never downloads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError


@dataclass
class ModelSource:
    kind: str  # "pretrained" | "config" | "preset"
    path: Path | None
    config: dict[str, Any]
    tokenizer_path: Path | None


def resolve_model_source(model: str, tokenizer: str | None = None, flag: str = "--model") -> ModelSource:
    """Classify --model without loading weights: a model dir, a config.json (or a dir with only a config) or a
    preset name known to clusteropt_cli.modelspec. Configs that are not JSON objects, architectures transformers
    does not implement (custom code) and pickle-only weights are refused (exit 2)."""
    from clusteropt_cli.modelspec import PICKLE_WEIGHTS, check_loadable_model, read_config_json

    path = Path(model)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise BadInputError(f"--model {model} is a directory without config.json.",
                                hint="pass a Hugging Face model directory, a config.json or a preset name")
        has_weights = any(path.glob("*.safetensors")) or any(p for g in PICKLE_WEIGHTS for p in path.glob(g))
        config = read_config_json(config_file, flag)
        check_loadable_model(path, config, flag, need_weights=has_weights)
        tok = Path(tokenizer) if tokenizer else (path if (path / "tokenizer_config.json").exists() else None)
        return ModelSource("pretrained" if has_weights else "config", path, config, tok)
    if path.is_file():
        config = read_config_json(path, flag)
        check_loadable_model(None, config, f"{flag} {model}")
        near = path.parent if (path.parent / "tokenizer_config.json").exists() else None
        return ModelSource("config", path, config, Path(tokenizer) if tokenizer else near)
    try:
        from clusteropt_cli.modelspec import load_model_spec
    except ImportError:
        load_model_spec = None
    if load_model_spec is not None and not any(c in model for c in "/\\"):
        try:
            spec = load_model_spec(model)
        except Exception as exc:  # noqa: BLE001 - an unknown preset is a bad input
            raise BadInputError(f"--model {model}: no such directory, config file or preset ({exc}).",
                                hint="pass a local HF model directory, a config.json or a preset name") from None
        return ModelSource("preset", None, spec.to_hf_config(), Path(tokenizer) if tokenizer else None)
    raise BadInputError(f"--model {model}: no such file or directory (and not a preset).",
                        hint="pass a local Hugging Face model directory or a config.json (copt never downloads)")


def load_tokenizer(source: ModelSource) -> Any:
    if source.tokenizer_path is None:
        raise BadInputError("Training from a config needs a tokenizer to read the data.",
                            hint="pass --tokenizer DIR (a local tokenizer directory)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.tokenizer_path))
    check_tokenizer_fits(tokenizer, source.config, source.tokenizer_path)
    return tokenizer


def check_tokenizer_fits(tokenizer: Any, config: dict[str, Any], where: Any,
                         hint: str = "Pass the model's own tokenizer (--tokenizer), or a config whose vocab_size "
                                     "covers it.") -> None:
    """Refuse a tokenizer with more tokens than the model's embedding (config.json's vocab_size): its ids past the
    embedding fail with an IndexError only after the data and the model loaded."""
    from clusteropt_cli.modelspec import text_config_of

    vocab = text_config_of(config).get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise BadInputError(f"The tokenizer at {where} has {len(tokenizer):,} tokens; the model's embedding has "
                            f"{vocab:,} (vocab_size).", hint=hint)


def load_model(source: ModelSource, seed: int = 0, *, dtype: Any = None, device: Any = "cpu",
               attn: str | None = None) -> Any:
    """from_pretrained (fp32 weights by default: mixed precision autocasts) or from_config with seeded random
    weights, built directly on `device` — or, while a ZeRO-3 HfDeepSpeedConfig is alive (engines.zero3_model_init),
    partitioned by deepspeed.zero.Init where DeepSpeed places the partitions."""
    import contextlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    dtype = torch.float32 if dtype is None else dtype
    extra = {"attn_implementation": attn} if attn else {}
    partitioned = is_deepspeed_zero3_enabled()
    if source.kind == "pretrained":
        from clusteropt_cli.core.models import pretrained_causal_lm

        model = pretrained_causal_lm(source.path, "--model", dtype=dtype, **extra)
        return model if partitioned else model.to(device)
    config_dict = dict(source.config)
    model_type = config_dict.pop("model_type", None)
    if model_type is None:
        raise BadInputError("The model config has no model_type.", hint="add \"model_type\": \"llama\" (or similar)")
    for key in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
        config_dict.pop(key, None)  # describe a saved checkpoint, not the architecture
    config = AutoConfig.for_model(model_type, **config_dict)
    torch.manual_seed(seed)
    with contextlib.nullcontext() if partitioned else torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
