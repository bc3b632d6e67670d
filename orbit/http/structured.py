"""`response_format` (structured outputs) as the JSON schema the ranks constrain decoding with.

{"type": "text"} or none: unconstrained. {"type": "json_object"}: any JSON object.
{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: one JSON
value that validates against `schema`. The schema travels to the ranks as JSON text in the
sequence's SamplingParams (proto/wire.proto `Grammar`), where every rank compiles it and masks
the logits (runtime/grammar.py). It is converted to a grammar here first, once, so a schema
xgrammar cannot express is a 400 naming the field and the reason, before the core sees it.
Decoding is constrained whether or not `strict` is set: Orbit has only one mode.
"""

from __future__ import annotations

import json
import re

from orbit.http.errors import BadRequest
from runtime.grammar import GrammarError, compile_check

JSON_OBJECT_SCHEMA = '{"type": "object"}'
# OpenAI's rule for response_format.json_schema.name.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_PARAM = "response_format"


def response_schema(response_format: object) -> str | None:
    """The JSON schema text a response_format asks for; None for plain text. BadRequest
    names what is wrong."""
    if response_format is None:
        return None
    _require(isinstance(response_format, dict), "response_format must be an object.", _PARAM)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        return _json_schema(response_format.get("json_schema"))
    shown = json.dumps(kind)[:64]
    msg = f"response_format.type must be 'text', 'json_object' or 'json_schema', got {shown}."
    raise BadRequest(msg, param=f"{_PARAM}.type")


def _json_schema(spec: object) -> str:
    param = f"{_PARAM}.json_schema"
    _require(isinstance(spec, dict), f"{param} must be an object.", param)
    name = spec.get("name")
    ok = isinstance(name, str) and _NAME.fullmatch(name) is not None
    msg = f"{param}.name must be 1 to 64 letters, digits, '_' or '-'."
    _require(ok, msg, f"{param}.name")
    strict = spec.get("strict")
    _require(
        strict is None or isinstance(strict, bool),
        f"{param}.strict must be a boolean.",
        f"{param}.strict",
    )
    schema = spec.get("schema", {"type": "object"})
    return checked_schema(schema, f"{param}.schema")


def checked_schema(schema: object, param: str) -> str:
    """A JSON schema (a parsed object) as the text the ranks compile; BadRequest when it is not
    an object or xgrammar cannot turn it into a grammar."""
    _require(isinstance(schema, dict), f"{param} must be a JSON schema object.", param)
    text = json.dumps(schema, ensure_ascii=False)
    try:
        compile_check(text)
    except GrammarError as e:
        raise BadRequest(f"{param} is not a supported JSON schema: {e}", param=param) from None
    return text


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)
