"""The OpenAI-compatible HTTP frontend of `orbit serve`.

How a generation request flows. The body is read (bounded), parsed and checked, the prompt is
tokenized off the event loop, and `build_plan` turns it into one SamplingParams per choice. Each of
the n choices is its own engine sequence `{id}-{i}`, run by a pump task that turns TokenEvents into
ChoiceDeltas (text a TextStream released, plus the tokens it covers); `merge` interleaves the pumps.
A finish, a stop string, an error or the reader going away closes the engine iterator, which frees
the sequence. Non-streaming calls race the collection against the client disconnecting. Streaming
calls wait for the first delta before sending headers, so an engine that fails up front still
answers 503; a failure after that becomes an SSE error event followed by `data: [DONE]`.
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
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from orbit import __version__
from orbit.async_streams import close, merge, prepend
from orbit.engine import Engine, EngineError, EngineNotReady, EngineOverloaded, RequestTooLarge
from orbit.errors import (
    ApiError,
    AuthenticationFailed,
    BadRequest,
    InternalError,
    ModelNotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    TooManyRequests,
    install_error_handlers,
)
from orbit.metrics import CLIENT_CLOSED_REQUEST, FrontendMetrics, RequestMetricsMiddleware
from orbit.openai_types import (
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    GeneratedToken,
    GenerationPlan,
    RequestModel,
    build_plan,
    chat_prompt_ids,
    check_chat,
    check_completion,
    completion_prompt_ids,
    parse_request,
    usage,
)
from orbit.textstream import TextStream, TokenTexts

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
SSE_DONE = "data: [DONE]\n\n"
_ROUTES = frozenset(
    {"/health", "/version", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}
)
T = TypeVar("T")
Format = CompletionFormat | ChatFormat
OpenAIRequest = CompletionRequest | ChatCompletionRequest


def create_app(engine: Engine, served_model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The HTTP app. With `api_key`, every route but /health needs `Authorization: Bearer KEY`."""
    frontend = _Frontend(engine, served_model_name)
    app = FastAPI(title="Orbit", version=__version__)
    install_error_handlers(app)
    app.add_exception_handler(_ClientGone, frontend.on_client_gone)
    app.add_middleware(RequestMetricsMiddleware, metrics=frontend.metrics, routes=_ROUTES)
    guard = [Depends(_bearer_check(api_key))] if api_key else []
    app.add_api_route("/health", frontend.health, methods=["GET"])
    app.add_api_route("/version", frontend.version, methods=["GET"], dependencies=guard)
    app.add_api_route("/metrics", frontend.metrics_text, methods=["GET"], dependencies=guard)
    app.add_api_route("/v1/models", frontend.models, methods=["GET"], dependencies=guard)
    app.add_api_route(
        "/v1/completions",
        frontend.completions,
        methods=["POST"],
        dependencies=guard,
        openapi_extra=_json_body(CompletionRequest),
    )
    app.add_api_route(
        "/v1/chat/completions",
        frontend.chat_completions,
        methods=["POST"],
        dependencies=guard,
        openapi_extra=_json_body(ChatCompletionRequest),
    )
    return app


def _json_body(model: type[BaseModel]) -> dict:
    """The request schema for /openapi.json: the routes parse their bodies themselves (to
    answer malformed input with 400, not 422), so FastAPI cannot infer it."""
    schema = model.model_json_schema()
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": _inline_refs(schema, schema.pop("$defs", {}))}
            },
        }
    }


def _inline_refs(node, defs: dict):
    """Replace pydantic's local $refs with their definitions (the request models have no
    recursive types), so the schema stands alone inside the OpenAPI document."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


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
    """New text of one choice and the tokens it covers; the last one has a finish_reason."""

    index: int
    text: str
    tokens: list[GeneratedToken]
    finish_reason: str | None


@dataclass
class _ChoiceResult:
    text: str = ""
    tokens: list[GeneratedToken] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.tokens += delta.tokens
        self.finish_reason = delta.finish_reason or self.finish_reason


@dataclass(frozen=True)
class _Call:
    """One API call: what every response body and chunk of it is stamped with."""

    id: str
    created: int
    model: str
    fmt: Format
    plan: GenerationPlan

    def body(self, object_name: str, choices: list[dict], **extra) -> dict:
        head = {"id": self.id, "object": object_name, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def chunk(self, choices: list[dict], **extra) -> str:
        if self.plan.include_usage:
            extra.setdefault("usage", None)  # as OpenAI: every chunk has usage, null but the last
        return _sse(self.body(self.fmt.chunk_object, choices, **extra))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


class _Frontend:
    """Route handlers over one engine."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.metrics = FrontendMetrics()
        self.token_texts = TokenTexts(engine.tokenizer)
        self.created = int(time.time())
        # One thread: big prompts stay off the event loop, and the tokenizer is never encoding
        # from two threads at once.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="orbit-tokenize")

    async def health(self) -> JSONResponse:
        if not self.engine.is_ready():
            raise ServiceUnavailable("The engine is not ready.")
        return JSONResponse({"status": "ok"})

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": __version__})

    async def models(self) -> JSONResponse:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "orbit",
            "max_model_len": self.engine.max_seq_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def metrics_text(self) -> PlainTextResponse:
        text = self.metrics.render()
        try:
            text += self.engine.metrics_text().rstrip("\n") + "\n"
        except Exception:  # the frontend's own metrics must stay readable when the engine is down
            logger.exception("engine metrics unavailable")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def on_client_gone(self, request: Request, exc: Exception) -> Response:
        self.metrics.aborted.inc()
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def completions(self, request: Request) -> Response:
        started_s = time.monotonic()
        req = await _parse(request, CompletionRequest)
        self._check_model(req.model)
        check_completion(req)
        return await self._generate(request, req, CompletionFormat, started_s)

    async def chat_completions(self, request: Request) -> Response:
        started_s = time.monotonic()
        req = await _parse(request, ChatCompletionRequest)
        self._check_model(req.model)
        check_chat(req)
        return await self._generate(request, req, ChatFormat, started_s)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")

    async def _generate(
        self, request: Request, req: OpenAIRequest, format_cls, started_s: float
    ) -> Response:
        to_ids = (
            chat_prompt_ids if isinstance(req, ChatCompletionRequest) else completion_prompt_ids
        )
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(
            self._tokenize_pool, to_ids, req, self.engine.tokenizer
        )
        plan = build_plan(req, prompt_ids, self.engine.max_seq_len)
        if not self.engine.is_ready():
            raise ServiceUnavailable("The engine is not ready.")
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        fmt = format_cls(self.token_texts, with_logprobs=plan.params[0].logprobs is not None)
        call = _Call(
            f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name, fmt, plan
        )
        choices = [self._choice(call, i, started_s) for i in range(len(plan.params))]
        deltas = merge(choices)
        if plan.stream:
            return await self._stream(request, call, deltas)
        return await self._complete(request, call, deltas)

    async def _choice(
        self, call: _Call, index: int, started_s: float
    ) -> AsyncIterator[ChoiceDelta]:
        """One engine sequence as deltas; closing this generator aborts the sequence."""
        plan = call.plan
        text_stream = TextStream(self.engine.tokenizer, plan.stop)
        events = self.engine.generate(f"{call.id}-{index}", plan.prompt_ids, plan.params[index])
        timer = _TokenTimer(self.metrics, started_s)
        tokens: list[GeneratedToken] = []
        try:
            async for event in events:
                timer.tick()
                tokens.append(_generated(event, text_stream.decoded_chars))
                text, finish = _advance(text_stream, event.token_id, event.finish_reason)
                if text or finish:
                    yield ChoiceDelta(index, text, tokens, finish)
                    tokens = []
                if finish:
                    return
            raise EngineError("the engine ended a sequence without a finish reason")
        finally:
            await close(events)

    async def _complete(self, request: Request, call: _Call, deltas) -> Response:
        try:
            results = await _unless_disconnected(request, _collect(deltas, len(call.plan.params)))
        except (EngineError, RequestTooLarge) as exc:
            raise _engine_refusal(call.id, exc) from None
        choices = [
            call.fmt.choice(i, r.text, r.tokens, r.finish_reason) for i, r in enumerate(results)
        ]
        completion_tokens = sum(len(r.tokens) for r in results)
        body = call.body(
            call.fmt.object_name, choices, usage=usage(len(call.plan.prompt_ids), completion_tokens)
        )
        return JSONResponse(body)

    async def _stream(self, request: Request, call: _Call, deltas) -> Response:
        try:
            first = await _unless_disconnected(request, anext(deltas))
        except (EngineError, RequestTooLarge) as exc:
            raise _engine_refusal(call.id, exc) from None
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        events = self._sse_events(call, prepend(first, deltas))
        return _ClosingStreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _sse_events(
        self, call: _Call, deltas: AsyncIterator[ChoiceDelta]
    ) -> AsyncIterator[str]:
        completion_tokens = 0
        ended = False
        try:
            for choice in call.fmt.opening_choices(len(call.plan.params)):
                yield call.chunk([choice])
            async for d in deltas:
                completion_tokens += len(d.tokens)
                yield call.chunk([call.fmt.delta(d.index, d.text, d.tokens, d.finish_reason)])
            if call.plan.include_usage:
                yield call.chunk([], usage=usage(len(call.plan.prompt_ids), completion_tokens))
            ended = True
        except Exception as exc:  # noqa: BLE001 - any failure must reach the client as an event
            ended = True
            yield _sse(self._stream_error(call.id, exc).body())
        finally:
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


def _advance(
    text_stream: TextStream, token_id: int, engine_finish: str | None
) -> tuple[str, str | None]:
    """Feed one token; returns the text to send and the choice's finish reason, if it ended."""
    text = text_stream.feed(token_id)
    if text_stream.stopped:
        return text, "stop"
    if engine_finish is None:
        return text, None
    text += text_stream.finish()
    return text, "stop" if text_stream.stopped else engine_finish


class _TokenTimer:
    """Feeds TTFT (from request arrival) and inter-token latency of one choice to the metrics."""

    def __init__(self, metrics: FrontendMetrics, started_s: float):
        self._metrics = metrics
        self._last_s = started_s
        self._first = True

    def tick(self) -> None:
        now_s = time.monotonic()
        self._metrics.observe_token(now_s - self._last_s, first=self._first)
        self._last_s, self._first = now_s, False


def _generated(event, text_offset: int) -> GeneratedToken:
    return GeneratedToken(event.token_id, event.logprob, list(event.top_logprobs), text_offset)


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


async def _parse(request: Request, model_cls: type[RequestModel]) -> RequestModel:
    return parse_request(await _read_body(request), model_cls)


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size_bytes = [], 0
    try:
        async for chunk in request.stream():
            size_bytes += len(chunk)
            if size_bytes > MAX_BODY_BYTES:
                raise _too_large()
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone from None
    return b"".join(chunks)


def _too_large() -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body must be at most {MAX_BODY_BYTES} bytes.")
