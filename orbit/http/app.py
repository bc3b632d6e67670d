"""The OpenAI-compatible HTTP API of an API server process (orbit/http/server.py).

How a generation request flows. The body is read (bounded in size and time, JSON only), then
parsed, checked and tokenized off the event loop in one of two lanes (_Lanes): small work has its
own thread, so large prompts delay small requests little. A prompt whose text alone proves it
longer than the context is refused before tokenizing (PromptLimits). `build_plan` turns the
prompt into one SamplingParams per choice. Each of the n choices is its own sequence in the
engine core (orbit/http/core_client.py), whose outputs arrive once per step, each with the
step's new tokens; a choice turns them into ChoiceDeltas (the text a TextStream released, plus
the tokens it covers), and `merge` interleaves the choices when there are several. A finish, a
stop string, an error or the reader going away closes the core iterator, which frees the
sequence.
Non-streaming calls race the collection against the client disconnecting. Streaming calls wait
for the first delta before sending headers, so an engine that fails up front still answers 503;
a failure after that becomes an SSE error event followed by `data: [DONE]`.

Connections are bounded in time as well as size: the body must keep arriving (BodyLimits, 408
otherwise), and with `uvicorn_options()` a connection that opens but never completes a request
head, or sits idle after a response, is closed.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orbit.http.access_log import AccessLogMiddleware, note_first_token, note_tokens
from orbit.http.async_streams import close, merge
from orbit.http.core_client import (
    CoreClient,
    EngineError,
    EngineNotReady,
    EngineOverloaded,
    RequestTooLarge,
)
from orbit.http.errors import (
    ApiError,
    AuthenticationFailed,
    BadRequest,
    InternalError,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
    UnsupportedMediaType,
    install_error_handlers,
)
from orbit.http.metrics import CLIENT_CLOSED_REQUEST, FrontendMetrics, RequestMetricsMiddleware
from orbit.http.openai_types import (
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    GeneratedToken,
    GenerationPlan,
    PromptLimits,
    RequestModel,
    build_batch_plan,
    chat_prompt,
    check_chat,
    check_completion,
    completion_prompts,
    openapi_body,
    parse_request,
    usage,
)
from orbit.http.schema_check import SchemaChecker
from orbit.http.structured import check_schemas
from orbit.http.textstream import TextStream, TokenTexts
from orbit.http.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from orbit.http.tool_calls import OutputConstraints, chat_output, completion_output
from orbit.http.tool_parser import merge_deltas, parse_choice
from proto import core_pb2
from runtime.version import __version__

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
# A connection must send each request head whole within this many seconds of opening or of
# its previous response (slow-loris clients); a head may be at most MAX_HEAD_BYTES long.
REQUEST_HEAD_TIMEOUT_S = 15.0
# An idle connection is closed after this long between requests: longer than the 5 s after
# which httpx (and the openai client on it) drops an idle connection, so those clients never
# send a request on a connection the server is closing (a reset; likely what failed one request
# of a 1,000-request load test once).
KEEP_ALIVE_TIMEOUT_S = 10
MAX_HEAD_BYTES = 16 * 1024
# Request bodies and prompts up to this many bytes (characters, for prompt text) are handled
# in the small lane; one that size parses and tokenizes in about 15 ms.
SMALL_WORK_BYTES = 16 * 1024
LARGE_LANE_THREADS = 2
# Schema checks wait for a compile, one at a time per API server (orbit/http/schema_check.py);
# a schema checked before passes at once, so a few threads keep those from queueing behind one.
SCHEMA_LANE_THREADS = 4
MAX_ECHO_CHARS = 256  # of a client's value quoted in an error message
SSE_DONE = "data: [DONE]\n\n"
_ROUTES = frozenset(
    {"/health", "/version", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}
    | {"/tokenize", "/detokenize"}
)
T = TypeVar("T")
Format = CompletionFormat | ChatFormat
OpenAIRequest = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may cost: its size, and how long it may take to arrive."""

    max_bytes: int = MAX_BODY_BYTES
    idle_timeout_s: float = 15.0  # the body must make progress at least this often
    timeout_s: float = 60.0  # and be complete this long after the handler starts reading


def create_app(
    engine: CoreClient,
    served_model_name: str,
    *,
    api_key: str | None = None,
    body_limits: BodyLimits = BodyLimits(),
    metrics: FrontendMetrics | None = None,
    server_index: int = 0,
    model_aliases: tuple[str, ...] = (),
    schema_checker: SchemaChecker | None = None,
) -> FastAPI:
    """The HTTP app over the engine core's client (tests pass an in-test engine with the same
    interface). With `api_key`, every route but /health needs `Authorization: Bearer KEY`,
    /openapi.json included, and the interactive docs (/docs, /redoc) are off: a browser
    could not send the key for the schema they load. Generation responses name the API server
    that served them (`x-orbit-api-server`). Requests may name the model by `served_model_name`
    (the listed id) or any of `model_aliases`. `schema_checker` compiles structured-output
    schemas before they reach the core (default: one over the engine's tokenizer, started on
    the first schema)."""
    frontend = _Frontend(
        engine,
        served_model_name,
        body_limits,
        metrics or FrontendMetrics(),
        model_aliases,
        schema_checker or SchemaChecker(engine.tokenizer),
    )
    frontend.headers["x-orbit-api-server"] = str(server_index)
    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if api_key else {}
    app = FastAPI(title="Orbit", version=__version__, **docs)
    install_error_handlers(app)
    app.add_exception_handler(_ClientGone, frontend.on_client_gone)
    app.add_middleware(RequestMetricsMiddleware, metrics=frontend.metrics, routes=_ROUTES)
    app.add_middleware(AccessLogMiddleware)
    guard = [Depends(_bearer_check(api_key))] if api_key else []
    if api_key:

        async def schema() -> JSONResponse:
            return JSONResponse(app.openapi())

        app.add_api_route("/openapi.json", schema, dependencies=guard, include_in_schema=False)
    app.add_api_route("/health", frontend.health, methods=["GET"])
    app.add_api_route("/version", frontend.version, methods=["GET"], dependencies=guard)
    app.add_api_route("/metrics", frontend.metrics_text, methods=["GET"], dependencies=guard)
    app.add_api_route("/v1/models", frontend.models, methods=["GET"], dependencies=guard)
    app.add_api_route(
        "/v1/models/{model_id:path}", frontend.model, methods=["GET"], dependencies=guard
    )
    for path, handler, body in (
        ("/tokenize", frontend.tokenize, TokenizeRequest),
        ("/detokenize", frontend.detokenize, DetokenizeRequest),
        ("/v1/completions", frontend.completions, CompletionRequest),
        ("/v1/chat/completions", frontend.chat_completions, ChatCompletionRequest),
    ):
        extra = frontend.openapi_body(body)
        app.add_api_route(path, handler, methods=["POST"], dependencies=guard, openapi_extra=extra)
    app.state.warm_up = frontend.warm_up  # orbit/http/server.py awaits it before serving
    return app


def uvicorn_options() -> dict:
    """The uvicorn.Config arguments that bound a connection's time before and between requests
    (orbit/serve.py passes them)."""
    return {
        "http": GuardedHttpToolsProtocol,
        "timeout_keep_alive": KEEP_ALIVE_TIMEOUT_S,
    }


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, C: a third of the CPU per streamed chunk that h11
    took), with two bounds it lacks. A connection that has not sent a complete request head
    `head_timeout_s` after it opened or after its last response ended is closed: uvicorn alone
    waits forever for a first head, its keep-alive timer stops at the first byte of a partial
    one, and nothing ends a body still trickling in after an early answer (401, 415). A head
    longer than `max_head_bytes` is refused with 431: the parser would buffer a header of any
    length."""

    head_timeout_s = REQUEST_HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes: int | None = 0  # bytes since the last message ended; None once its head is in

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is not None:
            room = self.max_head_bytes - self._head_bytes
            if len(data) > room:
                super().data_received(data[:room])
                if self._head_bytes is not None:  # still no complete head
                    self._refuse_head()
                    return
                data = data[room:]  # the body, or requests pipelined behind
            else:
                self._head_bytes += len(data)
        if data and not self.transport.is_closing():
            super().data_received(data)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _refuse_head(self) -> None:
        if self.transport.is_closing():
            return  # the parser refused it already (400)
        text = f"The request head must be at most {self.max_head_bytes} bytes.".encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(text), text)
        )
        self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def _on_head_timeout(self) -> None:
        # A request started since the timer was armed has a cycle whose response is unfinished.
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            self.transport.close()


def _bearer_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode()

    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected):
            raise AuthenticationFailed("Incorrect API key provided.")

    return check


class _ClientGone(Exception):
    """The client disconnected before the response was complete."""


@dataclass(frozen=True)
class ChoiceDelta:
    """New text of one choice and the number of tokens it covers, with those tokens when the
    choice asked for logprobs (the only use of each one's id, logprobs and offset: a choice
    without them makes no object per token); the last one has a finish_reason."""

    index: int
    text: str
    num_tokens: int
    tokens: list[GeneratedToken]  # [] without logprobs
    finish_reason: str | None
    tool_calls: tuple[dict, ...] = ()  # tool-call deltas (tool_calls.py)


@dataclass
class _ChoiceResult:
    text: str = ""
    num_tokens: int = 0
    tokens: list[GeneratedToken] = field(default_factory=list)  # with logprobs
    finish_reason: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.num_tokens += delta.num_tokens
        self.tokens += delta.tokens
        self.tool_calls += delta.tool_calls
        self.finish_reason = delta.finish_reason or self.finish_reason


@dataclass(frozen=True)
class _Call:
    """One API call: what every response body and chunk of it is stamped with."""

    id: str
    created: int
    model: str
    fmt: Format
    plan: GenerationPlan
    cached: dict[int, int] = field(default_factory=dict)  # choice -> prompt tokens from cache
    # choice -> (time to its first token, where that time went), for the access log
    first_token: dict[int, tuple[float, dict[str, float]]] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted as prompt_tokens counts them:
        once per prompt, from the prompt's first choice."""
        per_prompt = len(self.plan.params) // max(len(self.plan.batch), 1)
        return sum(n for i, n in self.cached.items() if i % per_prompt == 0)

    def usage(self, completion_tokens: int) -> dict:
        return usage(self.plan.num_prompt_tokens, completion_tokens, self.cached_tokens)

    def body(self, object_name: str, choices: list[dict], **extra) -> dict:
        head = {"id": self.id, "object": object_name, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    @cached_property
    def _chunk_head(self) -> str:
        """A chunk's JSON up to its choices, encoded once per call rather than per token."""
        return _json(self.body(self.fmt.chunk_object, []))[: -len("[]}")]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        """One SSE event. With include_usage every chunk has usage, as OpenAI's: null but on
        the last, which has no choices."""
        tail = f', "usage": {_json(usage)}' if self.plan.include_usage else ""
        return f"data: {self._chunk_head}{_json(choices)}{tail}}}\n\n"


def _json_encoder() -> Callable[[object], str]:
    """JSON text as json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode writes it. Its
    C encoder is made once here rather than on every call as encode() does, which was most of
    the cost of encoding a streamed chunk (about 3 of 4.7 µs)."""
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
    make = json.encoder.c_make_encoder
    if make is None:  # a Python without the _json accelerator
        return encoder.encode
    # Arguments: markers (no cycle check: our bodies are trees), default, string encoder,
    # indent, key and item separators, sort_keys, skipkeys, allow_nan.
    encode = make(None, encoder.default, json.encoder.encode_basestring, None, ": ", ", ",
                  False, False, False)  # fmt: skip
    return lambda obj: "".join(encode(obj, 0))


_json = _json_encoder()


def _sse(payload: dict) -> str:
    return f"data: {_json(payload)}\n\n"


@dataclass(frozen=True)
class _Prompt:
    """Prompt text still to be tokenized."""

    text: str
    add_special_tokens: bool  # False for a rendered chat template: it wrote its own markers


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


class _Lanes:
    """Parsing, chat templates and tokenization, off the event loop in two lanes by size: small
    work has its own thread, so it never queues behind large prompts, which share
    LARGE_LANE_THREADS. HF fast tokenizers release the GIL while encoding, and encoding never
    changes a tokenizer's settings (no truncation or padding is asked for), so the threads
    share one tokenizer."""

    def __init__(self):
        self._small = ThreadPoolExecutor(1, thread_name_prefix="orbit-small-prompts")
        self._large = ThreadPoolExecutor(LARGE_LANE_THREADS, thread_name_prefix="orbit-prompts")
        self._schemas = ThreadPoolExecutor(SCHEMA_LANE_THREADS, thread_name_prefix="orbit-schemas")

    async def run(self, size: int, fn: Callable[..., T], *args) -> T:
        pool = self._small if size <= SMALL_WORK_BYTES else self._large
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def compile(self, check: Callable[[str], None], schemas: tuple) -> None:
        """Check a request's schemas (structured.check_schemas) in a lane of their own: a
        compile may take seconds, and a schema checked before passes at once."""
        if schemas:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._schemas, check_schemas, schemas, check)


class _Frontend:
    """Route handlers over one engine."""

    def __init__(
        self,
        engine: CoreClient,
        model_name: str,
        body_limits: BodyLimits,
        metrics: FrontendMetrics,
        model_aliases: tuple[str, ...],
        schemas: SchemaChecker,
    ):
        self.engine = engine
        self.schemas = schemas
        self.model_name = model_name  # the listed id, and the one responses carry
        self.model_names = (model_name, *model_aliases)  # every id requests may use
        self.body_limits = body_limits
        self.metrics = metrics
        self.headers: dict[str, str] = {}  # on every generation response
        self.token_texts = TokenTexts(engine.tokenizer)
        self.prompt_limits = PromptLimits.of(engine.tokenizer, engine.max_seq_len)
        if self.prompt_limits.max_text_bytes is None:
            logger.warning(
                "the tokenizer may drop text: prompts are tokenized before their length is checked"
            )
        self.created = int(time.time())
        self._lanes = _Lanes()

    async def warm_up(self) -> None:
        """Pay a fresh API server's one-time costs before it serves, not in its first requests:
        anyio's asyncio backend (Starlette's StreamingResponse imports it at the first stream),
        each lane's first thread, request parsing, the chat template's compile, the tokenizer's
        first encode and an incremental decode. Nothing reaches the engine or the metrics."""
        async with anyio.create_task_group():
            pass
        requests = (
            (self._completion_prompts, {"prompt": "Hello"}),
            (self._chat_prompt, {"messages": [{"role": "user", "content": "Hello"}]}),
        )
        ids: list[int] = []
        for size in (0, SMALL_WORK_BYTES + 1):  # the small lane, then the large one
            for parse, fields in requests:
                raw = json.dumps({"model": self.model_name, "max_tokens": 1, **fields}).encode()
                try:
                    _, prompts, _ = await self._lanes.run(size, parse, raw)
                except ApiError:  # e.g. a tokenizer without a chat template: nothing to warm
                    continue
                prompt = prompts[0] if isinstance(prompts, list) else prompts
                ids = await self._lanes.run(
                    size, _encode, self.engine.tokenizer, prompt.text, prompt.add_special_tokens
                )
        stream = TextStream(self.engine.tokenizer)
        stream.feed_many(ids)
        stream.finish()

    def openapi_body(self, model_cls: type[RequestModel]) -> dict:
        """The request schema for /openapi.json: the routes parse their bodies themselves (to
        answer malformed input with 400, not 422), so FastAPI cannot infer it."""
        return {"requestBody": openapi_body(model_cls, self.model_names, self.prompt_limits)}

    async def health(self) -> JSONResponse:
        if not self.engine.is_ready():
            raise ServiceUnavailable("The engine is not ready.")
        return JSONResponse({"status": "ok"})

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": __version__})

    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "orbit",
            "max_model_len": self.engine.max_seq_len,
        }

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> JSONResponse:
        """One model by any id it is served under (OpenAI's models.retrieve)."""
        self._check_model(model_id)
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> JSONResponse:
        raw = await _read_body(request, self.body_limits)
        args = (raw, self.engine.tokenizer, self.prompt_limits, self._check_model)
        return JSONResponse(await self._lanes.run(len(raw), tokenize, *args))

    async def detokenize(self, request: Request) -> JSONResponse:
        raw = await _read_body(request, self.body_limits)
        args = (raw, self.engine.tokenizer, self.prompt_limits, self._check_model)
        return JSONResponse(await self._lanes.run(len(raw), detokenize, *args))

    async def metrics_text(self) -> PlainTextResponse:
        try:  # every API server's HTTP metrics, summed, and the core's
            text = await self.engine.metrics_text()
        except Exception:
            logger.warning("the engine core's metrics are unavailable", exc_info=True)
            text = self.metrics.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def on_client_gone(self, request: Request, exc: Exception) -> Response:
        self.metrics.aborted.inc()
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def completions(self, request: Request) -> Response:
        started_s = time.monotonic()
        raw = await _read_body(request, self.body_limits)
        req, prompts, output = await self._lanes.run(len(raw), self._completion_prompts, raw)
        await self._lanes.compile(self.schemas.check, output.schemas)
        return await self._generate(request, req, prompts, CompletionFormat, started_s, output)

    async def chat_completions(self, request: Request) -> Response:
        started_s = time.monotonic()
        raw = await _read_body(request, self.body_limits)
        req, prompt, output = await self._lanes.run(len(raw), self._chat_prompt, raw)
        await self._lanes.compile(self.schemas.check, output.schemas)
        return await self._generate(request, req, [prompt], ChatFormat, started_s, output)

    def _completion_prompts(
        self, raw: bytes
    ) -> tuple[CompletionRequest, list[_Prompt | list[int]], OutputConstraints]:
        req = parse_request(raw, CompletionRequest, self.prompt_limits)
        self._check_model(req.model)
        check_completion(req)
        output = completion_output(req.response_format)
        prompts = completion_prompts(req, self.prompt_limits)
        return req, [_Prompt(p, True) if isinstance(p, str) else p for p in prompts], output

    def _chat_prompt(self, raw: bytes) -> tuple[ChatCompletionRequest, _Prompt, OutputConstraints]:
        req = parse_request(raw, ChatCompletionRequest, self.prompt_limits)
        self._check_model(req.model)
        check_chat(req)
        output = chat_output(
            req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls
        )
        tools = output.tools.tools if output.tools else ()
        text = chat_prompt(req, self.engine.tokenizer, self.prompt_limits, tools)
        return req, _Prompt(text, False), output

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            name = model[:MAX_ECHO_CHARS]
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")

    async def _prompt_ids(self, prompt: _Prompt | list[int]) -> list[int]:
        if not isinstance(prompt, _Prompt):
            return prompt
        tokenizer = self.engine.tokenizer
        return await self._lanes.run(
            len(prompt.text), _encode, tokenizer, prompt.text, prompt.add_special_tokens
        )

    async def _generate(
        self,
        request: Request,
        req: OpenAIRequest,
        prompts: list[_Prompt | list[int]],
        format_cls,
        started_s: float,
        output: OutputConstraints,
    ) -> Response:
        prompt_ids = [await self._prompt_ids(p) for p in prompts]
        plan = build_batch_plan(req, prompt_ids, self.engine.max_seq_len, output.json_schema)
        if not self.engine.is_ready():
            raise ServiceUnavailable("The engine is not ready.")
        self.metrics.prompt_tokens.inc(plan.num_prompt_tokens)
        note_tokens(request.state, tokens_in=plan.num_prompt_tokens)
        fmt = format_cls(self.token_texts, with_logprobs=plan.params[0].logprobs is not None)
        call = _Call(
            f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name, fmt, plan
        )
        choices = [self._choice(call, i, started_s) for i in range(len(plan.params))]
        if output.tools and output.tools.mode != "none":  # text -> content and tool calls
            choices = [parse_choice(c, output.tools.parser()) for c in choices]
        deltas = choices[0] if len(choices) == 1 else merge(choices)
        if plan.stream:
            return await self._stream(request, call, deltas)
        return await self._complete(request, call, deltas)

    async def _choice(
        self, call: _Call, index: int, started_s: float
    ) -> AsyncIterator[ChoiceDelta]:
        """One engine sequence as deltas, at most one per step; closing this generator aborts
        the sequence."""
        plan = call.plan
        logprobs = plan.params[index].logprobs is not None
        text_stream = TextStream(self.engine.tokenizer, plan.stop, offsets=logprobs)
        prompt_ids = plan.prompt_of(index)
        outputs = self.engine.generate(f"{call.id}-{index}", prompt_ids, plan.params[index])
        timer = _TokenTimer(self.metrics, started_s)
        tokens: list[GeneratedToken] = []
        num_tokens = 0
        first = first_output = True
        try:
            async for out in outputs:
                if first_output:
                    first_output = False
                    if out.cached_tokens:
                        call.cached[index] = out.cached_tokens
                    if out.HasField("first_token"):
                        self.metrics.observe_first_token(out.first_token)
                        call.first_token[index] = _first_token_parts(out.first_token, started_s)
                timer.tick(len(out.token_ids))
                text = text_stream.feed_many(out.token_ids)
                num_tokens += text_stream.fed_count
                if logprobs:
                    tokens += _generated(out, text_stream.fed_offsets)
                finish = _finish(text_stream, out.finish)
                if finish and not text_stream.stopped:
                    text += text_stream.finish()
                    finish = "stop" if text_stream.stopped else finish
                # The first token goes out at once even without text (a partial character, an
                # id the tokenizer lacks), so the client's time to first token is the engine's.
                if text or finish or first:
                    yield ChoiceDelta(index, text, num_tokens, tokens, finish)
                    tokens, num_tokens, first = [], 0, False
                if finish:
                    return
            raise EngineError("the engine ended a sequence without a finish reason")
        finally:
            await close(outputs)

    async def _complete(self, request: Request, call: _Call, deltas) -> Response:
        try:
            results = await _unless_disconnected(request, _collect(deltas, len(call.plan.params)))
        except (EngineError, RequestTooLarge) as exc:
            raise _engine_refusal(call.id, exc) from None
        choices = [
            call.fmt.choice(i, r.text, r.tokens, r.finish_reason, merge_deltas(r.tool_calls))
            for i, r in enumerate(results)
        ]
        completion_tokens = sum(r.num_tokens for r in results)
        note_tokens(request.state, tokens_out=completion_tokens)
        if 0 in call.first_token:
            note_first_token(request.state, *call.first_token[0])
        body = call.body(
            call.fmt.object_name,
            choices,
            usage=call.usage(completion_tokens),
        )
        return JSONResponse(body, headers=self.headers)

    async def _stream(self, request: Request, call: _Call, deltas) -> Response:
        try:
            first = await _unless_disconnected(request, anext(deltas))
        except (EngineError, RequestTooLarge) as exc:
            raise _engine_refusal(call.id, exc) from None
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **self.headers}
        events = self._sse_events(call, first, deltas, request.state)
        return _ClosingStreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _sse_events(
        self, call: _Call, first: ChoiceDelta, deltas: AsyncIterator[ChoiceDelta], state
    ) -> AsyncIterator[str]:
        """The stream's events: `first` (taken before the headers went out), then the rest of
        `deltas`, each as it comes."""
        completion_tokens = first.num_tokens
        ended = False
        try:
            for choice in call.fmt.opening_choices(len(call.plan.params)):
                yield call.chunk([choice])
            yield _delta_chunk(call, first)
            async for d in deltas:
                completion_tokens += d.num_tokens
                yield _delta_chunk(call, d)
            if call.plan.include_usage:
                yield call.chunk([], usage=call.usage(completion_tokens))
            ended = True
        except Exception as exc:  # noqa: BLE001 - any failure must reach the client as an event
            ended = True
            yield _sse(self._stream_error(call.id, exc).body())
        finally:
            note_tokens(state, tokens_out=completion_tokens)
            if 0 in call.first_token:
                note_first_token(state, *call.first_token[0])
            if not ended:
                self.metrics.aborted.inc()
            await deltas.aclose()
        yield SSE_DONE

    def _stream_error(self, call_id: str, exc: Exception) -> ApiError:
        self.metrics.errors.inc()
        if isinstance(exc, EngineError | RequestTooLarge):
            return _engine_refusal(call_id, exc)
        logger.exception("request %s failed while streaming", call_id)
        return InternalError("The server had an error while processing the request.")


def _delta_chunk(call: _Call, d: ChoiceDelta) -> str:
    return call.chunk([call.fmt.delta(d.index, d.text, d.tokens, d.finish_reason, d.tool_calls)])


_FINISH_REASONS = {core_pb2.FINISH_STOP: "stop", core_pb2.FINISH_LENGTH: "length"}


def _finish(text_stream: TextStream, engine_finish: int) -> str | None:
    """The choice's finish reason once it ended: a stop string, or the engine's reason."""
    if text_stream.stopped:
        return "stop"
    return _FINISH_REASONS.get(engine_finish)


class _TokenTimer:
    """Feeds TTFT (from request arrival) and inter-token latency of one choice to the metrics;
    tokens that arrive together share their interval."""

    def __init__(self, metrics: FrontendMetrics, started_s: float):
        self._metrics = metrics
        self._last_s = started_s
        self._first = True

    def tick(self, num_tokens: int) -> None:
        now_s = time.monotonic()
        self._metrics.observe_tokens(now_s - self._last_s, num_tokens, self._first, now_s)
        self._last_s, self._first = now_s, False


def _first_token_parts(
    t: core_pb2.FirstTokenTiming, started_s: float
) -> tuple[float, dict[str, float]]:
    """A choice's time to first token (from the request's arrival to its first output here)
    and its parts: this server's (parsing, the template, tokenization), the trip to the core,
    the core's queue, the steps to the first token (of which the ranks' and the GPU's time in
    the last), and the rest (the trips back, this server's delivery)."""
    ttft_s = time.monotonic() - started_s
    parts = {
        "api": t.sent_at - started_s,
        "to_core": t.to_core_s,
        "queue": t.queued_s,
        "prefill": t.prefill_s,
        "ranks": t.rank_s,
        "gpu": t.gpu_s,
    }
    parts["back"] = ttft_s - (parts["api"] + t.to_core_s + t.queued_s + t.prefill_s)
    return ttft_s, parts


def _generated(out: core_pb2.SeqOutput, text_offsets: list[int]) -> list[GeneratedToken]:
    """The tokens of one output of a choice with logprobs that the text stream consumed (all
    but those after a stop string), with their logprobs."""
    ids = out.token_ids
    if not out.logprobs:  # (none came with these tokens)
        return [GeneratedToken(ids[j], None, (), offset) for j, offset in enumerate(text_offsets)]
    return [
        GeneratedToken(
            ids[j], out.logprobs[j], list(zip(out.top[j].token_ids, out.top[j].logprobs)), offset
        )
        for j, offset in enumerate(text_offsets)
    ]


def _engine_refusal(call_id: str, exc: EngineError | RequestTooLarge) -> ApiError:
    if isinstance(exc, RequestTooLarge):  # its text is about sizes only, and helps the client
        return BadRequest(f"The request does not fit the served model's capacity: {exc}.")
    # An engine failure's text may name hosts or ranks: log it, do not send it.
    logger.warning("request %s failed in the engine: %s", call_id, exc)
    if isinstance(exc, EngineNotReady):
        return ServiceUnavailable("The engine is not ready.")
    if isinstance(exc, EngineOverloaded):
        return TooManyRequests("The server is overloaded: its request queue is full; retry later.")
    return ServiceUnavailable("The engine failed while serving the request; retry later.")


async def _collect(deltas: AsyncIterator[ChoiceDelta], n: int) -> list[_ChoiceResult]:
    results = [_ChoiceResult() for _ in range(n)]
    async for delta in deltas:
        results[delta.index].add(delta)
    return results


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends. Starlette leaves it suspended when
    the client goes away, and its cleanup (aborting engine sequences) must not wait for GC."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # a send failed because the client left (ASGI 2.4 servers): counted as an abort
        finally:
            await self.body_iterator.aclose()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it and raise _ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.wait({task})  # let the cancelled work close its engine iterators
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    # Called after the body was read, so the only message left is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, limits: BodyLimits) -> bytes:
    """The body of a JSON POST: 415 for another media type, 413 past the size limit, 408 when
    it stops arriving."""
    _check_json_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise _too_large(limits)
    chunks, size_bytes = [], 0
    stream = request.stream()
    deadline_s = asyncio.get_running_loop().time() + limits.timeout_s
    try:
        while True:
            try:
                async with asyncio.timeout_at(_next_chunk_deadline(limits, deadline_s)):
                    chunk = await anext(stream, None)
            except TimeoutError:
                raise _too_slow(limits) from None
            if chunk is None:
                return b"".join(chunks)
            size_bytes += len(chunk)
            if size_bytes > limits.max_bytes:
                raise _too_large(limits)
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone from None


def _next_chunk_deadline(limits: BodyLimits, deadline_s: float) -> float:
    return min(asyncio.get_running_loop().time() + limits.idle_timeout_s, deadline_s)


def _check_json_content_type(content_type: str | None) -> None:
    """application/json, with parameters if any (a charset must be UTF-8, JSON's only one)."""
    media_type, *params = (content_type or "").split(";")
    charsets = [
        v for k, _, v in (p.partition("=") for p in params) if k.strip().lower() == "charset"
    ]
    utf8 = all(c.strip().strip('"').lower() in ("utf-8", "utf8") for c in charsets)
    if media_type.strip().lower() == "application/json" and utf8:
        return
    got = f"'{content_type[:MAX_ECHO_CHARS]}'" if content_type else "none"
    raise UnsupportedMediaType(
        f"The Content-Type header must be application/json (UTF-8), got {got}; send the JSON "
        "body with the header 'Content-Type: application/json'."
    )


def _too_large(limits: BodyLimits) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body must be at most {limits.max_bytes} bytes.")


def _too_slow(limits: BodyLimits) -> RequestTimeout:
    return RequestTimeout(
        f"The request body stopped arriving: it must make progress every "
        f"{limits.idle_timeout_s:g} s and be complete within {limits.timeout_s:g} s."
    )
