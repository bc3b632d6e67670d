"""Tool calling in /v1/chat/completions: checking `tools` and `tool_choice`, and what the
prompt, the grammar and the output parser (orbit/http/tool_parser.py) get.

How this works. The tools go to the chat template (`apply_chat_template(tools=...)`); a
template that does not use them (SmolLM2's) gets them in a system message of Orbit's, in the
Hermes format. Then, by tool_choice:
- "auto": the model decides; its text is parsed for calls in the formats templates ask for
  (Hermes/Qwen `<tool_call>` blocks, Llama 3.x JSON calls); anything else is content.
- "none": no parsing; the output is content.
- "required": decoding is constrained (runtime/grammar.py) to a JSON array of at least one
  {"name": <a tool's name>, "parameters": <its parameters>} (one at most when
  parallel_tool_calls is false), the shape vLLM uses too.
- a named function: decoding is constrained to that function's parameters object.
A choice that made a call and stopped ends with finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from orbit.http.errors import BadRequest
from orbit.http.structured import SchemaToCheck, checked_schema, response_schema
from orbit.http.tool_parser import ToolCallParser

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the prompt, the grammar and the output parser."""

    tools: tuple[dict, ...]  # as the template takes them: {"type": "function", "function": ...}
    mode: str  # "auto", "none", "required" or "named"
    named: str | None  # the function a named tool_choice forces
    json_schema: str | None  # what decoding is constrained to ("required", "named")

    def parser(self) -> ToolCallParser | None:
        if self.mode == "none":
            return None
        return ToolCallParser(
            {"auto": "text", "required": "list", "named": "args"}[self.mode], self.named
        )


def tool_plan(
    tools: object, tool_choice: object, parallel: bool | None, pending: list[SchemaToCheck]
) -> ToolPlan | None:
    """Check tools and tool_choice (BadRequest names what is wrong); None without tools. The
    schemas decoding is constrained to are added to `pending` (structured.py)."""
    if not tools:
        _require(tool_choice in (None, "none"), "tool_choice needs tools.", "tool_choice")
        return None
    _require(isinstance(tools, list), "tools must be an array.", "tools")
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    _require(len(set(names)) == len(names), "tools must have distinct function names.", "tools")
    mode, named = _choice(tool_choice, names)
    if mode == "named":
        params = functions[names.index(named)].get("parameters", _EMPTY_PARAMETERS)
        param = f"tools[{names.index(named)}].function.parameters"
        schema = checked_schema(params, param, pending)
    elif mode == "required":
        schema = _required_schema(functions, parallel, pending)
    else:
        schema = None
    plain = tuple({"type": "function", "function": f} for f in functions)
    return ToolPlan(plain, mode, named, schema)


def _function(i: int, tool: object) -> dict:
    param = f"tools[{i}]"
    _require(isinstance(tool, dict), f"{param} must be an object.", param)
    _require(tool.get("type") == "function", f"{param}.type must be 'function'.", f"{param}.type")
    fn = tool.get("function")
    _require(isinstance(fn, dict), f"{param}.function must be an object.", f"{param}.function")
    name = fn.get("name")
    ok = isinstance(name, str) and _NAME.fullmatch(name) is not None
    msg = f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'."
    _require(ok, msg, f"{param}.function.name")
    desc = fn.get("description")
    msg = f"{param}.function.description must be a string."
    _require(desc is None or isinstance(desc, str), msg, f"{param}.function.description")
    params = fn.get("parameters")
    msg = f"{param}.function.parameters must be a JSON schema object."
    _require(params is None or isinstance(params, dict), msg, f"{param}.function.parameters")
    return {
        k: v for k, v in fn.items() if k in ("name", "description", "parameters") and v is not None
    }


def _choice(choice: object, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    msg = (
        "tool_choice must be 'auto', 'none', 'required' or "
        '{"type": "function", "function": {"name": ...}}.'
    )
    _require(isinstance(choice, dict) and choice.get("type") == "function", msg, "tool_choice")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    shown = json.dumps(name)[:80]
    msg = f"tool_choice names function {shown}, which is not among the tools."
    _require(isinstance(name, str) and name in names, msg, "tool_choice.function.name")
    return "named", name


def _required_schema(
    functions: list[dict], parallel: bool | None, pending: list[SchemaToCheck]
) -> str:
    for i, f in enumerate(functions):  # each one alone first, so a 400 names the tool
        params = f.get("parameters", _EMPTY_PARAMETERS)
        checked_schema(params, f"tools[{i}].function.parameters", pending)
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "parameters": f.get("parameters", _EMPTY_PARAMETERS),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if parallel is False:
        schema["maxItems"] = 1
    return checked_schema(schema, "tools", pending)


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)


# ---- the prompt -------------------------------------------------------------------------------


def template_uses_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_system_prompt(tools: tuple[dict, ...]) -> str:
    """The Hermes-style instructions for a template that does not render tools itself."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


@dataclass(frozen=True)
class OutputConstraints:
    """What a request's response_format (and, in chat, its tools) make of its output."""

    json_schema: str | None = None  # decoding is constrained to it
    tools: ToolPlan | None = None
    schemas: tuple[SchemaToCheck, ...] = ()  # to compile before it is generated (check_schemas)


def completion_output(response_format: object) -> OutputConstraints:
    """Check response_format (BadRequest names the field)."""
    pending: list[SchemaToCheck] = []
    return OutputConstraints(response_schema(response_format, pending), None, tuple(pending))


def chat_output(
    response_format: object, tools: object, tool_choice: object, parallel
) -> OutputConstraints:
    """Check response_format, tools and tool_choice together (BadRequest names the field)."""
    pending: list[SchemaToCheck] = []
    plan = tool_plan(tools, tool_choice, parallel, pending)
    schema = response_schema(response_format, pending)
    if plan is not None and plan.json_schema is not None:
        msg = "response_format cannot be combined with a required or named tool_choice."
        _require(schema is None, msg, "response_format")
        schema = plan.json_schema
    return OutputConstraints(schema, plan, tuple(pending))
