"""A tiny Prometheus text-format registry (counters, gauges, fixed-bucket histograms) and the
frontend's metrics. Everything runs on the event loop, so there is no locking."""

import bisect
import math
import time
from collections import deque
from collections.abc import Callable

Labels = tuple[tuple[str, str], ...]

# nginx's status for "client closed the request": recorded for disconnects, not counted as an error.
CLIENT_CLOSED_REQUEST = 499


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels_text(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    """A monotonically increasing value per label set."""

    def __init__(self, name: str, help_text: str):
        self.name = name
        self.help_text = help_text
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items())) if labels else ()
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = _header(self.name, self.help_text, "counter")
        values = self._values or {(): 0.0}
        return lines + [f"{self.name}{_labels_text(k)} {_number(v)}" for k, v in values.items()]


class Gauge:
    """A value read at scrape time from a callback."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]):
        self.name = name
        self.help_text = help_text
        self._read = read

    def render(self) -> list[str]:
        return _header(self.name, self.help_text, "gauge") + [
            f"{self.name} {_number(self._read())}"
        ]


class Histogram:
    """Observations counted into fixed upper-bound buckets (cumulative on output)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name = name
        self.help_text = help_text
        self._bounds = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """Count value `times` times (tokens that arrived together share their interval)."""
        self._counts[bisect.bisect_left(self._bounds, value)] += times
        self._sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = _header(self.name, self.help_text, "histogram")
        cumulative = 0
        for bound, n in zip(self._bounds, self._counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_number(self._sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class RateWindow:
    """Events per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, n: int, now: float | None = None) -> None:
        """now: the clock's reading, when the caller has one."""
        if now is None:
            now = self._clock()
        self._total += n
        if self._events and now - self._events[-1][0] < self._window_s / 100:
            at, m = self._events[-1]  # events this close together share one entry
            self._events[-1] = (at, m + n)
            return
        self._events.append((now, n))
        self._expire()

    def rate(self) -> float:
        self._expire()
        return self._total / self._window_s

    def _expire(self) -> None:
        horizon = self._clock() - self._window_s
        while self._events and self._events[0][0] < horizon:
            self._total -= self._events.popleft()[1]


# Bucket bounds in seconds. TTFT includes queueing, so it reaches far higher than ITL.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class FrontendMetrics:
    """The HTTP frontend's metrics; `render()` gives the Prometheus text."""

    def __init__(self, tokens_window_s: float = 10.0):
        self.requests = Counter("orbit_requests_total", "HTTP requests by route and status.")
        self.errors = Counter(
            "orbit_request_errors_total", "Requests that failed: an error status or stream error."
        )
        self.aborted = Counter(
            "orbit_aborted_requests_total", "Requests aborted because the client disconnected."
        )
        self.ttft = Histogram(
            "orbit_time_to_first_token_seconds",
            "From request arrival to each choice's first token.",
            TTFT_BUCKETS_S,
        )
        self.itl = Histogram(
            "orbit_inter_token_latency_seconds",
            "Between consecutive tokens of a choice.",
            ITL_BUCKETS_S,
        )
        self.queue_time = Histogram(
            "orbit_request_queue_seconds",
            "From the engine core's receipt of each choice to its first step's plan.",
            TTFT_BUCKETS_S,
        )
        self.prefill_time = Histogram(
            "orbit_request_prefill_seconds",
            "From each choice's first step's plan to its first token (every prefill chunk).",
            TTFT_BUCKETS_S,
        )
        self.generated_tokens = Counter("orbit_generated_tokens_total", "Tokens generated.")
        self.prompt_tokens = Counter("orbit_prompt_tokens_total", "Prompt tokens received.")
        self._token_rate = RateWindow(tokens_window_s)
        self.tokens_per_second = Gauge(
            "orbit_generated_tokens_per_second",
            f"Generated tokens per second over the last {tokens_window_s:g} s.",
            self._token_rate.rate,
        )

    def observe_request(self, route: str, status: int) -> None:
        """Every request counts by route and status; an error status counts as a request error
        unless the client left (499) or it is /health's answer: its 503 says "not ready" (while
        the ranks start, or after a failure), which /health exists to report."""
        self.requests.inc(route=route, status=str(status))
        if status >= 400 and status != CLIENT_CLOSED_REQUEST and route != "/health":
            self.errors.inc()

    def observe_tokens(
        self, since_previous_s: float, num_tokens: int, first: bool, now_s: float | None = None
    ) -> None:
        """Tokens of one choice that arrived together, since_previous_s after its previous
        ones (or after the request arrived, for the first): they share the interval. now_s:
        the monotonic clock, when the caller has read it."""
        if first:
            self.ttft.observe(since_previous_s)
            if num_tokens > 1:
                self.itl.observe(0.0, num_tokens - 1)
        elif num_tokens:
            self.itl.observe(since_previous_s / num_tokens, num_tokens)
        self.generated_tokens.inc(num_tokens)
        self._token_rate.add(num_tokens, now_s)

    def observe_first_token(self, timing) -> None:
        """A choice's first output: the engine core's split of its time to first token
        (core_pb2.FirstTokenTiming)."""
        self.queue_time.observe(timing.queued_s)
        self.prefill_time.observe(timing.prefill_s)

    def render(self) -> str:
        metrics = (
            self.requests,
            self.errors,
            self.aborted,
            self.ttft,
            self.queue_time,
            self.prefill_time,
            self.itl,
            self.generated_tokens,
            self.prompt_tokens,
            self.tokens_per_second,
        )
        return "\n".join(line for m in metrics for line in m.render()) + "\n"


class RequestMetricsMiddleware:
    """Counts each HTTP request by route and final status. Plain ASGI, so streams pass through
    untouched and disconnects still reach the app."""

    def __init__(self, app, metrics: "FrontendMetrics", routes: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes  # other paths share one label, so scanners cannot grow the series

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception escaping the app becomes a 500 outside this middleware

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope.get("path", "")
            self.metrics.observe_request(path if path in self.routes else "other", status)
