"""OpenAI-compatible request bodies. Unknown fields (vLLM/benchmark extras) are tolerated, typed fields are checked,
and a field the server cannot honour is refused by name (`UNSUPPORTED_FIELDS`), never silently ignored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM clients sometimes send more
MAX_STOP_CHARS = 256  # characters per stop string
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
MAX_N = 64  # choices per prompt
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes

NonNegativeInt = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    # vLLM extras that benchmark clients send
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[NonNegativeInt] | None = None
    # sampling options (vLLM's SamplingParams; chosen on the device per request)
    top_k: int | None = Field(None, ge=-1)  # -1 / 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) → bias in [-100, 100]
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM extra

    @field_validator("n")
    @classmethod
    def _n_cap(cls, value: int) -> int:
        if value > MAX_N:
            raise ValueError(f"at most {MAX_N} choices")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            digits = key.strip()
            if not (digits.isascii() and digits.isdigit() and len(digits) <= 12):  # "²" is a digit to str.isdigit
                raise ValueError(f"keys are token ids, not {key[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError("biases are in [-100, 100]")
        return value

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None

    def continuous_usage(self) -> bool:
        return bool((self.stream_options or {}).get("continuous_usage_stats"))

    @field_validator("stop")
    @classmethod
    def _stop_caps(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


MAX_PROMPTS = 1024  # prompts in one completions request (copt serve's queue holds --max-queue, 1,024, waiting)
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _is_id(value: Any) -> bool:
    return type(value) is int  # not bool: JSON true is no token id


def _all_ids(values: list) -> bool:
    """Every item an int (not a bool), checked at C speed: no Python call per item of a million-id prompt."""
    return set(map(type, values)) <= {int}


def prompt_shape(value: Any) -> Any:
    """A completions prompt as OpenAI takes it — text, texts, token ids, or lists of token ids — checked in one pass
    that stops at the first misfit (pydantic's union of list types validated every element against each member and
    collected an error per element: seconds for a body of millions of ids, the event loop waiting on the GIL)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"the prompt is {PROMPT_SHAPES}, not empty")
    first = value[0]
    if _is_id(first):
        if not _all_ids(value):
            raise ValueError(f"the prompt is {PROMPT_SHAPES}: a list of token ids holds integers only")
        return value
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
    if isinstance(first, str):
        if not all(isinstance(t, str) for t in value):
            raise ValueError(f"the prompt is {PROMPT_SHAPES}: a list of strings holds strings only")
        return value
    if isinstance(first, list):
        if not all(isinstance(p, list) and _all_ids(p) for p in value):
            raise ValueError(f"the prompt is {PROMPT_SHAPES}: a list of lists holds lists of integers only")
        return value
    raise ValueError(f"the prompt is {PROMPT_SHAPES}")


class CompletionBody(_Body):
    prompt: Annotated[Any, BeforeValidator(prompt_shape)]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: prompt logprobs alone (lm-eval's loglikelihood)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # text prompts are encoded with the tokenizer's special tokens (its BOS where the tokenizer adds one), as HF's
    # tokenizer(...) and vLLM's completions endpoint do; token-id prompts are taken as sent
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in value if isinstance(value, list) else []:
            if part.get("type", "text") == "text" and not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs its text as a string")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type", "text") == "text")


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # the chat template writes its own BOS: special tokens on top of it only when asked (vLLM's default too)
    add_special_tokens: bool = False


def _unset(*defaults: Any) -> Callable[[Any, Any], bool]:
    """Honourable when the field is absent or has one of `defaults` (the value that changes nothing)."""
    return lambda value, body: value is None or any(
        value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


# Request fields the server cannot honour yet: field -> whether the value sent can be served as is. A request with
# any other value gets 400 naming the field (never silently ignored). Remove a row when the feature lands.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any, Any], bool]] = {
    "best_of": lambda v, b: v is None or v == b.n,  # best_of > n would rank choices: not implemented
    "echo": lambda v, b: not v or not b.stream,  # echo works without streaming
    "prompt_logprobs": lambda v, b: v is None or not b.stream,  # answered in non-streamed responses
    "suffix": lambda v, b: not v,
    "tools": lambda v, b: not v or isinstance(b, ChatBody),  # tools with tool_choice: chat completions only
    "tool_choice": lambda v, b: v is None or v in ("none", "auto") or isinstance(b, ChatBody),
    "functions": lambda v, b: not v,
    "function_call": _unset("none", "auto"),
    "use_beam_search": lambda v, b: not v,
    "length_penalty": _unset(1, 1.0),
    "include_stop_str_in_output": lambda v, b: not v,
    "skip_special_tokens": _unset(True),
    "allowed_token_ids": _unset(),
    "bad_words": lambda v, b: not v,
    "truncate_prompt_tokens": _unset(),
    "guided_json": _unset(),
    "guided_regex": _unset(),
    "guided_choice": _unset(),
    "guided_grammar": _unset(),
    "structured_outputs": _unset(),
    "prompt_embeds": _unset(),
    "audio": _unset(),
    "modalities": lambda v, b: v is None or v == ["text"],
    "prediction": _unset(),
    "continue_final_message": _unset(False),  # the template closes the last message: nothing would be continued
    "return_tokens_as_token_ids": _unset(False),
    # vLLM and OpenAI refuse top_logprobs without logprobs: true rather than answer without them
    "top_logprobs": lambda v, b: not v or bool(getattr(b, "logprobs", None)),
}


def unsupported_field(body: BaseModel) -> str | None:
    """The first field of `body` the server cannot honour, or None."""
    extra = body.model_extra or {}
    for name, honourable in UNSUPPORTED_FIELDS.items():
        if name in extra:
            value = extra[name]
        elif name in type(body).model_fields:
            value = getattr(body, name)
        else:
            continue
        if not honourable(value, body):
            return name
    if isinstance(body, ChatBody):
        for i, message in enumerate(body.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.get("type", "text") != "text":
                    return f"messages[{i}].content[{j}].type"
    return None


def openai_error(message: str, status: int, err_type: str | None = None, param: str | None = None,
                 code: str | int | None = None) -> dict[str, Any]:
    """An error body in OpenAI's shape."""
    default_type = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                    503: "service_unavailable"}
    return {"error": {"message": message, "type": err_type or default_type.get(status, "server_error"),
                      "param": param, "code": code if code is not None else status}}
