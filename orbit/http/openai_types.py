"""OpenAI request models, their validation into engine inputs, and OpenAI-shaped response dicts.

Unknown request fields are ignored, as OpenAI does. Fields that would change the output in ways
Orbit does not implement (echo, suffix, best_of, penalties, logit_bias) are refused with a 400
rather than silently ignored. `response_format` is checked in orbit/http/structured.py, `tools`
and `tool_choice` in orbit/http/tool_calls.py. /v1/completions takes a batch of prompts (a list
of strings or of token-id lists): each prompt's n choices are indexed prompt_i * n + j, as
OpenAI does, and usage counts every prompt.

Validation knows the wire. Each numeric field has `Bounds`: what its protobuf and kernel types
carry (top_k is a uint32, temperature and top_p float32, the seed 64 bits, logprobs int32) cut
to what means something (temperature stops at 100, where usual logits draw almost uniformly). The
checks here use them, and /openapi.json publishes them (`openapi_body`, which also fills in the
served model's name, context length and vocabulary), so a client or fuzzer that follows the
schema reaches the model. Every value inside the bounds is safe to sample with
(runtime/sampling.py). Text must be valid Unicode: a lone UTF-16 surrogate, which JSON can
escape but UTF-8 cannot encode, is refused wherever it appears.
"""

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from orbit.http.core_client import SamplingParams
from orbit.http.errors import (
    BadRequest,
    context_length_error,
    from_validation_error,
    max_tokens_error,
)
from orbit.http.textstream import TokenTexts
from orbit.http.tool_calls import template_uses_tools, tools_system_prompt

MAX_CHOICES = 16
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request
MAX_BATCH_CHOICES = 64  # their choices, prompts x n
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
# Chat messages plus their content parts. Validating one holds the GIL, and so the event loop,
# for about 25 us: 4096 of them about 0.1 s.
MAX_MESSAGES = 4096
MAX_TEMPERATURE = 100.0
_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1
_INT64_MIN = -(2**63)
# JSON has no infinities; vLLM reports an impossible token's logprob as this instead.
_MIN_LOGPROB = -9999.0
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class Bounds:
    """The accepted range of a numeric request field: checked by check_*, published in the
    OpenAPI schema."""

    low: int | float
    high: int | float
    low_open: bool = False  # excludes low
    high_open: bool = False  # excludes high

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{_show(self.low)}, {_show(self.high)}{right}"

    def schema(self, json_type: str) -> dict:
        low_key = "exclusiveMinimum" if self.low_open else "minimum"
        high_key = "exclusiveMaximum" if self.high_open else "maximum"
        return {"type": json_type, low_key: self.low, high_key: self.high}


def _show(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


# float32 on the wire; below runtime.sampling.GREEDY_BELOW_TEMPERATURE (1e-5) it is greedy.
TEMPERATURE = Bounds(0.0, MAX_TEMPERATURE)
# float32 on the wire; the most likely token always stays, so even one rounding to 0 is safe.
TOP_P = Bounds(0.0, 1.0, low_open=True)
TOP_K = Bounds(0, _UINT32_MAX)  # uint32 on the wire; 0, or at least the vocabulary, is off
# OpenAI's int64; the ranks take its 64 bits as unsigned. Bounds a double holds exactly: the
# OpenAPI document carries numbers as doubles, and 2**63 - 1 is not one.
SEED = Bounds(-(2**63), 2**63, high_open=True)
CHOICES = Bounds(1, MAX_CHOICES)
LOGPROBS = Bounds(0, MAX_LOGPROBS)  # int32 on the wire
MAX_TOKENS = Bounds(1, _INT32_MAX)  # the served schema narrows it to the context length
BEST_OF = Bounds(1, 1)  # only 1: use n
ONLY_ZERO = Bounds(0.0, 0.0)  # penalties are not implemented

# Schema nodes the served app fills in (openapi_body): this key names the value to put there.
_FILL = "x-orbit-fill"
_TOKEN_IDS_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, _FILL: "token_id"},
    _FILL: "prompt_tokens",
}
_TEXT_SCHEMA = {"type": "string", "minLength": 1}
_STOP_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}

# Request field types: validated as their base type, published with their bounds.
ModelName = Annotated[str, WithJsonSchema({"type": "string", _FILL: "model"})]
Temperature = Annotated[float, WithJsonSchema(TEMPERATURE.schema("number"))]
TopP = Annotated[float, WithJsonSchema(TOP_P.schema("number"))]
TopK = Annotated[int, WithJsonSchema(TOP_K.schema("integer"))]
Seed = Annotated[int, WithJsonSchema(SEED.schema("integer"))]
Choices = Annotated[int, WithJsonSchema(CHOICES.schema("integer"))]
Logprobs = Annotated[int, WithJsonSchema(LOGPROBS.schema("integer"))]
MaxTokens = Annotated[int, WithJsonSchema({**MAX_TOKENS.schema("integer"), _FILL: "max_tokens"})]
Penalty = Annotated[float, WithJsonSchema(ONLY_ZERO.schema("number"))]
BestOf = Annotated[int, WithJsonSchema(BEST_OF.schema("integer"))]
StopString = Annotated[str, WithJsonSchema(_STOP_SCHEMA)]
StopList = Annotated[
    list[str],
    WithJsonSchema({"type": "array", "items": _STOP_SCHEMA, "maxItems": MAX_STOP_STRINGS}),
]
PromptText = Annotated[str, WithJsonSchema(_TEXT_SCHEMA)]
PromptTexts = Annotated[
    list[str],
    WithJsonSchema(
        {"type": "array", "items": _TEXT_SCHEMA, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS}
    ),
]
TokenIds = Annotated[list[int], WithJsonSchema(_TOKEN_IDS_SCHEMA)]
TokenIdLists = Annotated[
    list[list[int]],
    WithJsonSchema(
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS}
    ),
]
NoLogitBias = Annotated[dict[str, float], WithJsonSchema({"type": "object", "maxProperties": 0})]
# Checked field by field in structured.py and tool_calls.py, where a 400 can name the part.
Tools = Annotated[list, WithJsonSchema({"type": "array", "items": {"type": "object"}})]
ToolChoice = Annotated[
    str | dict,
    WithJsonSchema({"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]}),
]
ResponseFormat = Annotated[
    dict,
    WithJsonSchema(
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
        }
    ),
]
Off = Annotated[bool, WithJsonSchema({"type": "boolean", "enum": [False]})]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: ModelName | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extension: 0 disables
    seed: Seed | None = None
    stop: StopString | StopList | None = None
    n: Choices | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: NoLogitBias | None = None
    ignore_eos: bool | None = False  # extension, for benchmarks
    response_format: ResponseFormat | None = None  # on /v1/completions an extension

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: PromptText | PromptTexts | TokenIds | TokenIdLists
    max_tokens: MaxTokens | None = None
    logprobs: Logprobs | None = None
    echo: Off | None = False
    suffix: Annotated[str | None, WithJsonSchema({"type": "null"})] = None
    best_of: BestOf | None = None

    prompt_param: ClassVar[str] = "prompt"

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["type", "text"]})
    type: Annotated[str, WithJsonSchema({"type": "string", "enum": ["text"]})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Annotated[str, WithJsonSchema({"type": "string", "enum": list(CHAT_ROLES)})]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, for the template
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):  # text parts joined by newlines, as vLLM does
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1, "maxItems": MAX_MESSAGES})
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    prompt_param: ClassVar[str] = "messages"

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        # OpenAI's "developer" role is its newer name for "system"; templates know only the latter.
        roles = {"developer": "system"}
        out = []
        for m in self.messages:
            message = {"role": roles.get(m.role, m.role), "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out


def _template_call(call: dict) -> dict:
    """An earlier tool call as templates read it: arguments as an object (Llama 3 and Qwen
    templates write them with tojson)."""
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


RequestModel = TypeVar("RequestModel", CompletionRequest, ChatCompletionRequest)


def parse_request(
    raw: bytes, model_cls: type[RequestModel], limits: "PromptLimits"
) -> RequestModel:
    """A request body as `model_cls`; any malformed input is a 400, never a 422 or a 500."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError covers bad UTF-8 too
        raise BadRequest("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    _check_unicode(raw, body)
    _check_sizes(body, limits)
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# Only a \uXXXX escape can put a surrogate into a parsed string (raw UTF-8 cannot hold one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_TEXT = "contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not valid Unicode"


def _check_unicode(raw: bytes, body: dict) -> None:
    """Refuse a lone surrogate in any string of the body, key or value, naming where: the
    tokenizer, the chat template and the response encoder all fail on one."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, str) and _SURROGATE.search(node):
            raise BadRequest(f"'{path}' {_NOT_TEXT}.", param=path)
        if isinstance(node, list):
            todo.extend((f"{path}[{i}]", value) for i, value in enumerate(node))
        elif isinstance(node, dict):
            for key, value in node.items():
                if _SURROGATE.search(key):
                    where = f"'{path}'" if path else "the request body"
                    raise BadRequest(f"A field name in {where} {_NOT_TEXT}.", param=path or None)
                todo.append((f"{path}.{key}" if path else key, value))


def _check_sizes(body: dict, limits: "PromptLimits") -> None:
    """Bounds on how many items the lists of a body hold, checked before validation: pydantic
    holds the GIL throughout, and 8 MiB of chat messages would stall the event loop for
    seconds."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        count = len(messages) + sum(len(p) for p in parts if isinstance(p, list))
        msg = f"messages may hold at most {MAX_MESSAGES} messages and content parts, got {count}."
        _require(count <= MAX_MESSAGES, msg, "messages")
    stop = body.get("stop")
    if isinstance(stop, list):
        _check_stop_count(len(stop))
    _require(not body.get("logit_bias"), "logit_bias is not supported.", "logit_bias")
    prompt = body.get("prompt")
    batch = [prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check_batch_size(len(prompt))
        batch = prompt
    for prompt in batch:
        if isinstance(prompt, list) and len(prompt) >= limits.max_seq_len:  # token ids
            raise context_length_error(limits.max_seq_len, len(prompt), "prompt")


def _check_batch_size(num_prompts: int, n: int = 1) -> None:
    msg = f"prompt may hold at most {MAX_BATCH_PROMPTS} prompts, got {num_prompts}."
    _require(num_prompts <= MAX_BATCH_PROMPTS, msg, "prompt")
    msg = f"a batch may ask for at most {MAX_BATCH_CHOICES} choices (prompts x n), got "
    _require(num_prompts * n <= MAX_BATCH_CHOICES, f"{msg}{num_prompts * n}.", "n")


def openapi_body(
    model_cls: type[BaseModel], model_name: str | tuple[str, ...], limits: "PromptLimits"
) -> dict:
    """The OpenAPI requestBody of a route taking `model_cls`, standalone (no $refs; the request
    models have no recursive types) and filled in with what this server serves (`model_name`:
    its id, or every id it answers to)."""
    schema = model_cls.model_json_schema()
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    fills = {
        "model": {"enum": names},
        "max_tokens": {"maximum": limits.max_seq_len - 1},
        "prompt_tokens": {"maxItems": limits.max_seq_len - 1},
        "token_id": {"maximum": limits.vocab_size - 1},
    }
    schema = _fill(_inline_refs(schema, schema.pop("$defs", {})), fills)
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _inline_refs(node, defs: dict):
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _fill(node, fills: dict[str, dict]):
    if isinstance(node, dict):
        filled = {k: _fill(v, fills) for k, v in node.items() if k != _FILL}
        return {**filled, **fills[node[_FILL]]} if _FILL in node else filled
    if isinstance(node, list):
        return [_fill(v, fills) for v in node]
    return node


@dataclass(frozen=True)
class GenerationPlan:
    """What one validated request asks of the engine."""

    prompt_ids: list[int]  # the first prompt's, in a batch
    params: tuple[SamplingParams, ...]  # one per choice; seeds differ per choice
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    # A batch of prompts (/v1/completions): every prompt's ids; each has len(params) // len(batch)
    # choices, in prompt order.
    batch: tuple[list[int], ...] = ()

    def prompt_of(self, choice: int) -> list[int]:
        if not self.batch:
            return self.prompt_ids
        return self.batch[choice * len(self.batch) // len(self.params)]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.batch)) if self.batch else len(self.prompt_ids)


def _require(ok: bool, message: str, param: str | None) -> None:
    if not ok:
        raise BadRequest(message, param=param)


def _check_bounds(name: str, value: float | None, bounds: Bounds, note: str = "") -> None:
    if value is not None:
        _require(value in bounds, f"{name} must be in {bounds}{note}, got {value}.", name)


def check_sampling(req: _SamplingFields) -> None:
    """Range checks on the fields both routes share."""
    _check_bounds("n", req.n, CHOICES)
    t = req.temperature
    _require(t is None or t >= 0, f"temperature must be non-negative, got {t}.", "temperature")
    _check_bounds("temperature", t, TEMPERATURE)
    _check_bounds("top_p", req.top_p, TOP_P)
    _check_bounds("top_k", req.top_k, TOP_K, " (0 disables it)")
    _check_bounds("seed", req.seed, SEED, " (a 64-bit signed integer)")
    _check_stop(req.stop_strings())
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        _require(not value, f"{name} is not supported; only 0 is accepted, got {value}.", name)
    _require(not req.logit_bias, "logit_bias is not supported.", "logit_bias")
    only_stream = req.stream_options is None or bool(req.stream)
    _require(only_stream, "stream_options is only allowed when stream is true.", "stream_options")


def _check_stop(stop: tuple[str, ...]) -> None:
    _check_stop_count(len(stop))
    _require(all(stop), "stop strings must not be empty.", "stop")
    longest = max((len(s) for s in stop), default=0)
    msg = f"each stop string must be at most {MAX_STOP_CHARS} characters, got {longest}."
    _require(longest <= MAX_STOP_CHARS, msg, "stop")


def _check_stop_count(count: int) -> None:
    msg = f"stop may hold at most {MAX_STOP_STRINGS} strings, got {count}."
    _require(count <= MAX_STOP_STRINGS, msg, "stop")


def check_completion(req: CompletionRequest) -> None:
    check_sampling(req)
    _require(not req.echo, "echo is not supported.", "echo")
    _require(req.suffix is None, "suffix is not supported.", "suffix")
    _require(req.best_of in (None, 1), "best_of is not supported; use n.", "best_of")
    _check_bounds("logprobs", req.logprobs, LOGPROBS)


def check_chat(req: ChatCompletionRequest) -> None:
    check_sampling(req)
    _require(bool(req.messages), "messages must not be empty.", "messages")
    for i, message in enumerate(req.messages):
        _check_message(i, message)
    k = req.top_logprobs
    _check_bounds("top_logprobs", k, LOGPROBS)
    msg = "top_logprobs requires logprobs to be true."
    _require(not k or bool(req.logprobs), msg, "top_logprobs")


def _check_message(i: int, message: ChatMessage) -> None:
    roles = ", ".join(CHAT_ROLES)
    msg = f"role must be one of {roles}, got '{message.role[:MAX_STOP_CHARS]}'."
    _require(message.role in CHAT_ROLES, msg, f"messages[{i}].role")
    for j, part in enumerate(message.content if isinstance(message.content, list) else []):
        param = f"messages[{i}].content[{j}]"
        msg = f"only text content parts are supported, got '{part.type[:MAX_STOP_CHARS]}'."
        _require(part.type == "text", msg, f"{param}.type")
        _require(part.text is not None, "a text content part needs 'text'.", f"{param}.text")


# ---- prompt size: refused before tokenizing when the text alone proves it too long ----------

# Normalizers that can shorten text, and by what factor in UTF-8 bytes at most: Unicode
# normalization maps U+1D400 (4 bytes) to "A" and three Hangul jamo (9 bytes) to one syllable.
_SHORTENING_NORMALIZERS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4}
# Pre-tokenizers that keep every character of the text in some piece (a "Removed" split drops).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split"}
_KEEPING_PRE_TOKENIZERS |= {"Punctuation"}


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt may be, known before it is tokenized. Text longer in UTF-8 than
    `max_text_bytes` always tokenizes to at least max_seq_len tokens, since one token stands
    for at most `bytes_per_token` bytes of it, so it is refused without being tokenized."""

    max_seq_len: int
    vocab_size: int
    bytes_per_token: int | None  # None: the tokenizer may drop or shrink text; no bound holds

    @classmethod
    def of(cls, tokenizer, max_seq_len: int) -> "PromptLimits":
        return cls(max_seq_len, len(tokenizer), max_bytes_per_token(tokenizer))

    @property
    def max_text_bytes(self) -> int | None:
        if self.bytes_per_token is None:
            return None
        return (self.max_seq_len - 1) * self.bytes_per_token

    def check_text(self, text: str, param: str) -> None:
        limit = self.max_text_bytes
        if limit is None or len(text) * 4 <= limit:  # UTF-8 takes at most 4 bytes a character
            return
        size_bytes = len(text) if len(text) > limit else len(text.encode())
        if size_bytes > limit:
            at_least = -(-size_bytes // self.bytes_per_token)
            raise context_length_error(self.max_seq_len, at_least, param, at_least=True)


def max_bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, or None when the tokenizer's
    pipeline may drop text or shorten it without bound. A token's string is at least as long
    in UTF-8 as the text it covers under byte-level BPE (a 1- or 2-byte character per byte),
    Metaspace (a space becomes the 3-byte "▁") and byte fallback ("<0x41>" for one byte)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    shrink = _shrink_factor(_spec(backend.normalizer))
    pre = _spec(backend.pre_tokenizer)
    if shrink is None or not _keeps_text(pre) or not _bpe_covers_all(backend.model, pre):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None  # such a token swallows the whitespace beside it, however long
    longest = max(len(t.encode()) for t in backend.get_vocab(with_added_tokens=True))
    return math.ceil(longest * shrink)


def _spec(component) -> dict | None:
    """A tokenizers normalizer or pre-tokenizer as its JSON description."""
    return None if component is None else json.loads(component.__getstate__())


def _shrink_factor(normalizer: dict | None) -> float | None:
    """How many times shorter in bytes the normalizer can make text; None: without bound."""
    if normalizer is None or normalizer["type"] == "Prepend":
        return 1
    if normalizer["type"] == "Sequence":
        factors = [_shrink_factor(n) for n in normalizer["normalizers"]]
        return None if None in factors else math.prod(factors)
    if normalizer["type"] == "Replace":
        pattern, content = normalizer["pattern"].get("String"), normalizer["content"].encode()
        if pattern is None or not content:  # a regex can match a run of any length
            return None
        return max(1, len(pattern.encode()) / len(content))
    return _SHORTENING_NORMALIZERS.get(normalizer["type"])


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre["type"] == "Sequence":
        return all(_keeps_text(p) for p in pre["pretokenizers"])
    return pre["type"] in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _bpe_covers_all(model, pre: dict | None) -> bool:
    """BPE that turns all text into tokens, one unknown character per token at most (a fused
    unknown token covers a run of any length; without an unknown token they are dropped)."""
    if type(model).__name__ != "BPE":
        return False
    if model.byte_fallback or "ByteLevel" in json.dumps(pre):
        return True
    return model.unk_token is not None and not model.fuse_unk


def completion_prompts(req: CompletionRequest, limits: PromptLimits) -> list[str | list[int]]:
    """The prompts of a request, one unless it sent a batch: each is text to tokenize (special
    tokens added as the tokenizer does), or checked token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check_batch_size(len(prompt), req.n or 1)
        return [_completion_prompt(p, limits) for p in prompt]
    return [_completion_prompt(prompt, limits)]


def _completion_prompt(prompt: str | list[int], limits: PromptLimits) -> str | list[int]:
    """One prompt, refused here if it cannot fit the context."""
    _require(len(prompt) > 0, "prompt must not be empty.", "prompt")
    if isinstance(prompt, str):
        limits.check_text(prompt, "prompt")
        return prompt
    if len(prompt) >= limits.max_seq_len:
        raise context_length_error(limits.max_seq_len, len(prompt), "prompt")
    vocab = limits.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    _require(bad is None, f"prompt token ids must be in [0, {vocab}), got {bad}.", "prompt")
    return list(prompt)


def chat_prompt(
    req: ChatCompletionRequest, tokenizer, limits: PromptLimits, tools: tuple[dict, ...] = ()
) -> str:
    """The chat template rendered to text, refused here if it cannot fit the context. Tokenize
    it without adding special tokens a second time: the template writes its own BOS and turn
    markers where the model expects them. tools go to a template that renders them, otherwise
    into a system message of Orbit's (tool_calls.py)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise BadRequest("this model has no chat template; use /v1/completions.", "messages")
    messages, extra = req.template_messages(), {}
    if tools and template_uses_tools(template):
        extra["tools"] = list(tools)
    elif tools:
        messages = _with_system(messages, tools_system_prompt(tools))
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors, and the template's raise_exception()
        raise BadRequest(f"the chat template rejected the messages: {exc}", "messages") from None
    limits.check_text(text, "messages")
    return text


def _with_system(messages: list[dict], instructions: str) -> list[dict]:
    """instructions before the first system message's text, or as a system message of its own."""
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{instructions}\n\n{messages[0]['content']}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def build_plan(
    req: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_seq_len: int,
    json_schema: str | None = None,
) -> GenerationPlan:
    """Check the context budget and derive one SamplingParams per choice; json_schema: what
    decoding is constrained to (structured.py, tool_calls.py)."""
    num_prompt = len(prompt_ids)
    if num_prompt >= max_seq_len:
        raise context_length_error(max_seq_len, num_prompt, req.prompt_param)
    max_tokens, param = req.requested_max_tokens()
    if max_tokens is None:
        max_tokens = max_seq_len - num_prompt
    _require(max_tokens >= 1, f"{param} must be at least 1, got {max_tokens}.", param)
    if num_prompt + max_tokens > max_seq_len:
        raise max_tokens_error(max_tokens, max_seq_len, num_prompt, param)
    base = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        logprobs=req.engine_logprobs(),
        ignore_eos=bool(req.ignore_eos),
        json_schema=json_schema,
    )
    n = req.n or 1
    params = tuple(dataclasses.replace(base, seed=choice_seed(req.seed, i)) for i in range(n))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return GenerationPlan(prompt_ids, params, req.stop_strings(), bool(req.stream), include_usage)


def build_batch_plan(
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    max_seq_len: int,
    json_schema: str | None = None,
) -> GenerationPlan:
    """build_plan for each prompt of a batch, as one plan whose choices are prompt-major."""
    plans = [build_plan(req, ids, max_seq_len, json_schema) for ids in prompts]
    if len(plans) == 1:
        return plans[0]
    params = tuple(p for plan in plans for p in plan.params)
    return dataclasses.replace(plans[0], params=params, batch=tuple(prompts))


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i uses seed + i (wrapped to int64), so a seeded request repeats choice by choice."""
    if seed is None:
        return None
    return (seed + index - _INT64_MIN) % 2**64 + _INT64_MIN


class GeneratedToken(NamedTuple):
    """One generated token as the response builders need it (a tuple: one is made for every
    streamed token, at half a frozen dataclass's cost)."""

    token_id: int
    logprob: float | None
    top_logprobs: Sequence[tuple[int, float]]
    text_offset: int  # complete characters of the choice's text before this token


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class CompletionFormat:
    """Choices of /v1/completions, whole or as stream deltas."""

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, texts: TokenTexts, with_logprobs: bool):
        self._texts = texts
        self._with_logprobs = with_logprobs

    def opening_choices(self, n: int) -> list[dict]:
        return []

    def delta(
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None, calls=()
    ) -> dict:
        return self.choice(index, text, tokens, finish)

    def choice(
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None, calls=()
    ) -> dict:
        logprobs = self._logprobs(tokens) if self._with_logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, tokens: list[GeneratedToken]) -> dict:
        return {
            "tokens": [self._texts.text_of(t.token_id) for t in tokens],
            "token_logprobs": [_finite(t.logprob) for t in tokens],
            "top_logprobs": [self._top(t) for t in tokens],
            "text_offset": [t.text_offset for t in tokens],
        }

    def _top(self, token: GeneratedToken) -> dict[str, float | None]:
        # OpenAI always lists the sampled token too, so there may be k + 1 entries.
        top = {self._texts.text_of(i): _finite(lp) for i, lp in token.top_logprobs}
        top.setdefault(self._texts.text_of(token.token_id), _finite(token.logprob))
        return top


class ChatFormat:
    """Choices of /v1/chat/completions, whole or as stream deltas."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, texts: TokenTexts, with_logprobs: bool):
        self._texts = texts
        self._with_logprobs = with_logprobs

    def opening_choices(self, n: int) -> list[dict]:
        """Each streamed choice starts with a delta that carries the role."""
        delta = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None} for i in range(n)
        ]

    def delta(
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None, calls=()
    ) -> dict:
        """calls: tool-call deltas (tool_calls.py), each with its index in the choice."""
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = list(calls)
        logprobs = self._logprobs(tokens) if self._with_logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def choice(
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None, calls=()
    ) -> dict:
        """calls: the choice's whole tool calls; content is null when there is none besides."""
        message = {"role": "assistant", "content": text}
        if calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": list(calls)}
        logprobs = self._logprobs(tokens) if self._with_logprobs else None
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, tokens: list[GeneratedToken]) -> dict:
        content = [
            {**self._entry(t.token_id, t.logprob), "top_logprobs": self._top(t)} for t in tokens
        ]
        return {"content": content}

    def _top(self, token: GeneratedToken) -> list[dict]:
        return [self._entry(i, lp) for i, lp in token.top_logprobs]

    def _entry(self, token_id: int, logprob: float | None) -> dict:
        return {
            "token": self._texts.text_of(token_id),
            "logprob": _finite(logprob),
            "bytes": self._texts.bytes_of(token_id),
        }
