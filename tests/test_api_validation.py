"""The HTTP layer against an in-test engine: validation and error shapes, SSE framing, n>1,
stop strings, logprobs, disconnects, metrics and the official openai client."""

import asyncio
import json
import math
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from orbit.http.app import create_app
from orbit.http.core_client import EngineError, EngineNotReady, RequestTooLarge
from orbit.http.metrics import Counter, FrontendMetrics, RateWindow
from proto import core_pb2

MODEL = "smollm2-test"
REPLY = "Hello world! héllo 日本語 🚀 The end."
MAX_SEQ_LEN = 96
FAILURE_DETAIL = "rank 1 at 10.0.0.7:29500 died"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


class FakeEngine:
    """Generates REPLY's tokens (words rotated by the seed) and then EOS, one per output as the
    engine core sends them; the logprob of the i-th token is -(i % 3) - 0.5 and its
    alternatives are the next token ids, the last one at -inf. Records every sequence started
    and every one closed before it finished. Its metrics are the app's own (one API server)."""

    model_name = "fake"
    max_batch = 8
    max_seq_len = MAX_SEQ_LEN

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.ready = True
        self.token_delay_s = 0.0
        self.fail_after_tokens: int | None = None
        self.failure: Exception = EngineError(FAILURE_DETAIL)
        self.started: list[tuple[str, list[int], object]] = []
        self.aborted: list[str] = []
        self.first_token = asyncio.Event()
        self.metrics = FrontendMetrics()

    def is_ready(self) -> bool:
        return self.ready

    async def metrics_text(self) -> str:
        own = self.metrics.render()
        return own + "# TYPE orbit_engine_queue_length gauge\norbit_engine_queue_length 0\n"

    def reply_ids(self, seed: int | None) -> list[int]:
        words = REPLY.split(" ")
        shift = (seed or 0) % len(words)
        text = " ".join(words[shift:] + words[:shift])
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def generate(self, request_id, prompt_ids, params):
        self.started.append((request_id, list(prompt_ids), params))
        finished = False
        try:
            for i, token_id in enumerate(self._tokens(params)):
                if self.fail_after_tokens is not None and i >= self.fail_after_tokens:
                    raise self.failure
                await asyncio.sleep(self.token_delay_s)
                finish = self._finish_reason(i, token_id, params)
                yield self._event(i, token_id, params.logprobs, finish)
                self.first_token.set()
                if finish:
                    finished = True
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)

    def _tokens(self, params):
        reply = self.reply_ids(params.seed)
        i = 0
        while True:
            if i < len(reply):
                yield reply[i]
            else:
                yield reply[i % len(reply)] if params.ignore_eos else self.eos_token_ids[0]
            i += 1

    def _finish_reason(self, i, token_id, params):
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return core_pb2.FINISH_STOP
        return core_pb2.FINISH_LENGTH if i + 1 >= params.max_tokens else core_pb2.FINISH_NONE

    def _event(self, i, token_id, k, finish):
        out = core_pb2.SeqOutput(token_ids=[token_id], finish=finish)
        if k is None:
            return out
        logprob = -(i % 3) - 0.5
        top = [(token_id, logprob)] + [(token_id + j, logprob - j) for j in range(1, k)]
        if k >= 2:
            top[-1] = (top[-1][0], -math.inf)
        out.logprobs.append(logprob)
        out.top.add(token_ids=[t for t, _ in top[:k]], logprobs=[lp for _, lp in top[:k]])
        return out


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture
def app(engine):
    return create_app(engine, MODEL, metrics=engine.metrics)


@pytest.fixture
async def client(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def reply_text(engine, seed=None, max_tokens=None) -> str:
    ids = engine.reply_ids(seed)[:max_tokens]
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def assert_error(resp, status: int, param, code=None, message=None, err_type=None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["code"] == code
    assert error["type"] == (
        err_type or ("invalid_request_error" if status < 500 else "server_error")
    )
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"] and "0x" not in error["message"]
    if message is not None:
        assert error["message"] == message
    return error


def sse_events(body: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


def metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- validation: every bad input is a 400 with the OpenAI shape and the offending param ----

COMPLETION_BAD = [
    ({"prompt": ""}, "prompt", "prompt must not be empty."),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [[]]}, "prompt", None),
    ({"prompt": ["a"] * 65}, "prompt", None),  # a batch holds at most 64 prompts
    ({"prompt": ["a"] * 8, "n": 9}, "n", None),  # and 64 choices
    ({"prompt": ["a", ""]}, "prompt", None),
    ({"prompt": [1, "a"]}, "prompt", None),
    ({"prompt": [10**9]}, "prompt", None),
    ({"prompt": None}, "prompt", None),
    ({}, "prompt", None),
    (
        {"prompt": "x", "temperature": -1},
        "temperature",
        "temperature must be non-negative, got -1.0.",
    ),
    ({"prompt": "x", "temperature": "hot"}, "temperature", None),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0."),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5."),
    ({"prompt": "x", "top_k": -1}, "top_k", None),
    ({"prompt": "x", "n": 0}, "n", None),
    ({"prompt": "x", "n": 17}, "n", None),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens", None),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop", None),
    ({"prompt": "x", "stop": "s" * 257}, "stop", None),
    ({"prompt": "x", "stop": ""}, "stop", None),
    ({"prompt": "x", "stop": 5}, "stop", None),
    ({"prompt": "x", "logprobs": 21}, "logprobs", None),
    ({"prompt": "x", "logprobs": -1}, "logprobs", None),
    ({"prompt": "x", "echo": True}, "echo", None),
    ({"prompt": "x", "suffix": "y"}, "suffix", None),
    ({"prompt": "x", "best_of": 2}, "best_of", None),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", None),
    ({"prompt": "x", "frequency_penalty": -1}, "frequency_penalty", None),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", None),
    ({"prompt": "x", "seed": 2**70}, "seed", None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
    ({"prompt": "x", "stream": "maybe"}, "stream", None),
]


@pytest.mark.parametrize("body,param,message", COMPLETION_BAD)
async def test_completions_bad_input_is_400(client, engine, body, param, message):
    resp = await client.post("/v1/completions", json={"model": MODEL, **body})
    assert_error(resp, 400, param, message=message)
    assert engine.started == []


CHAT_BAD = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    ({"messages": "hi"}, "messages"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        "response_format.json_schema.schema",
    ),
    ({"temperature": float("nan")}, "temperature"),
]


@pytest.mark.parametrize("body,param", CHAT_BAD)
async def test_chat_bad_input_is_400(client, engine, body, param):
    full = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    resp = await client.post("/v1/chat/completions", content=json.dumps(full), headers=JSON)
    assert_error(resp, 400, param)
    assert engine.started == []


FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "echo",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "ignore_eos", "best_of",
    "suffix", "tools", "response_format", "tool_choice", "parallel_tool_calls",
]  # fmt: skip
ODD_VALUES = [None, -1, 0, 10**30, -(10**30), 1.5, "x", "", True, [], {}, [[[]]], {"a": [1]}, "∞"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_odd_values_in_any_field_never_cause_a_server_error(client, route):
    base = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name in FIELDS:
        for value in ODD_VALUES:
            resp = await client.post(route, json={**base, name: value})
            assert resp.status_code in (200, 400, 404), (name, value, resp.text)
            if resp.status_code != 200:
                assert_error(
                    resp,
                    resp.status_code,
                    resp.json()["error"]["param"],
                    code=resp.json()["error"]["code"],
                )


async def test_missing_messages_is_400(client):
    resp = await client.post("/v1/chat/completions", json={"model": MODEL})
    assert_error(resp, 400, "messages", message="Missing required parameter: 'messages'.")


@pytest.mark.parametrize(
    "raw",
    [b"{", b"", b"[1, 2]", b'"text"', b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000, b"null"],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_malformed_body_is_400_not_422(client, route, raw):
    resp = await client.post(route, content=raw, headers={"content-type": "application/json"})
    assert_error(resp, 400, None)


# ---- hostile input: the wire's limits, text that is not Unicode, bodies that are not JSON ----

# Request field -> the SamplingParams field of proto/wire.proto that carries it to the ranks.
WIRE_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "logprobs": "num_logprobs",
    "top_logprobs": "num_logprobs",
}


def wire_range(wire_field: str) -> tuple[float, float]:
    """The values a wire_pb2.SamplingParams field can carry without overflow."""
    from google.protobuf.descriptor import FieldDescriptor as F

    from proto import wire_pb2

    kind = wire_pb2.SamplingParams.DESCRIPTOR.fields_by_name[wire_field].type
    # A signed request seed reaches the wire as its 64 bits, so int64 fits a uint64 field.
    signed_ok = wire_field == "seed"
    return {
        F.TYPE_FLOAT: (-3.4028234e38, 3.4028234e38),
        F.TYPE_UINT32: (0, 2**32 - 1),
        F.TYPE_INT32: (-(2**31), 2**31 - 1),
        F.TYPE_UINT64: (-(2**63) if signed_ok else 0, 2**64 - 1),
    }[kind]


def numeric_properties(schema: dict) -> dict[str, dict]:
    """Top-level body fields whose schema (or a member of its anyOf) is a number or integer."""
    out = {}
    for name, prop in schema["properties"].items():
        for node in prop.get("anyOf", [prop]):
            if node.get("type") in ("number", "integer"):
                out[name] = node
    return out


def body_schema(openapi: dict, route: str) -> dict:
    return openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]


async def test_schema_bounds_every_numeric_field_within_its_wire_type(client, engine):
    openapi = (await client.get("/openapi.json")).json()
    for route in ("/v1/completions", "/v1/chat/completions"):
        fields = numeric_properties(body_schema(openapi, route))
        assert {"temperature", "top_p", "top_k", "seed", "n", "max_tokens"} <= set(fields)
        for name, node in fields.items():
            low = node.get("minimum", node.get("exclusiveMinimum"))
            high = node.get("maximum", node.get("exclusiveMaximum"))
            assert low is not None and high is not None, (route, name, node)
            if name in WIRE_FIELDS:
                wire_low, wire_high = wire_range(WIRE_FIELDS[name])
                assert wire_low <= low and high <= wire_high, (route, name, node)
            if name.startswith("max_"):  # this server's context, not just the type's range
                assert high == MAX_SEQ_LEN - 1
    props = body_schema(openapi, "/v1/completions")["properties"]
    assert props["model"]["anyOf"][0]["enum"] == [MODEL]
    [token_ids] = [
        m for m in props["prompt"]["anyOf"] if m.get("items", {}).get("type") == "integer"
    ]
    assert token_ids["items"]["maximum"] == len(engine.tokenizer) - 1


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_every_value_past_a_published_bound_is_400_naming_the_field(client, engine, route):
    openapi = (await client.get("/openapi.json")).json()
    base = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "logprobs": True}
    if route == "/v1/completions":
        base["logprobs"] = None
    for name, node in numeric_properties(body_schema(openapi, route)).items():
        exact = int if node["type"] == "integer" else float  # JSON numbers may come as floats
        bound = {key: exact(value) for key, value in node.items() if "imum" in key}
        step = 1 if node["type"] == "integer" else 0.5
        outside = [
            bound["maximum"] + step if "maximum" in bound else bound["exclusiveMaximum"],
            bound["minimum"] - step if "minimum" in bound else bound["exclusiveMinimum"],
        ]
        for value in outside:
            resp = await client.post(route, json={**base, name: value}, headers=JSON)
            assert_error(resp, 400, name)
    assert engine.started == []


# Escaped lone surrogates: valid JSON, but not text (UTF-8 cannot encode them).
SURROGATES = [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\udfff"]}', "prompt[0]"),
    ("/v1/completions", '{"prompt": "x", "stop": "\\ud800"}', "stop"),
    ("/v1/completions", '{"prompt": "x", "stop": ["ok", "\\udbff"]}', "stop[1]"),
    ("/v1/completions", '{"prompt": "x", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "x", "user": "\\ud800"}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "x"}]}', None),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        "messages[0].content[0].text",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}',
        "stop",
    ),
]


@pytest.mark.parametrize("route,raw,param", SURROGATES)
async def test_lone_surrogates_are_400_naming_the_field(client, engine, route, raw, param):
    param = param or ("messages[0].role" if '"role": "\\u' in raw else "messages[0].content")
    resp = await client.post(route, content=raw, headers=JSON)
    error = assert_error(resp, 400, param)
    assert "surrogate" in error["message"]
    assert engine.started == []
    # The same escape as half of a pair is text (an emoji), not an error of this kind.
    paired = raw.replace("\\ud800", "\\ud83d\\ude80").replace("\\udfff", "\\ud83d\\ude80")
    paired = paired.replace("\\udbff", "\\ud83d\\ude80").replace("\\udc00", "\\ud83d\\ude80")
    resp = await client.post(route, content=paired, headers=JSON)
    assert resp.status_code < 500 and "surrogate" not in resp.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_bodies_not_sent_as_json_are_415(client, engine, route):
    body = json.dumps({"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    refused = [
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "application/jsonx",
    ]
    for content_type in refused:
        headers = {"content-type": content_type} if content_type else {}
        resp = await client.post(route, content=body, headers=headers)
        error = assert_error(resp, 415, None, code="unsupported_media_type")
        assert "Content-Type" in error["message"] and "application/json" in error["message"]
    assert engine.started == []
    accepted = ["application/json", "Application/JSON", 'application/json; charset="UTF-8"']
    for content_type in accepted:
        resp = await client.post(route, content=body, headers={"content-type": content_type})
        assert resp.status_code == 200, (content_type, resp.text)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_text_too_long_for_the_context_is_refused_without_tokenizing(client, engine, route):
    text = "many words " * (700 * 1024)  # 7.5 MiB: seconds to tokenize
    chat = route == "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    started = time.monotonic()
    resp = await client.post(route, json=body)
    took_s = time.monotonic() - started
    error = assert_error(resp, 400, "messages" if chat else "prompt")
    assert error["message"].startswith(
        f"This model's maximum context length is {MAX_SEQ_LEN} tokens. However, your request "
        "has at least "
    )
    assert took_s < 2.0  # parsing and rendering only; tokenizing alone takes several seconds
    assert engine.started == []


async def test_prompt_longer_than_context_uses_vllm_wording(client, engine):
    prompt_ids = [42] * MAX_SEQ_LEN
    resp = await client.post("/v1/completions", json={"prompt": prompt_ids})
    message = (
        f"This model's maximum context length is {MAX_SEQ_LEN} tokens. However, your request "
        f"has {MAX_SEQ_LEN} input tokens. Please reduce the length of the input messages."
    )
    assert_error(resp, 400, "prompt", message=message)


async def test_max_tokens_too_large_uses_vllm_wording(client):
    resp = await client.post("/v1/completions", json={"prompt": [42] * 10, "max_tokens": 90})
    message = (
        "'max_tokens' or 'max_completion_tokens' is too large: 90. This model's maximum context "
        f"length is {MAX_SEQ_LEN} tokens and your request has 10 input tokens (90 > 96 - 10)."
    )
    assert_error(resp, 400, "max_tokens", message=message)


async def test_chat_context_errors_name_the_chat_fields(client):
    long = {"role": "user", "content": "word " * 200}
    resp = await client.post("/v1/chat/completions", json={"messages": [long]})
    assert_error(resp, 400, "messages")
    short = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    resp = await client.post("/v1/chat/completions", json=short)
    error = assert_error(resp, 400, "max_completion_tokens")
    assert error["message"].startswith(
        "'max_tokens' or 'max_completion_tokens' is too large: 1000."
    )


async def test_unknown_fields_are_ignored(client):
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "u", "foo": {"bar": 1}}
    )
    assert resp.status_code == 200


async def test_body_over_limit_is_413(client):
    resp = await client.post("/v1/completions", content=b" " * (8 * 1024 * 1024 + 1), headers=JSON)
    assert_error(resp, 413, None, code="request_too_large")

    async def chunked():  # no content-length: the limit is enforced while reading
        for _ in range(9):
            yield b" " * (1024 * 1024)

    resp = await client.post("/v1/completions", content=chunked(), headers=JSON)
    assert_error(resp, 413, None, code="request_too_large")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_unknown_model_is_404(client, route):
    body = {"model": "gpt-4", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    resp = await client.post(route, json=body)
    assert_error(
        resp, 404, "model", code="model_not_found", message="The model `gpt-4` does not exist."
    )


async def test_unknown_route_and_wrong_method_keep_the_error_shape(client):
    assert_error(await client.get("/v1/nothing"), 404, None)
    assert_error(await client.get("/v1/completions"), 405, None)


# ---- readiness and engine failures ----


async def test_health_follows_engine_readiness(client, engine):
    resp = await client.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    engine.ready = False
    resp = await client.get("/health")
    assert_error(resp, 503, None, code="service_unavailable")


async def test_not_ready_is_503_with_retry_after(client, engine):
    engine.ready = False
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert_error(resp, 503, None, code="service_unavailable")
    assert resp.headers["retry-after"]
    assert engine.started == []


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_failure_before_first_token_is_503(client, engine, stream):
    engine.fail_after_tokens = 0
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    error = assert_error(resp, 503, None, code="service_unavailable")
    assert "10.0.0.7" not in error["message"]


async def test_engine_not_ready_raised_by_generate_is_503(client, engine):
    engine.fail_after_tokens, engine.failure = 0, EngineNotReady("warming up")
    resp = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert_error(resp, 503, None, code="service_unavailable")


@pytest.mark.parametrize("stream", [False, True])
async def test_request_the_engine_can_never_fit_is_400(client, engine, stream):
    engine.fail_after_tokens = 0
    engine.failure = RequestTooLarge("the sequence needs 9 KV pages; the pool has 4")
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    error = assert_error(resp, 400, None)
    assert "9 KV pages" in error["message"]


async def test_engine_failure_mid_stream_sends_error_event_then_done(client, engine):
    engine.fail_after_tokens = 3
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["code"] == "service_unavailable"
    assert "10.0.0.7" not in events[-2]
    metrics = (await client.get("/metrics")).text
    assert metric(metrics, "orbit_request_errors_total") == 1


async def test_unexpected_exception_is_generic_500(engine, app):
    engine.fail_after_tokens, engine.failure = 0, RuntimeError("secret at 0x7f00deadbeef")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        resp = await c.post("/v1/completions", json={"prompt": "x"})
    error = assert_error(resp, 500, None, code="internal_error")
    assert "secret" not in error["message"]


# ---- successful generation ----


async def test_completion_response_shape_and_usage(client, engine):
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi"})
    assert resp.status_code == 200
    body = resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": reply_text(engine),
        "logprobs": None,
        "finish_reason": "stop",
    }
    prompt_ids = engine.tokenizer("Say hi").input_ids
    completion_tokens = len(engine.reply_ids(None)) + 1  # the EOS token counts
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(prompt_ids) + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    [(request_id, sent_ids, params)] = engine.started
    assert request_id == body["id"] + "-0" and sent_ids == prompt_ids
    assert params.max_tokens == MAX_SEQ_LEN - len(prompt_ids)  # default: the rest of the context


async def test_sampling_fields_reach_the_engine(client, engine):
    body = {
        "prompt": [5, 6],
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "seed": 3,
        "max_tokens": 4,
    }
    body |= {"ignore_eos": True, "logprobs": 2}
    await client.post("/v1/completions", json=body)
    [(_, ids, params)] = engine.started
    assert ids == [5, 6]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0, 0.5, 7, 3)
    assert (params.max_tokens, params.ignore_eos, params.logprobs) == (4, True, 2)


async def test_max_tokens_finishes_with_length(client, engine):
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    [choice] = resp.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == reply_text(engine, max_tokens=3)
    assert resp.json()["usage"]["completion_tokens"] == 3


async def test_chat_applies_template_once_without_doubling_special_tokens(client, engine):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    resp = await client.post("/v1/chat/completions", json={"messages": messages})
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": reply_text(engine)}
    tok = engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "a\nb"}], add_generation_prompt=True, tokenize=False
    )
    [(_, sent_ids, _)] = engine.started
    assert sent_ids == tok(text, add_special_tokens=False).input_ids
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert sent_ids[0] == im_start and sent_ids[1] != im_start
    assert body["usage"]["prompt_tokens"] == len(sent_ids)


async def test_developer_role_is_rendered_as_system(client, engine):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    await client.post("/v1/chat/completions", json={"messages": messages})
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = engine.tokenizer.apply_chat_template(
        as_system, add_generation_prompt=True, tokenize=False
    )
    assert engine.started[0][1] == engine.tokenizer(text, add_special_tokens=False).input_ids


async def test_completion_stream_framing(client, engine):
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == reply_text(engine)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_chat_stream_starts_with_role_and_ends_with_usage(client, engine):
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    body["stream_options"] = {"include_usage": True}
    resp = await client.post("/v1/chat/completions", json=body)
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, last = chunks
    assert all(c["usage"] is None for c in content)
    assert (
        last["choices"] == []
        and last["usage"]["completion_tokens"] == len(engine.reply_ids(None)) + 1
    )
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == reply_text(engine)
    assert content[-1]["choices"][0]["finish_reason"] == "stop"


async def test_n2_runs_two_seeded_sequences(client, engine):
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "n": 2, "seed": 5, "temperature": 0}
    )
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    texts = [c["text"] for c in body["choices"]]
    assert (
        texts == [reply_text(engine, seed=5), reply_text(engine, seed=6)] and texts[0] != texts[1]
    )
    assert sorted(r for r, _, _ in engine.started) == [body["id"] + "-0", body["id"] + "-1"]
    assert [p.seed for _, _, p in sorted(engine.started)] == [5, 6]
    expected = sum(len(engine.reply_ids(s)) + 1 for s in (5, 6))
    assert body["usage"]["completion_tokens"] == expected
    # Same seed, same output, choice by choice: choice 1 equals a single request seeded 6.
    single = await client.post("/v1/completions", json={"prompt": "x", "seed": 6})
    assert single.json()["choices"][0]["text"] == texts[1]


async def test_n2_stream_interleaves_both_choices(client, engine):
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2, "seed": 1}
    events = sse_events((await client.post("/v1/chat/completions", json=body)).text)
    chunks = [json.loads(e) for e in events[:-1]]
    for index, seed in ((0, 1), (1, 2)):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == reply_text(engine, seed=seed)
        assert mine[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_truncates_and_frees_the_sequence(client, engine, stream):
    full = reply_text(engine)
    stop = "日本"  # split across several byte-level tokens
    body = {"prompt": "x", "stop": ["never", stop], "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    if stream:
        chunks = [json.loads(e) for e in sse_events(resp.text)[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, finish = resp.json()["choices"][0]["text"], resp.json()["choices"][0]["finish_reason"]
    assert text == full[: full.index(stop)] and finish == "stop"
    assert engine.aborted == [engine.started[0][0]]  # closed before the engine finished it


async def test_completion_logprobs_shape(client, engine):
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "logprobs": 3, "max_tokens": 12}
    )
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert lp["token_logprobs"][:3] == [-0.5, -1.5, -2.5]
    assert all(len(top) <= 4 and lp["tokens"][i] in top for i, top in enumerate(lp["top_logprobs"]))
    assert -9999.0 in lp["top_logprobs"][0].values()  # -inf is not valid JSON
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert any(t.startswith("bytes:\\x") for t in lp["tokens"])  # partial characters


async def test_completion_logprobs_zero_lists_only_the_sampled_token(client):
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "logprobs": 0, "max_tokens": 2}
    )
    lp = resp.json()["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_shape(client, engine, stream):
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    resp = await client.post("/v1/chat/completions", json={**body, "stream": stream})
    if stream:
        chunks = [json.loads(e) for e in sse_events(resp.text)[:-1]]
        content = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    else:
        content = resp.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(engine.reply_ids(None)) + 1
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
    reply_bytes = b"".join(bytes(e["bytes"]) for e in content[:-1])  # the last one is EOS
    assert reply_bytes.decode("utf-8") == reply_text(engine)


async def test_stream_and_non_stream_agree(client):
    body = {"prompt": "x", "seed": 2, "max_tokens": 9, "logprobs": 1}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]


# ---- client disconnects ----


def http_scope(path: str, spec_version: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }


async def call_asgi(app, path: str, body: dict, disconnect: asyncio.Event) -> list[dict]:
    """Drive the app like a server whose client goes away once `disconnect` is set."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if pending:
            return pending.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(http_scope(path, "2.3"), receive, send), timeout=5)
    return sent


async def aborted_count(app) -> float:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return metric((await c.get("/metrics")).text, "orbit_aborted_requests_total")


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_every_choice(app, engine, stream):
    engine.token_delay_s = 0.01
    body = {"prompt": "x", "max_tokens": 80, "ignore_eos": True, "n": 2, "stream": stream}
    sent = await call_asgi(app, "/v1/completions", body, engine.first_token)
    await asyncio.sleep(0.05)  # let the cancelled pumps finish closing
    assert len(engine.started) == 2
    assert sorted(engine.aborted) == sorted(r for r, _, _ in engine.started)
    assert await aborted_count(app) == 1
    if not stream:
        assert sent[0]["status"] == 499


async def test_disconnect_while_waiting_for_first_token(app, engine):
    engine.token_delay_s = 0.2
    disconnect = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, disconnect.set)
    await call_asgi(app, "/v1/completions", {"prompt": "x", "stream": True}, disconnect)
    assert engine.aborted == [engine.started[0][0]]
    assert await aborted_count(app) == 1


async def test_failed_send_aborts_at_once(app, engine):
    """ASGI 2.4 servers report a gone client by failing send(); the sequence must be aborted
    then, not whenever the garbage collector reaches the abandoned response."""
    engine.token_delay_s = 0.01
    body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 50, "ignore_eos": True})
    pending = [{"type": "http.request", "body": body.encode(), "more_body": False}]
    body_messages = 0

    async def receive():
        return pending.pop() if pending else await asyncio.Event().wait()

    async def send(message):
        nonlocal body_messages
        body_messages += message["type"] == "http.response.body"
        if body_messages >= 2:
            raise OSError("connection reset")

    await asyncio.wait_for(app(http_scope("/v1/completions", "2.4"), receive, send), timeout=5)
    await asyncio.sleep(0.05)
    assert engine.aborted == [engine.started[0][0]]
    assert await aborted_count(app) == 1


# ---- metrics, models, version, auth ----


async def test_metrics_exposes_frontend_and_engine_series(client):
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    await client.post("/v1/completions", json={"prompt": ""})
    text = (await client.get("/metrics")).text
    assert metric(text, 'orbit_requests_total{route="/v1/completions",status="200"}') == 1
    assert metric(text, 'orbit_requests_total{route="/v1/completions",status="400"}') == 1
    assert metric(text, "orbit_request_errors_total") == 1
    assert metric(text, "orbit_generated_tokens_total") == 4
    assert metric(text, "orbit_prompt_tokens_total") == 1
    assert metric(text, "orbit_time_to_first_token_seconds_count") == 1
    assert metric(text, "orbit_inter_token_latency_seconds_count") == 3
    assert metric(text, 'orbit_inter_token_latency_seconds_bucket{le="+Inf"}') == 3
    assert metric(text, "orbit_generated_tokens_per_second") > 0
    assert "orbit_engine_queue_length 0" in text
    assert "# TYPE orbit_time_to_first_token_seconds histogram" in text


def test_rate_window_forgets_old_tokens():
    now = [100.0]
    window = RateWindow(window_s=10.0, clock=lambda: now[0])
    window.add(30)
    now[0] += 5
    window.add(20)
    assert window.rate() == 5.0
    now[0] += 6  # the first 30 are now older than the window
    assert window.rate() == 2.0


def test_label_values_are_escaped():
    counter = Counter("c_total", "help")
    counter.inc(route='a"b\\c\nd')
    assert counter.render()[-1] == 'c_total{route="a\\"b\\\\c\\nd"} 1.0'


async def test_models_and_version(client):
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [(MODEL, "model")]
    assert "version" in (await client.get("/version")).json()


async def test_api_key_guards_every_route_but_health(engine):
    app = create_app(engine, MODEL, api_key="s3cret")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert (await c.get("/health")).status_code == 200
        assert_error(await c.get("/v1/models"), 401, None, code="invalid_api_key")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(
            await c.post("/v1/completions", json={"prompt": "x"}, headers=wrong),
            401,
            None,
            code="invalid_api_key",
        )
        right = {"Authorization": "Bearer s3cret"}
        assert (await c.get("/v1/models", headers=right)).status_code == 200


async def test_api_key_guards_the_schema_and_turns_the_docs_off(engine):
    app = create_app(engine, MODEL, api_key="s3cret")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert_error(await c.get("/openapi.json"), 401, None, code="invalid_api_key")
        right = {"Authorization": "Bearer s3cret"}
        schema = await c.get("/openapi.json", headers=right)
        assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
        assert "/openapi.json" not in schema.json()["paths"]
        for docs in ("/docs", "/redoc"):
            assert_error(await c.get(docs, headers=right), 404, None)


# ---- the official openai client ----


async def test_openai_client_completions_and_chat(openai_client, engine):
    completion = await openai_client.completions.create(
        model=MODEL, prompt="hi", max_tokens=5, logprobs=2
    )
    assert completion.choices[0].text == reply_text(engine, max_tokens=5)
    assert completion.choices[0].logprobs.token_logprobs[0] == -0.5
    chat = await openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        seed=0,
        logprobs=True,
        top_logprobs=1,
    )
    assert [c.message.content for c in chat.choices] == [
        reply_text(engine, 0),
        reply_text(engine, 1),
    ]
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.5


async def test_openai_client_streams(openai_client, engine):
    stream = await openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        stop=["world"],
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello "
    assert chunks[-1].usage.completion_tokens == 2  # "Hello", " world"
    assert engine.aborted == [engine.started[0][0]]


async def test_openai_client_raises_on_stream_error_and_bad_request(openai_client, engine):
    with pytest.raises(openai.BadRequestError) as bad:
        await openai_client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.param == "temperature" and bad.value.code is None
    with pytest.raises(openai.NotFoundError):
        await openai_client.completions.create(model="nope", prompt="x")
    engine.fail_after_tokens = 2
    stream = await openai_client.completions.create(model=MODEL, prompt="x", stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass


async def test_warm_up_reaches_neither_the_engine_nor_the_metrics(app, engine, client):
    """orbit/http/server.py warms a fresh API server (parsing, both lanes, the chat template,
    the tokenizer, Starlette's streaming backend) before it serves: nothing of it may look like
    a request, to the engine or to /metrics, and the app serves as before afterwards."""
    await app.state.warm_up()
    m = engine.metrics
    assert engine.started == []
    assert m.ttft.count == m.itl.count == 0
    assert sum(c.value() for c in (m.prompt_tokens, m.generated_tokens, m.errors, m.aborted)) == 0
    assert "orbit_requests_total{" not in m.render()
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}
    )
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    assert len(engine.started) == 1
