"""Structured output for copt serve's engine: `response_format` (JSON object / JSON schema) and `tools` with
`tool_choice`, by constrained decoding with xgrammar.

A constrained request carries a compiled grammar (`Grammar`); the engine gives each of its sequences a matcher.
Before a constrained row is sampled, the matcher's token bitmask is applied to its logits row on the device (the
other rows are untouched), and every token the sequence keeps is accepted into its matcher; the request stops when
the grammar terminates (the grammar's end is followed by the stop token, the only token then allowed).

JSON is generated compact (no free whitespace between tokens: a model cannot stall in whitespace).

Tool calls (`parse_tool_calls`) are read from the generated text in these formats:
- Hermes / Qwen style: one or more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
- a bare JSON object `{"name": ..., "arguments"|"parameters": {...}}` (Llama 3.x style), or a JSON array of them
  (the shape `tool_choice: "required"` constrains the output to);
- with a named `tool_choice`, the output is the function's arguments object itself.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from clusteropt_cli.errors import BadInputError

MAX_SCHEMA_CHARS = 64 * 1024


class StructuredOutputError(BadInputError):
    """A response_format / tools field the grammar library cannot take; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message, hint=f"Fix '{param}' in the request.")
        self.param = param


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar; each constrained sequence gets its own matcher."""

    compiled: Any  # xgrammar.CompiledGrammar
    kind: str  # "json_object" | "json_schema" | "tools"

    def matcher(self) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


class GrammarCompiler:
    """Compiles grammars for one tokenizer (built on first use; compiled grammars are cached by xgrammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int] | list[int]):
        self._tokenizer, self._vocab, self._stop = tokenizer, int(vocab_size), sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as exc:
                    raise BadInputError("Structured output needs xgrammar (pip install 'clusteropt-cli[serve]').",
                                        hint="Install xgrammar or drop response_format / tools.") from exc
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab,
                                                          stop_token_ids=self._stop or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def json_schema(self, schema: Any, param: str, kind: str = "json_schema") -> Grammar:
        if not isinstance(schema, dict):
            raise StructuredOutputError("The JSON schema must be an object.", param)
        text = json.dumps(schema)
        if len(text) > MAX_SCHEMA_CHARS:
            raise StructuredOutputError(f"The JSON schema is over {MAX_SCHEMA_CHARS} characters.", param)
        try:
            import jsonschema

            jsonschema.validators.validator_for(schema).check_schema(schema)
        except ImportError:
            pass
        except Exception as exc:  # noqa: BLE001 - jsonschema.SchemaError and friends: the client's schema
            raise StructuredOutputError(f"Invalid JSON schema: {getattr(exc, 'message', exc)}", param) from None
        compiler = self._get()
        try:
            compiled = compiler.compile_json_schema(text, any_whitespace=False)
        except Exception as exc:  # noqa: BLE001 - xgrammar refuses the schema
            raise StructuredOutputError(f"Cannot compile the JSON schema: {exc}", param) from None
        return Grammar(compiled, kind)

    def json_object(self) -> Grammar:
        return self.json_schema({"type": "object"}, "response_format", kind="json_object")


def response_format_grammar(response_format: Any, compiler: GrammarCompiler) -> Grammar | None:
    """The grammar of an OpenAI `response_format` (None for plain text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise StructuredOutputError("response_format must be an object.", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return compiler.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise StructuredOutputError("response_format.json_schema must be an object with a 'schema'.",
                                        "response_format.json_schema")
        return compiler.json_schema(spec["schema"], "response_format.json_schema.schema")
    raise StructuredOutputError(f"response_format type {kind!r} is not one of text, json_object, json_schema.",
                                "response_format.type")


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The function definitions of `tools`, and the mode of `tool_choice`: None ("none"), "auto", "required" or
    the name of the function to call. Raises StructuredOutputError for malformed ones."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise StructuredOutputError("tool_choice needs tools.", "tool_choice")
        return [], None
    if not isinstance(tools, list):
        raise StructuredOutputError("tools must be a list.", "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise StructuredOutputError("Each tool is {'type': 'function', 'function': {'name': ..., ...}}.",
                                        f"tools[{i}]")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise StructuredOutputError("A function's parameters must be a JSON schema object.",
                                        f"tools[{i}].function.parameters")
        functions.append({**fn, "parameters": params})
    if tool_choice is None or tool_choice == "auto":
        return functions, "auto"
    if tool_choice == "none":
        return functions, None
    if tool_choice == "required":
        return functions, "required"
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise StructuredOutputError("tool_choice is 'none', 'auto', 'required' or "
                                    "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
    if name not in {f["name"] for f in functions}:
        raise StructuredOutputError(f"tool_choice names {name!r}, which is not in tools.", "tool_choice")
    return functions, name


def tool_grammar(functions: list[dict[str, Any]], mode: str | None, compiler: GrammarCompiler,
                 parallel: bool = True) -> Grammar | None:
    """The grammar tool_choice asks for: "required" → a JSON array of one or more {"name", "parameters"} calls
    (exactly one when `parallel` is False: OpenAI's parallel_tool_calls); a named function → its arguments object;
    "auto" / "none" → unconstrained."""
    if mode in (None, "auto"):
        return None
    if mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        for i, f in enumerate(functions):  # each function's schema alone first: the error names the tool
            _check_schema(f["parameters"], f"tools[{i}].function.parameters")
        return compiler.json_schema(schema, "tools", kind="tools")
    i, fn = next((i, f) for i, f in enumerate(functions) if f["name"] == mode)
    return compiler.json_schema(fn["parameters"], f"tools[{i}].function.parameters", kind="tools")


def _check_schema(schema: dict[str, Any], param: str) -> None:
    try:
        import jsonschema

        jsonschema.validators.validator_for(schema).check_schema(schema)
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001
        raise StructuredOutputError(f"Invalid JSON schema: {getattr(exc, 'message', exc)}", param) from None


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _from_obj(obj: Any) -> list[dict[str, Any]] | None:
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or "name" not in item:
            return None
        call = _call(item["name"], item.get("arguments", item.get("parameters")))
        if call is None:
            return None
        calls.append(call)
    return calls or None


def parse_tool_calls(text: str, mode: str | None, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a generated `text` under tool_choice `mode` (see the module's docstring). Calls of
    functions not in `names` are not tool calls: the text stays content."""
    if mode is None:
        return text, []
    if mode not in ("auto", "required"):  # a named function: the text is its arguments
        call = _call(mode, text)
        return (None, [call]) if call is not None else (text, [])
    if "<tool_call>" in text:
        calls, rest, pos = [], [], 0
        while (start := text.find("<tool_call>", pos)) >= 0:
            rest.append(text[pos:start])
            end = text.find("</tool_call>", start)
            body = text[start + len("<tool_call>") : end if end >= 0 else len(text)]
            try:
                found = _from_obj(json.loads(body))
            except ValueError:
                found = None
            if not found or any(c["function"]["name"] not in names for c in found):
                return text, []
            calls.extend(found)
            pos = len(text) if end < 0 else end + len("</tool_call>")
        rest.append(text[pos:])
        content = "".join(rest).strip()
        return content or None, calls
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            found = _from_obj(json.loads(stripped))
        except ValueError:
            found = None
        if found and all(c["function"]["name"] in names for c in found):
            return None, found
    return text, []


def apply_grammar_masks(logits: Any, rows: list[int], matchers: list[Any]) -> None:
    """Mask, in place and on the logits' device, the rows `rows` of `logits` [B, V] to the tokens their matchers
    allow: the matchers fill a packed int32 bitmask on the host (one H2D copy for all rows), unpacked on the
    device to a [n, V] bool mask (little-endian bytes: token i is bit i % 8 of byte i // 8)."""
    import torch
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, i)
    packed = bitmask.to(logits.device, non_blocking=True).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    blocked = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)[:, :vocab] == 0
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(blocked, float("-inf")))
