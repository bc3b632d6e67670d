"""Tool calls out of a choice's text as it streams (orbit/http/tool_calls.py says which layout
applies when): content and OpenAI tool-call deltas.

Layouts: "text" (tool_choice auto): Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks anywhere, or an output that opens with JSON calls `{"name": ...,
"parameters": {...}}` separated by ";" (Llama 3.x, optionally after <|python_tag|>); anything
else is content. "list" (required): a JSON array of calls. "args" (a named function): the whole
text is its arguments.

The same parser serves streamed and whole responses, so they agree: a call's first delta
carries its index, id, type and name, the next ones fragments of the arguments, which are the
exact JSON text the model wrote for them. Until a call's arguments are complete, a tail of
whitespace and closing braces is held back: it may close the call rather than the arguments.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# A call's head, once written: the name, then the key of its arguments and their first character.
_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_decoder = json.JSONDecoder()


@dataclass
class _Call:
    index: int
    start: int  # where its JSON object starts in the text
    name: str | None = None
    args_start: int = -1  # where its arguments' JSON starts; -1 until the head is written
    args_sent: int = 0  # characters of the arguments sent


class ToolCallParser:
    """One choice's text in, content and tool-call deltas out, as the text streams.

    layout: "text" (auto: Hermes blocks or leading JSON calls), "list" (a JSON array of calls)
    or "args" (the whole text is the named function's arguments)."""

    def __init__(self, layout: str, named: str | None = None):
        self._layout, self._named = layout, named
        self._text = ""
        self._pos = 0  # characters of _text consumed
        self._state = {"text": "start", "list": "between", "args": "args"}[layout]
        self._call: _Call | None = None
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """New content text and tool-call deltas; final: the choice ended, flush everything."""
        self._text += text
        content, deltas = [], []
        while self._step(final, content, deltas):
            pass
        return "".join(content), deltas

    def _step(self, final: bool, content: list[str], deltas: list[dict]) -> bool:
        """Advance one state; False when more text is needed."""
        text, pos = self._text, self._pos
        if self._state == "args":
            return self._args_only(final, deltas)
        if self._state == "start":  # auto: JSON calls if the output opens with "{"
            rest = text[pos:].lstrip()
            if rest.startswith(_PYTHON_TAG):  # Llama 3.x, when special tokens are not skipped
                self._pos, self._state = text.index(_PYTHON_TAG, pos) + len(_PYTHON_TAG), "json"
                return True
            if not rest or (not final and _PYTHON_TAG.startswith(rest)):
                return self._flush_content(final, content)
            self._state = "json" if rest[0] == "{" else "content"
            return True
        if self._state == "content":
            return self._content(final, content)
        if self._state == "plain":
            return self._flush_content(True, content)
        if self._state in ("between", "json", "tagged"):
            return self._between(final, content)
        return self._body(final, content, deltas)

    def _flush_content(self, final: bool, content: list[str]) -> bool:
        if final:
            content.append(self._text[self._pos :])
            self._pos = len(self._text)
        return False

    def _content(self, final: bool, content: list[str]) -> bool:
        """Text outside calls; a <tool_call> opens one. A tail that may begin the tag waits."""
        text, pos = self._text, self._pos
        i = text.find(_OPEN, pos)
        if i >= 0:
            content.append(text[pos:i])
            self._pos, self._state = i + len(_OPEN), "tagged"
            return True
        keep = 0 if final else _partial_suffix(text, _OPEN)
        content.append(text[pos : len(text) - keep])
        self._pos = len(text) - keep
        return False

    def _between(self, final: bool, content: list[str]) -> bool:
        """Before a call's "{": whitespace, and the separators of the layout."""
        text, skip = (
            self._text,
            {"between": " \t\r\n[,]", "json": " \t\r\n;,"}.get(self._state, " \t\r\n"),
        )
        pos = self._pos
        while pos < len(text) and text[pos] in skip:
            pos += 1
        self._pos = pos
        if pos == len(text):
            return False
        if text[pos] == "{":
            self._call = _Call(self.num_calls, pos)
            self._resume = self._state
            self._state = "body"
            return True
        if self._state == "tagged":
            if text.startswith(_CLOSE, pos):
                self._pos, self._state = pos + len(_CLOSE), "content"
                return True
            if not final and _CLOSE.startswith(text[pos:]):
                return False
        # Not a call: what is left is content (auto) or dropped (a constrained list's end).
        self._state = "plain" if self._layout == "text" else "done"
        return self._layout == "text"

    def _body(self, final: bool, content: list[str], deltas: list[dict]) -> bool:
        call, text = self._call, self._text
        if call.name is None:
            head = _HEAD.match(text, call.start)
            if head is None:
                return self._whole_body(final, content, deltas)
            call.name, call.args_start = json.loads(f'"{head.group(1)}"'), head.end()
            deltas.append(self._opening(call))
        self._send_args(final, deltas)
        try:
            _, end = _decoder.raw_decode(text, call.start)
        except ValueError:
            if final:  # cut short (max_tokens): the arguments as written
                self._pos, self._state = len(text), "done"
            return False
        self._pos, self._state = end, self._resume
        return True

    def _whole_body(self, final: bool, content: list[str], deltas: list[dict]) -> bool:
        """A body whose head is not (yet) name-then-arguments: wait for the whole object."""
        call, text = self._call, self._text
        try:
            obj, end = _decoder.raw_decode(text, call.start)
        except ValueError:
            if final:
                self._state = "plain" if self._layout == "text" else "done"
                return self._layout == "text"
            return False
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or args is None:
            self._state = "plain" if self._layout == "text" else "done"
            return self._layout == "text"
        call.name = obj["name"]
        deltas.append(self._opening(call))
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        deltas.append(_args_delta(call.index, arguments))
        self._pos, self._state = end, self._resume
        return True

    def _send_args(self, final: bool, deltas: list[dict]) -> None:
        """The arguments' JSON written so far: all of it once complete; before that a prefix
        without the trailing whitespace and braces that may close the call rather than them."""
        call, text = self._call, self._text
        start = call.args_start
        try:
            _, end = _decoder.raw_decode(text, start)
        except ValueError:
            if final:
                end = len(text)
            elif text[start : start + 1] == "{":
                end = start + len(text[start:].rstrip(" \t\r\n}"))
            else:
                return
        if end - start > call.args_sent:
            deltas.append(_args_delta(call.index, text[start + call.args_sent : end]))
            call.args_sent = end - start

    def _args_only(self, final: bool, deltas: list[dict]) -> bool:
        """Named tool_choice: the whole text is the arguments, sent as it comes."""
        if self._call is None:
            self._call = _Call(0, 0, self._named, 0)
            deltas.append(self._opening(self._call))
        if len(self._text) > self._call.args_sent:
            deltas.append(_args_delta(0, self._text[self._call.args_sent :]))
            self._call.args_sent = len(self._text)
        return False

    def _opening(self, call: _Call) -> dict:
        """A call's first delta; every call is counted once it opens."""
        self.num_calls += 1
        fn = {"name": call.name, "arguments": ""}
        return {
            "index": call.index,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": fn,
        }


def _args_delta(index: int, fragment: str) -> dict:
    return {"index": index, "function": {"arguments": fragment}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas assembled into whole calls, as a non-streamed message has them."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
        else:
            call["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


async def parse_choice(deltas: AsyncIterator, parser: ToolCallParser) -> AsyncIterator:
    """A choice's ChoiceDeltas with their text split into content and tool_calls; closing this
    closes the choice."""
    try:
        async for d in deltas:
            text, calls = parser.feed(d.text, final=d.finish_reason is not None)
            finish = d.finish_reason
            if finish == "stop" and parser.num_calls:
                finish = "tool_calls"
            yield dataclasses.replace(d, text=text, tool_calls=tuple(calls), finish_reason=finish)
    finally:
        await deltas.aclose()
