"""OpenAI request models, their validation into engine inputs, and OpenAI-shaped response dicts.

Unknown request fields are ignored, as OpenAI does. Fields that would change the output in ways
Orbit does not implement (echo, suffix, best_of, penalties, logit_bias, tools, JSON mode) are
refused with a 400 rather than silently ignored. A batch of several prompts is refused too: send
one prompt per request (a one-element list is accepted).
"""

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from orbit.engine import SamplingParams
from orbit.errors import (
    BadRequest,
    context_length_error,
    from_validation_error,
    max_tokens_error,
)
from orbit.textstream import TokenTexts

MAX_CHOICES = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# JSON has no infinities; vLLM reports an impossible token's logprob as this instead.
_MIN_LOGPROB = -9999.0
CHAT_ROLES = ("system", "user", "assistant", "developer")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension: 0 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False  # extension, for benchmarks

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    prompt_param: ClassVar[str] = "prompt"

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # text parts joined by newlines, as vLLM does
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    prompt_param: ClassVar[str] = "messages"

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        # OpenAI's "developer" role is its newer name for "system"; templates know only the latter.
        roles = {"developer": "system"}
        return [{"role": roles.get(m.role, m.role), "content": m.text()} for m in self.messages]


RequestModel = TypeVar("RequestModel", CompletionRequest, ChatCompletionRequest)


def parse_request(raw: bytes, model_cls: type[RequestModel]) -> RequestModel:
    """A request body as `model_cls`; any malformed input is a 400, never a 422 or a 500."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError covers bad UTF-8 too
        raise BadRequest("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


@dataclass(frozen=True)
class GenerationPlan:
    """What one validated request asks of the engine."""

    prompt_ids: list[int]
    params: tuple[SamplingParams, ...]  # one per choice; seeds differ per choice
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)


def check_sampling(req: _SamplingFields) -> None:
    """Range checks on the fields both routes share."""
    n = 1 if req.n is None else req.n
    _require(1 <= n <= MAX_CHOICES, f"n must be in [1, {MAX_CHOICES}], got {n}.", "n")
    t = req.temperature
    _require(t is None or t >= 0, f"temperature must be non-negative, got {t}.", "temperature")
    p = req.top_p
    _require(p is None or 0 < p <= 1, f"top_p must be in (0, 1], got {p}.", "top_p")
    k = req.top_k
    _require(k is None or k >= 0, f"top_k must be non-negative (0 disables it), got {k}.", "top_k")
    seed_ok = req.seed is None or _INT64_MIN <= req.seed <= _INT64_MAX
    _require(seed_ok, "seed must be a 64-bit signed integer.", "seed")
    _check_stop(req.stop_strings())
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        _require(not value, f"{name} is not supported; only 0 is accepted, got {value}.", name)
    _require(not req.logit_bias, "logit_bias is not supported.", "logit_bias")
    only_stream = req.stream_options is None or bool(req.stream)
    _require(only_stream, "stream_options is only allowed when stream is true.", "stream_options")


def _check_stop(stop: tuple[str, ...]) -> None:
    count = len(stop)
    _require(
        count <= MAX_STOP_STRINGS,
        f"stop may hold at most {MAX_STOP_STRINGS} strings, got {count}.",
        "stop",
    )
    _require(all(stop), "stop strings must not be empty.", "stop")
    longest = max((len(s) for s in stop), default=0)
    msg = f"each stop string must be at most {MAX_STOP_CHARS} characters, got {longest}."
    _require(longest <= MAX_STOP_CHARS, msg, "stop")


def check_completion(req: CompletionRequest) -> None:
    check_sampling(req)
    _require(not req.echo, "echo is not supported.", "echo")
    _require(req.suffix is None, "suffix is not supported.", "suffix")
    _require(req.best_of in (None, 1), "best_of is not supported; use n.", "best_of")
    k = req.logprobs
    msg = f"logprobs must be in [0, {MAX_LOGPROBS}], got {k}."
    _require(k is None or 0 <= k <= MAX_LOGPROBS, msg, "logprobs")


def check_chat(req: ChatCompletionRequest) -> None:
    check_sampling(req)
    _require(bool(req.messages), "messages must not be empty.", "messages")
    for i, message in enumerate(req.messages):
        _check_message(i, message)
    _require(not req.tools, "tools are not supported.", "tools")
    fmt = (req.response_format or {}).get("type", "text")
    _require(fmt == "text", f"response_format of type '{fmt}' is not supported.", "response_format")
    k = req.top_logprobs
    msg = f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}."
    _require(k is None or 0 <= k <= MAX_LOGPROBS, msg, "top_logprobs")
    msg = "top_logprobs requires logprobs to be true."
    _require(not k or bool(req.logprobs), msg, "top_logprobs")


def _check_message(i: int, message: ChatMessage) -> None:
    roles = ", ".join(CHAT_ROLES)
    msg = f"role must be one of {roles}, got '{message.role}'."
    _require(message.role in CHAT_ROLES, msg, f"messages[{i}].role")
    for j, part in enumerate(message.content if isinstance(message.content, list) else []):
        param = f"messages[{i}].content[{j}]"
        msg = f"only text content parts are supported, got '{part.type}'."
        _require(part.type == "text", msg, f"{param}.type")
        _require(part.text is not None, "a text content part needs 'text'.", f"{param}.text")


def completion_prompt_ids(req: CompletionRequest, tokenizer) -> list[int]:
    """The prompt as token ids: tokenized text (special tokens added as the tokenizer does)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        msg = "batched prompts are not supported; send one prompt per request."
        _require(len(prompt) == 1, msg, "prompt")
        prompt = prompt[0]
    _require(len(prompt) > 0, "prompt must not be empty.", "prompt")
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    vocab = len(tokenizer)
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    _require(bad is None, f"prompt token ids must be in [0, {vocab}), got {bad}.", "prompt")
    return list(prompt)


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer) -> list[int]:
    """Render the chat template, then tokenize without adding special tokens a second time:
    the template writes its own BOS / turn markers where the model expects them."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template; use /v1/completions.", "messages")
    try:
        text = tokenizer.apply_chat_template(
            req.template_messages(), add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors, and the template's raise_exception()
        raise BadRequest(f"the chat template rejected the messages: {exc}", "messages") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def build_plan(
    req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], max_seq_len: int
) -> GenerationPlan:
    """Check the context budget and derive one SamplingParams per choice."""
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
    )
    n = req.n or 1
    params = tuple(dataclasses.replace(base, seed=choice_seed(req.seed, i)) for i in range(n))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return GenerationPlan(prompt_ids, params, req.stop_strings(), bool(req.stream), include_usage)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i uses seed + i (wrapped to int64), so a seeded request repeats choice by choice."""
    if seed is None:
        return None
    return (seed + index - _INT64_MIN) % 2**64 + _INT64_MIN


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token as the response builders need it."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    text_offset: int  # complete characters of the choice's text before this token


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None
    ) -> dict:
        return self.choice(index, text, tokens, finish)

    def choice(
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None
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
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None
    ) -> dict:
        delta = {"content": text} if text else {}
        logprobs = self._logprobs(tokens) if self._with_logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def choice(
        self, index: int, text: str, tokens: list[GeneratedToken], finish: str | None
    ) -> dict:
        message = {"role": "assistant", "content": text}
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
