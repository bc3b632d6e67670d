"""Structured outputs end to end on CPU: a real `orbit serve` of SmolLM2-135M, the official
openai client. Every constrained answer must parse and validate against its schema (checked
with jsonschema), whatever the small model would have said unconstrained."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from orbit.http.schema_check import COMPILE_TIMEOUT_S
from tests.server import ServerProcess

PROMPT = "Describe one fictional person."

# Schemas of many shapes: nested objects, enums, arrays with bounds, numbers with bounds.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"enum": ["Paris", "Lima", "Oslo"]},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["first", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            },
            "happy": {"type": "boolean"},
        },
        "required": ["colors", "happy"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
            "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "nickname": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["height_m", "score", "nickname"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["id"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "string", "maxLength": 20},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
    {"const": "fixed"},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "kind": {"const": "circle"},
            "radius": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["kind", "radius"],
        "additionalProperties": False,
    },
    {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "string", "enum": ["none"]},
        ]
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 20},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "genres": {
                "type": "array",
                "items": {"enum": ["drama", "comedy", "horror"]},
                "minItems": 1,
                "maxItems": 2,
                "uniqueItems": True,
            },
        },
        "required": ["title", "rating", "genres"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
            "currency": {"enum": ["EUR", "USD"]},
            "discount": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        },
        "required": ["price", "currency", "discount"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "string", "enum": ["north", "south", "east", "west"]},
        "minItems": 3,
        "maxItems": 3,
    },
]


class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: str = Field(pattern="^(cat|dog|fish)$")
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def server(smollm2_path, package_cache):
    pkg = package_cache(smollm2_path, 1, max_seq_len=512, max_batch=8, max_step_tokens=64)
    with ServerProcess(pkg, "--kv-cache-mb", "128") as s:
        s.model = _client(s).models.list().data[0].id
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def _ask_all(server, requests: list[dict]) -> list:
    """The requests at once, so the server batches them."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        return await asyncio.gather(*(client.chat.completions.create(**r) for r in requests))


def _request(server, schema: dict, **extra) -> dict:
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "response_format": _schema_format(schema),
        "max_tokens": 120,
        **extra,
    }


def test_json_schema_answers_validate(server):
    greedy = [_request(server, s, temperature=0) for s in SCHEMAS]
    sampled = [_request(server, SCHEMAS[2], temperature=1.0, seed=7, n=2)]
    answers = asyncio.run(_ask_all(server, greedy + sampled))  # 22 sequences, 8 at a time
    schemas = [*SCHEMAS, SCHEMAS[2]]
    for schema, answer in zip(schemas, answers):
        for choice in answer.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_answer_parses(server):
    answer = _client(server).chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_streamed_answer_is_the_whole_answer(server):
    client = _client(server)
    whole = client.chat.completions.create(**_request(server, SCHEMAS[0], temperature=0))
    stream = client.chat.completions.create(
        **_request(server, SCHEMAS[0], temperature=0), stream=True
    )
    parts, finish = [], None
    for chunk in stream:
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "stop"


def test_parse_into_a_pydantic_model(server):
    completion = _client(server).beta.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        temperature=0,
        max_tokens=100,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert Pet.model_validate_json(completion.choices[0].message.content) == pet


def test_completions_take_response_format_too(server):
    """An Orbit extension: the same constraint on /v1/completions."""
    answer = _client(server).completions.create(
        model=server.model,
        prompt="A fictional person, as JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={"response_format": _schema_format(SCHEMAS[0])},
    )
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMAS[0])


def test_an_unsupported_schema_is_a_400_naming_it(server):
    body = _request(server, {"type": "object", "properties": {"a": {"type": "frobnicate"}}})
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "frobnicate" in error["message"]


def test_a_schema_too_costly_to_compile_is_a_400_and_other_streams_flow(server):
    """A 30-byte pattern whose grammar takes 11 s to compile (2-core test machine) is refused
    at the API server's limit, while a stream already running keeps getting its tokens: the
    ranks never see the schema. (Before the limit, the ranks compiled it in the step, and every
    stream waited those 11 s.)"""
    client = _client(server)
    stream = client.completions.create(
        model=server.model,
        prompt="Once upon a time",
        max_tokens=120,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    arrivals: list[float] = []
    reader = threading.Thread(target=lambda: arrivals.extend(time.monotonic() for _ in stream))
    reader.start()
    while len(arrivals) < 3:
        time.sleep(0.05)
    slow = {"type": "string", "pattern": "^(.{1,30}x){1,40}$"}
    started = time.monotonic()
    resp = httpx.post(server.url + "/v1/chat/completions", json=_request(server, slow), timeout=60)
    took_s = time.monotonic() - started
    reader.join()
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert f"did not compile within {COMPILE_TIMEOUT_S:g} s" in error["message"]
    assert took_s < COMPILE_TIMEOUT_S + 3.0
    assert arrivals[-1] > started + took_s  # the stream ran across the refusal...
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < COMPILE_TIMEOUT_S  # ...and never waited for the compile


@pytest.mark.slow
def test_tp3_ranks_agree_under_a_grammar(server, smollm2_path, package_cache):
    """SmolLM2 (9 heads) at TP 3: each rank masks with its own matcher and draws its own token
    for the next step's input. Were the ranks' masks or draws to differ, their inputs would and
    the output would drift from TP 1's; greedy, it is TP 1's answer, and it validates."""
    pkg = package_cache(smollm2_path, 3, max_batch=4, max_seq_len=512)
    with ServerProcess(pkg, "--kv-cache-mb", "64") as tp3:
        tp3.model = _client(tp3).models.list().data[0].id
        got = _client(tp3).chat.completions.create(**_request(tp3, SCHEMAS[1], temperature=0))
    expected = _client(server).chat.completions.create(
        **_request(server, SCHEMAS[1], temperature=0)
    )
    content = got.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMAS[1])
    assert content == expected.choices[0].message.content
