"""Tool calling: the output parser on the formats models write (Hermes/Qwen blocks, Llama 3
JSON), fed whole and in pieces; then end to end with the official openai client against a real
`orbit serve` of SmolLM2-135M, whose template does not render tools (Orbit's system message
does), with required and named tool_choice enforced by the grammar."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from orbit.http.tool_parser import ToolCallParser, merge_deltas
from tests.server import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone.", "parameters": TIME},
    },
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]

# ---- the parser ---------------------------------------------------------------------------

OUTPUTS = [
    # (layout, model text, expected content, expected [(name, arguments as objects)])
    (
        "text",
        (
            'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"timezone": "CET"}}\n</tool_call>'
        ),
        "Let me check. \n",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})],
    ),
    (
        "text",
        (
            '{"name": "get_weather", "parameters": {"city": "Pa}ris {x}", "unit": "celsius"}}; '
            '{"name": "get_time", "parameters": {"timezone": "UTC"}}'
        ),
        "",
        [
            ("get_weather", {"city": "Pa}ris {x}", "unit": "celsius"}),
            ("get_time", {"timezone": "UTC"}),
        ],
    ),
    ("text", '<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ("text", "No tools needed: it is sunny. <tool", "No tools needed: it is sunny. <tool", []),
    ("text", '{"answer": 42}', '{"answer": 42}', []),
    (
        "text",
        '{"arguments": {"timezone": "UTC"}, "name": "get_time"}',
        "",
        [("get_time", {"timezone": "UTC"})],
    ),
    (
        "list",
        (
            '[{"name": "get_time", "parameters": {"timezone": "A"}}, {"name": "get_time", '
            '"parameters": {"timezone": "B"}}]'
        ),
        "",
        [("get_time", {"timezone": "A"}), ("get_time", {"timezone": "B"})],
    ),
]


def _feed(layout: str, text: str, piece: int, named: str | None = None):
    parser = ToolCallParser(layout, named)
    content, deltas = [], []
    for i in range(0, len(text), piece):
        c, d = parser.feed(text[i : i + piece], final=i + piece >= len(text))
        content.append(c)
        deltas += d
    return "".join(content), deltas


@pytest.mark.parametrize("layout,text,content,calls", OUTPUTS)
@pytest.mark.parametrize("piece", [1, 3, 10_000])
def test_the_parser_finds_the_calls_in_any_pieces(layout, text, content, calls, piece):
    got_content, deltas = _feed(layout, text, piece)
    merged = merge_deltas(deltas)
    assert got_content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in merged
    ] == calls
    for i, call in enumerate(merged):
        first = next(d for d in deltas if d["index"] == i)
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": call["function"]["name"], "arguments": ""}


def test_a_call_cut_short_keeps_what_was_written():
    text = '<tool_call>{"name": "get_time", "arguments": {"timezone": "Eur'
    for piece in (1, 7, 1000):
        _, deltas = _feed("text", text, piece)
        (call,) = merge_deltas(deltas)
        assert call["function"]["arguments"] == '{"timezone": "Eur'


# ---- end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path, package_cache):
    pkg = package_cache(smollm2_path, 1, max_seq_len=512, max_batch=8, max_step_tokens=64)
    with ServerProcess(pkg, "--kv-cache-mb", "128") as s:
        s.model = _client(s).models.list().data[0].id
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ask(server, **kw):
    args = {
        "model": server.model,
        "messages": QUESTION,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 120,
    }
    return _client(server).chat.completions.create(**{**args, **kw})


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_named_tool_choice_calls_that_function(server):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = _ask(server, tool_choice=choice).choices[0]
    assert answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call)


def test_a_required_tool_choice_makes_calls(server):
    answer = _ask(server, tool_choice="required").choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.tool_calls
    for call in answer.message.tool_calls:
        _check_call(call)
    single = _ask(server, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(single.message.tool_calls) == 1
    _check_call(single.message.tool_calls[0])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_deltas_assemble_into_the_whole_call(server, tool_choice):
    whole = _ask(server, tool_choice=tool_choice).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _ask(server, tool_choice=tool_choice, stream=True):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for d in delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta: id, type and name, no arguments
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert finish == whole.finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(server):
    answer = _ask(server, tool_choice="none", max_tokens=16).choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content


def test_a_tool_result_goes_back_to_the_model(server):
    call = _ask(server, tool_choice="required").choices[0].message.tool_calls[0]
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = _ask(server, messages=messages, tool_choice="none", max_tokens=16).choices[0]
    assert answer.message.content and answer.finish_reason in ("stop", "length")


def test_tool_choice_naming_an_unknown_function_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as err:
        _ask(server, tool_choice={"type": "function", "function": {"name": "launch"}})
    assert err.value.body["param"] == "tool_choice.function.name"


# ---- the prompt ---------------------------------------------------------------------------


def _rendered(tokenizer, template: str | None) -> str:
    from orbit.http.openai_types import ChatCompletionRequest, PromptLimits, chat_prompt
    from orbit.http.tool_calls import tool_plan

    if template is not None:
        tokenizer.chat_template = template
    req = ChatCompletionRequest.model_validate({"messages": QUESTION, "tools": TOOLS})
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, [])
    return chat_prompt(req, tokenizer, PromptLimits.of(tokenizer, 4096), plan.tools)


def test_tools_reach_the_template_or_orbits_system_message(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    # SmolLM2's template ignores tools: Orbit's Hermes-style system message lists them.
    text = _rendered(tokenizer, None)
    assert "<tool_call>" in text and json.dumps(TOOLS[1]) in text
    assert text.index("<tools>") < text.index(QUESTION[0]["content"])
    # A template that renders tools gets them, and no system message of Orbit's.
    own = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    assert _rendered(tokenizer, own) == "[get_weather][get_time]" + QUESTION[0]["content"]
