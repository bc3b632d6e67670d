"""One access-log line per HTTP request, at INFO on the `orbit.access` logger (shown with
`orbit serve --log-level info`; the default, warning, keeps the servers quiet):

    GET /v1/models 200 1.2ms
    POST /v1/completions 200 412.9ms tokens_in=7 tokens_out=24 ttft=13.1ms(api=0.4 to_core=0.1
        queue=0.1 prefill=11.9 ranks=11.2 gpu=10.8 back=0.6)

(one line). ttft is the first choice's time to its first token from the request's arrival;
in brackets where it went, in ms: this server (parsing, chat template, tokenization), the trip
to the engine core, the core's queue, the steps up to the first token (all its prefill
chunks), of which the ranks' time and the GPU's time in the step that drew it, and the rest
(the trips back and this server's delivery).

Generation handlers note their token counts in the request's state (`note_tokens`), so a
stream's line is written when its last event has gone out, with the tokens it sent.
"""

from __future__ import annotations

import logging
import time

access_log = logging.getLogger("orbit.access")

_TOKENS_IN = "orbit_tokens_in"
_TOKENS_OUT = "orbit_tokens_out"
_FIRST_TOKEN = "orbit_first_token"


def note_tokens(state, tokens_in: int | None = None, tokens_out: int | None = None) -> None:
    """Record a request's prompt and generated token counts for its access-log line; `state` is
    the Starlette request's `.state`."""
    if tokens_in is not None:
        setattr(state, _TOKENS_IN, tokens_in)
    if tokens_out is not None:
        setattr(state, _TOKENS_OUT, tokens_out)


def note_first_token(state, ttft_s: float, parts: dict[str, float]) -> None:
    """Record the first choice's time to first token and its parts (seconds) for the line."""
    setattr(state, _FIRST_TOKEN, (ttft_s, parts))


class AccessLogMiddleware:
    """Plain ASGI (streams pass through untouched); costs nothing but a level check when INFO
    is off."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started_s = time.monotonic()
        state = scope.setdefault("state", {})
        status = 500  # an exception escaping the app becomes a 500 outside this middleware

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            access_log.info("%s", _line(scope, status, time.monotonic() - started_s, state))


def _line(scope, status: int, duration_s: float, state: dict) -> str:
    path = scope.get("path", "")
    line = f"{scope.get('method', '?')} {path} {status} {duration_s * 1000:.1f}ms"
    for key, name in ((_TOKENS_IN, "tokens_in"), (_TOKENS_OUT, "tokens_out")):
        if key in state:
            line += f" {name}={state[key]}"
    if _FIRST_TOKEN in state:
        ttft_s, parts = state[_FIRST_TOKEN]
        split = " ".join(f"{name}={s * 1000:.1f}" for name, s in parts.items())
        line += f" ttft={ttft_s * 1000:.1f}ms({split})"
    return line
