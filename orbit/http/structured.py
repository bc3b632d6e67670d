"""`response_format` (structured outputs) as the JSON schema the ranks constrain decoding with.

{"type": "text"} or none: unconstrained. {"type": "json_object"}: any JSON object.
{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: one JSON
value that validates against `schema`. The schema travels to the ranks as JSON text in the
sequence's SamplingParams (proto/wire.proto `Grammar`), where every rank compiles it and masks
the logits (runtime/grammar.py). It is compiled here first, once, for the served tokenizer and
under a time and memory limit (orbit/http/schema_check.py), so a schema xgrammar cannot express,
or one whose grammar would stall the ranks' steps while it compiles, is a 400 naming the field
and the reason before the core sees it. Schemas nested deeper than MAX_SCHEMA_DEPTH are refused
before compiling. Decoding is constrained whether or not `strict` is set: Orbit has one mode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import NamedTuple

from orbit.http.errors import BadRequest
from orbit.http.schema_check import SchemaTooCostly
from runtime.grammar import GrammarError

JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON nesting (objects and arrays) a schema may have: real ones, Pydantic's included ($defs),
# stay under 20; a deeper one costs the grammar conversion quadratic time.
MAX_SCHEMA_DEPTH = 64


class SchemaToCheck(NamedTuple):
    """A schema to compile before the request goes on (check_schemas): a compile may take up
    to its time limit, so it runs outside the lane that parsed the request."""

    param: str  # the request field a refusal names
    text: str  # the JSON schema text the ranks compile


# OpenAI's rule for response_format.json_schema.name.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_PARAM = "response_format"


def response_schema(response_format: object, pending: list[SchemaToCheck]) -> str | None:
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
        return _json_schema(response_format.get("json_schema"), pending)
    shown = json.dumps(kind)[:64]
    msg = f"response_format.type must be 'text', 'json_object' or 'json_schema', got {shown}."
    raise BadRequest(msg, param=f"{_PARAM}.type")


def _json_schema(spec: object, pending: list[SchemaToCheck]) -> str:
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
    return checked_schema(schema, f"{param}.schema", pending)


def checked_schema(schema: object, param: str, pending: list[SchemaToCheck]) -> str:
    """A JSON schema (a parsed object) as the text the ranks compile, added to `pending`;
    BadRequest when it is not an object or is nested too deeply."""
    _require(isinstance(schema, dict), f"{param} must be a JSON schema object.", param)
    depth = _depth(schema)
    msg = f"{param} nests {depth} levels deep, over the limit of {MAX_SCHEMA_DEPTH}; use $defs."
    _require(depth <= MAX_SCHEMA_DEPTH, msg, param)
    text = json.dumps(schema, ensure_ascii=False)
    pending.append(SchemaToCheck(param, text))
    return text


def check_schemas(schemas: tuple[SchemaToCheck, ...], check: Callable[[str], None]) -> None:
    """Compile each schema, in order, with `check` (SchemaChecker.check); BadRequest names
    the first one refused and the reason."""
    for param, text in schemas:
        try:
            check(text)
        except SchemaTooCostly as e:
            raise BadRequest(f"{param} is too costly to compile: {e}.", param=param) from None
        except GrammarError as e:
            raise BadRequest(f"{param} is not a supported JSON schema: {e}", param=param) from None


def _depth(value: object) -> int:
    """The nesting of objects and arrays in a parsed JSON value, without recursion (a body may
    nest as deep as the JSON parser allows)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (v.values() if isinstance(v, dict) else v))
    return deepest


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise BadRequest(message, param=param)
