"""HTTP load generator for a running `orbit serve` (or any OpenAI-compatible server).

Sends `--requests` completions at `--concurrency`, with a fixed mix of prompt and output lengths,
streaming each so that time-to-first-token and inter-token latency are measured per token, and
prints a JSON report: TTFT and ITL p50/p99, request and output-token throughput, failures.

    python benchmarks/serving.py --url http://127.0.0.1:8000 --requests 200 --concurrency 16

With --check-greedy it also runs every distinct request once alone and reports how many of the
concurrent outputs differ from their single-request output (greedy decoding must not depend on
batching).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

WORDS = (
    "orbit serves large language models with tensor parallelism across hosts and keeps every "
    "rank busy while the scheduler batches requests continuously over a paged cache"
).split()


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    ok: bool
    text: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def request_mix(
    n: int, prompt_words: tuple[int, ...], output_tokens: tuple[int, ...], seed: int
) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        words = prompt_words[i % len(prompt_words)]
        start = rng.randrange(len(WORDS))
        prompt = " ".join(WORDS[(start + j) % len(WORDS)] for j in range(words))
        reqs.append(Request(prompt, output_tokens[i % len(output_tokens)]))
    return reqs


async def one(client: httpx.AsyncClient, url: str, model: str, req: Request) -> Outcome:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    last, out = None, Outcome(ok=True)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(ok=False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    now = time.perf_counter()
                    if last is None:
                        out.ttft_s = now - t0
                    else:
                        out.itl_s.append(now - last)
                    last = now
                    out.text += choice.get("text", "")
    except httpx.HTTPError as e:
        return Outcome(ok=False, error=f"{type(e).__name__}: {e}")
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def run(args) -> dict:
    reqs = request_mix(
        args.requests, tuple(args.prompt_words), tuple(args.output_tokens), args.seed
    )
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = (await client.get(args.url + "/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(req):
            async with sem:
                return await one(client, args.url, model, req)

        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(bounded(r) for r in reqs))
        elapsed = time.perf_counter() - t0
        report = summarize(outcomes, elapsed, args)
        if args.check_greedy:
            report["greedy_mismatches"] = await greedy_mismatches(
                client, args.url, model, reqs, outcomes
            )
    return report


async def greedy_mismatches(client, url, model, reqs, outcomes) -> int:
    alone: dict[Request, str] = {}
    for req in dict.fromkeys(reqs):
        alone[req] = (await one(client, url, model, req)).text
    return sum(1 for r, o in zip(reqs, outcomes) if o.ok and o.text != alone[r])


def summarize(outcomes: list[Outcome], elapsed: float, args) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok]
    itl = [x for o in ok for x in o.itl_s]
    tokens = sum(o.output_tokens for o in ok)
    return {
        "url": args.url,
        "requests": len(outcomes),
        "concurrency": args.concurrency,
        "failures": len(outcomes) - len(ok),
        "first_errors": [o.error for o in outcomes if not o.ok][:5],
        "elapsed_s": round(elapsed, 3),
        "request_throughput_per_s": round(len(ok) / elapsed, 3),
        "output_token_throughput_per_s": round(tokens / elapsed, 2),
        "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 2),
        "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 2),
        "itl_p50_ms": round(1000 * percentile(itl, 0.5), 2),
        "itl_p99_ms": round(1000 * percentile(itl, 0.99), 2),
        "mean_output_tokens": round(statistics.mean([o.output_tokens for o in ok]), 2) if ok else 0,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-words", type=int, nargs="+", default=[8, 32, 96])
    p.add_argument("--output-tokens", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--check-greedy", action="store_true")
    p.add_argument("--out", help="also write the JSON report to this file")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
