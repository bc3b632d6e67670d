"""docs/api.md stays true: each route's tables name exactly the fields its request model
accepts (nested ones as `parent.field` or `parent[].field`), each with a known status."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from orbit.http.openai_types import ChatCompletionRequest, CompletionRequest
from orbit.http.tokenize import DetokenizeRequest, TokenizeRequest

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
STATUSES = {"supported", "refused", "extension"}
ROUTES = {
    "POST /v1/completions": CompletionRequest,
    "POST /v1/chat/completions": ChatCompletionRequest,
    "POST /tokenize": TokenizeRequest,
    "POST /detokenize": DetokenizeRequest,
}
_ROW = re.compile(r"^\| `([^`]+)` \| (\w+) \|")


def documented_fields() -> dict[str, dict[str, str]]:
    """Route heading -> {field: status} from the tables under it."""
    routes: dict[str, dict[str, str]] = {}
    current = None
    for line in API_MD.read_text().splitlines():
        if line.startswith("## "):
            current = routes.setdefault(line[3:].strip(), {})
        elif current is not None and (row := _ROW.match(line)):
            current[row[1]] = row[2]
    return routes


def model_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field a request model accepts, nested models' fields as prefix.field (a list of
    them as prefix[].field)."""
    names = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        names.add(path)
        for nested, in_list in _nested_models(info.annotation):
            names |= model_fields(nested, f"{path}{'[]' if in_list else ''}.")
    return names


def _nested_models(annotation, in_list: bool = False):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, in_list
        return
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        yield from _nested_models(arg, in_list or origin is list)


@pytest.mark.parametrize("route", ROUTES)
def test_api_md_lists_every_field_of_each_route(route):
    documented = documented_fields()[route]
    assert set(documented) == model_fields(ROUTES[route])
    assert set(documented.values()) <= STATUSES


def test_the_nested_fields_are_found():
    fields = model_fields(ChatCompletionRequest)
    assert {"messages[].role", "messages[].content[].text", "stream_options.include_usage"} <= (
        fields
    )
