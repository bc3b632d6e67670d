"""Issue 17's HTTP rough edges against the in-test engine of test_api_validation.py: model
aliases and GET /v1/models/{id}, /tokenize and /detokenize in vLLM's shapes, batched prompts in
/v1/completions, the access log, and /health's 503s kept out of the error count."""

import json
import logging

import httpx
import openai
import pytest

from orbit.http.app import create_app
from tests.test_api_validation import (  # noqa: F401 - fixtures
    MAX_SEQ_LEN,
    MODEL,
    assert_error,
    engine,
    metric,
    reply_text,
    sse_events,
    tokenizer,
)

ALIAS = "my-alias"
SLASHED = "org/model-7b"  # Hugging Face style ids hold a slash


@pytest.fixture
def app(engine):
    return create_app(engine, MODEL, metrics=engine.metrics, model_aliases=(ALIAS, SLASHED))


@pytest.fixture
async def client(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


# ---- model ids ----


async def test_models_retrieve_by_id_or_alias_and_404_for_others(openai_client, client):
    for name in (MODEL, ALIAS, SLASHED):
        model = await openai_client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (MODEL, "model", "orbit")
    listed = await openai_client.models.list()
    assert [m.id for m in listed.data] == [MODEL]  # aliases are accepted, not listed
    with pytest.raises(openai.NotFoundError):
        await openai_client.models.retrieve("no-such-model")
    assert_error(await client.get("/v1/models/no-such-model"), 404, "model", "model_not_found")


async def test_an_alias_is_accepted_and_the_response_names_the_listed_id(openai_client, engine):
    completion = await openai_client.completions.create(model=ALIAS, prompt="hi", max_tokens=3)
    assert completion.model == MODEL
    assert completion.choices[0].text == reply_text(engine, max_tokens=3)
    chat = await openai_client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == MODEL


async def test_schema_lists_every_accepted_model_id(client):
    schema = (await client.get("/openapi.json")).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]
    model = body["content"]["application/json"]["schema"]["properties"]["model"]
    assert [MODEL, ALIAS, SLASHED] in [m.get("enum") for m in model["anyOf"]]


# ---- /health's 503 is not a request error ----


async def test_health_503_while_not_ready_is_not_a_request_error(client, engine):
    engine.ready = False
    for _ in range(3):
        assert (await client.get("/health")).status_code == 503
    assert (await client.post("/v1/completions", json={"prompt": ""})).status_code == 400
    text = (await client.get("/metrics")).text
    assert metric(text, 'orbit_requests_total{route="/health",status="503"}') == 3
    assert metric(text, "orbit_request_errors_total") == 1  # the 400 alone


# ---- /tokenize and /detokenize ----


async def test_tokenize_a_prompt_as_the_tokenizer_does(client, engine):
    text = "Hello world! héllo 日本語"
    resp = await client.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    expected = engine.tokenizer(text).input_ids
    assert body == {
        "count": len(expected),
        "max_model_len": MAX_SEQ_LEN,
        "tokens": expected,
        "token_strs": None,
    }
    resp = await client.post(
        "/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    )
    plain = engine.tokenizer(text, add_special_tokens=False).input_ids
    assert resp.json()["tokens"] == plain
    assert resp.json()["token_strs"] == engine.tokenizer.convert_ids_to_tokens(plain)


async def test_tokenize_messages_with_the_chat_template_and_its_options(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tok = engine.tokenizer
    for options in ({}, {"add_generation_prompt": False}):
        resp = await client.post("/tokenize", json={"messages": messages, **options})
        assert resp.status_code == 200, resp.text
        rendered = tok.apply_chat_template(
            messages,
            add_generation_prompt=options.get("add_generation_prompt", True),
            tokenize=False,
        )
        assert resp.json()["tokens"] == tok(rendered, add_special_tokens=False).input_ids
    with_reply = [*messages, {"role": "assistant", "content": "Hel"}]
    resp = await client.post(
        "/tokenize",
        json={
            "messages": with_reply,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert tok.decode(resp.json()["tokens"]).endswith("Hel")


async def test_tokenize_count_is_what_a_completion_counts(client):
    text = "The capital of France is"
    count = (await client.post("/tokenize", json={"prompt": text})).json()["count"]
    completion = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert completion.json()["usage"]["prompt_tokens"] == count


async def test_detokenize_inverts_tokenize(client):
    text = "Hello world! héllo 日本語 🚀"
    body = {"prompt": text, "add_special_tokens": False}
    ids = (await client.post("/tokenize", json=body)).json()["tokens"]
    resp = await client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"prompt": text}


@pytest.mark.parametrize(
    "route,body,status,param",
    [
        (
            "/tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
            400,
            "messages",
        ),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ],
)
async def test_tokenize_and_detokenize_refuse_bad_input(client, route, body, status, param):
    code = "model_not_found" if status == 404 else None
    assert_error(await client.post(route, json=body), status, param, code)


# ---- batched prompts in /v1/completions ----


async def test_batched_prompts_index_choices_prompt_major(client, engine):
    prompts = ["first prompt", "the second one", "3"]
    resp = await client.post(
        "/v1/completions", json={"prompt": prompts, "n": 2, "seed": 5, "max_tokens": 4}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    # Each sequence the engine ran: choice i used prompt i // n, with its seed (5 + i % n).
    by_choice = {int(rid.rsplit("-", 1)[1]): (p, params) for rid, p, params in engine.started}
    for i, choice in enumerate(body["choices"]):
        prompt_ids, params = by_choice[i]
        assert prompt_ids == ids[i // 2]
        assert params.seed == 5 + i % 2
        assert choice["text"] == reply_text(engine, 5 + i % 2, max_tokens=4)
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert body["usage"]["completion_tokens"] == 6 * 4


async def test_batched_token_id_prompts_stream_every_choice(client, engine):
    ids = [engine.tokenizer(p, add_special_tokens=False).input_ids for p in ("a b", "c")]
    body = {
        "prompt": ids,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    events = [json.loads(e) for e in sse_events(resp.text)[:-1]]
    texts = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: reply_text(engine, max_tokens=3), 1: reply_text(engine, max_tokens=3)}
    assert sorted(p for _, p, _ in engine.started) == sorted(ids)
    assert events[-1]["usage"]["prompt_tokens"] == sum(map(len, ids))


async def test_a_batch_with_one_prompt_too_long_is_refused_whole(client, engine):
    body = {"prompt": ["short", list(range(1, MAX_SEQ_LEN + 1))], "max_tokens": 2}
    assert_error(await client.post("/v1/completions", json=body), 400, "prompt")
    assert engine.started == []


# ---- access log ----


async def test_access_log_line_per_request_with_tokens(client, caplog):
    with caplog.at_level(logging.INFO, logger="orbit.access"):
        await client.get("/v1/models")
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        usage = resp.json()["usage"]
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        await client.post("/v1/completions", json={"prompt": ""})
    lines = [r.getMessage() for r in caplog.records if r.name == "orbit.access"]
    assert len(lines) == 4, lines
    assert lines[0].startswith("GET /v1/models 200 ") and "tokens" not in lines[0]
    assert lines[1].startswith("POST /v1/completions 200 ")
    assert lines[1].endswith(f"tokens_in={usage['prompt_tokens']} tokens_out=3")
    assert lines[2].startswith("POST /v1/completions 200 ") and lines[2].endswith("tokens_out=2")
    assert lines[3].startswith("POST /v1/completions 400 ")
    assert all(line.split()[3].endswith("ms") for line in lines)


async def test_no_access_log_at_the_default_level(client, caplog):
    with caplog.at_level(logging.WARNING, logger="orbit.access"):
        await client.get("/v1/models")
    assert not [r for r in caplog.records if r.name == "orbit.access"]
