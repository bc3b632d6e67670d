"""Structured-output overhead through HTTP: output tokens/s of `json_schema` responses against
free-text responses of the same length, at 1 and 64 concurrent streams, with the official
`openai` client.

    python -m benchmarks.structured --serve PATH [--serve-args "..."] [--device cpu|cuda]
        [--concurrency 1,64] [--new-tokens 256] [--requests-per-stream 2] [--out FILE]
    python -m benchmarks.structured --url http://127.0.0.1:8000

PATH is anything `orbit serve` takes (a package, a GGUF file, a Hugging Face directory). Both
arms send /v1/completions with the same prompts (distinct token ids per request, as
benchmarks.serving_sweep makes them), `max_tokens` = --new-tokens and `ignore_eos`, so every
request generates exactly --new-tokens tokens; the report counts them from `usage`. The
json_schema arm adds `response_format` with LONG_SCHEMA, an array of at least --new-tokens
strings that no answer can complete within --new-tokens tokens: every token is drawn under the
grammar's mask (were the value complete earlier, `ignore_eos` would let decoding go on
unconstrained, and the comparison would flatter the grammar). The report checks this: an output
whose JSON value is complete counts under `left_grammar` (0 expected).

Per level, the two arms run one after the other, free text first, each after one unmeasured
short request (the schema is then compiled and cached on the API server and the ranks; what is
measured is decoding under the mask, not the one-time compile). Figures: output tokens/s (all
tokens over the time from the first request sent to the last answer), mean request latency,
tokens per request (min and max), the json arm's tokens/s relative to free text, and the
server's preemptions during the arm (a KV cache too small for every stream). One
client process sends every request (non-streamed answers: the client's work is the same in
both arms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from benchmarks.serving_sweep import prompt_ids, served, served_model


def long_schema(new_tokens: int) -> dict:
    """An array of at least new_tokens non-empty strings: each item with its quotes and
    separator is 5 characters or more, so a complete value takes more than new_tokens tokens."""
    return {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 24},
        "minItems": new_tokens,
    }


@dataclass(frozen=True)
class Arm:
    name: str  # "free_text" or "json_schema"
    response_format: dict | None


@dataclass
class Answer:
    latency_s: float
    tokens: int
    text: str
    finish_reason: str
    error: str = ""


async def one(client, model: str, ids: list[int], new_tokens: int, arm: Arm) -> Answer:
    extra = {"ignore_eos": True}
    if arm.response_format is not None:
        extra["response_format"] = arm.response_format
    started = time.perf_counter()
    try:
        r = await client.completions.create(
            model=model, prompt=ids, max_tokens=new_tokens, temperature=0.0, extra_body=extra
        )
    except Exception as exc:  # noqa: BLE001 - counted as a failure, the level goes on
        return Answer(time.perf_counter() - started, 0, "", "", f"{type(exc).__name__}: {exc}")
    choice = r.choices[0]
    took_s = time.perf_counter() - started
    return Answer(took_s, r.usage.completion_tokens, choice.text, choice.finish_reason)


def preemptions(url: str, api_key: str) -> float | None:
    """orbit_preemptions_total from /metrics (None from a server without it): a preempted
    sequence is recomputed, which costs both arms, but not necessarily alike."""
    headers = {"Authorization": f"Bearer {api_key}"}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith("orbit_preemptions_total "):
            return float(line.split()[1])
    return None


async def run_arm(client, model: str, arm: Arm, streams: int, args, first_salt: int) -> dict:
    gate = asyncio.Semaphore(streams)

    async def bounded(salt: int) -> Answer:
        async with gate:
            ids = prompt_ids(args.prompt_tokens, salt, args.vocab_size)
            return await one(client, model, ids, args.new_tokens, arm)

    warm = await one(client, model, prompt_ids(args.prompt_tokens, 0, args.vocab_size), 4, arm)
    if warm.error:
        raise RuntimeError(f"{arm.name}: the warm-up request failed: {warm.error}")
    num_requests = streams * args.requests_per_stream
    preempted_before = preemptions(args.url, args.api_key)
    started = time.perf_counter()
    salts = range(first_salt, first_salt + num_requests)
    answers = await asyncio.gather(*(bounded(s) for s in salts))
    row = summarize(arm, streams, answers, time.perf_counter() - started)
    preempted_after = preemptions(args.url, args.api_key)
    if preempted_before is not None and preempted_after is not None:
        row["preemptions"] = int(preempted_after - preempted_before)
    return row


def summarize(arm: Arm, streams: int, answers: list[Answer], wall_s: float) -> dict:
    ok = [a for a in answers if not a.error]
    tokens = [a.tokens for a in ok]
    out = {
        "arm": arm.name,
        "concurrency": streams,
        "requests": len(answers),
        "failures": len(answers) - len(ok),
        "first_errors": [a.error for a in answers if a.error][:3],
        "wall_s": round(wall_s, 3),
        "output_tokens": sum(tokens),
        "tokens_per_request": [min(tokens), max(tokens)] if tokens else None,
        "output_tokens_per_s": round(sum(tokens) / wall_s, 2),
        "mean_latency_s": round(sum(a.latency_s for a in ok) / len(ok), 3) if ok else None,
        "finish_reasons": sorted({a.finish_reason for a in ok}),
    }
    if arm.response_format is not None:
        out["left_grammar"] = sum(_complete_json(a.text) for a in ok)
    return out


def _complete_json(text: str) -> bool:
    """Whether the text starts with a complete JSON value (the grammar's end was reached)."""
    try:
        json.JSONDecoder().raw_decode(text)
    except ValueError:
        return False
    return True


async def run_levels(url: str, args) -> list[dict]:
    schema = long_schema(args.new_tokens)
    arms = [
        Arm("free_text", None),
        Arm(
            "json_schema",
            {"type": "json_schema", "json_schema": {"name": "words", "schema": schema}},
        ),
    ]
    from openai import AsyncOpenAI

    levels = [int(c) for c in args.concurrency.split(",")]
    size = max(levels) + 8
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout))
    client = AsyncOpenAI(
        base_url=url + "/v1", api_key=args.api_key, max_retries=0, http_client=http
    )
    model = args.model or served_model(url, args.api_key)
    rows, salt = [], 1
    async with client:
        for streams in levels:
            for arm in arms:
                print(f"{arm.name} at {streams} streams", file=sys.stderr, flush=True)
                rows.append(await run_arm(client, model, arm, streams, args, salt))
                salt += streams * args.requests_per_stream
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """json_schema's tokens/s over free text's at the same concurrency."""
    free = {r["concurrency"]: r for r in rows if r["arm"] == "free_text"}
    for r in rows:
        base = free.get(r["concurrency"])
        if r["arm"] == "json_schema" and base and base["output_tokens_per_s"]:
            r["vs_free_text"] = round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 4)
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'streams':>7} {'arm':<12} {'tok/s':>9} {'vs free':>8} {'latency s':>9} "
    print(head + f"{'tokens/req':>11} {'fails':>5} {'left grammar':>12} {'preempted':>9}")
    for r in rows:
        per_req = "-".join(str(t) for t in dict.fromkeys(r["tokens_per_request"] or []))
        ratio = f"{r['vs_free_text']:.3f}" if "vs_free_text" in r else ""
        print(
            f"{r['concurrency']:>7} {r['arm']:<12} {r['output_tokens_per_s']:>9.1f} {ratio:>8} "
            f"{r['mean_latency_s'] or 0:>9.2f} {per_req:>11} {r['failures']:>5} "
            f"{r.get('left_grammar', ''):>12} {r.get('preemptions', ''):>9}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    p.add_argument("--serve", type=Path, metavar="PATH", help="start `orbit serve PATH`")
    p.add_argument("--serve-args", default="", help="more `orbit serve` arguments")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds, --serve")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--concurrency", default="1,64", help="comma-separated streams")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are below it")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    if args.serve is not None:
        with served(args) as (url, _):
            args.url = url
            rows = asyncio.run(run_levels(url, args))
    else:
        rows = asyncio.run(run_levels(args.url, args))
    report = {"started": started, "argv": sys.argv[1:], "levels": with_ratios(rows)}
    print_table(report["levels"])
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
