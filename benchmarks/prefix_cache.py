"""Prefix caching, with and without, in one run: one set of ranks, an engine core with the cache
off and then one with it on (orbit/core/engine.py, in this process: the cache lives in the core,
so HTTP would add the same cost to both), the same requests to each. Greedy, EOS ignored.

- ttft_alone: a request of a --system-tokens system prompt and a --turn-tokens user turn, sent
  alone after another request with the same system prompt: the cached prefix's TTFT against
  the uncached one (median of --probes).
- shared_system: --users concurrent users, each sending 2 requests of the system prompt and a
  distinct user turn, --reply-tokens each: TTFT p50/p99, output tokens/s, requests/s.
- multi_turn: --users concurrent chats of --turns turns; each turn resends the conversation so
  far (system prompt, every earlier turn and reply) with a new user turn: requests/s.
- no_sharing: --users concurrent streams over 2 x --users requests of distinct prompts (512
  tokens, 256 new: the shape of benchmarks/serving_sweep.py's levels), run off/on/off/on:
  output tokens/s.

    python3 -m benchmarks.prefix_cache --package PKG --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.step_overhead import GREEDY, engine_config, local_ranks, prompt, running_engine
from orbit.core.engine import Engine
from runtime.package import Package, open_package


async def timed(engine: Engine, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(TTFT in s, the tokens generated)."""
    t0, ttft, tokens = time.perf_counter(), None, []
    async for out in engine.generate(ids, max_tokens, GREEDY, ignore_eos=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        tokens += out.token_ids
    return ttft, tokens


def _turn(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(n)]


def _pcts(values: list[float]) -> dict:
    v = sorted(values)
    return {
        "p50_ms": round(statistics.median(v) * 1e3, 2),
        "p99_ms": round(v[min(len(v) - 1, int(0.99 * len(v)))] * 1e3, 2),
    }


async def ttft_alone(engine: Engine, pkg: Package, args, system: list[int]) -> dict:
    rng, vocab = random.Random(1), pkg.spec.vocab_size
    await timed(engine, system + _turn(rng, vocab, args.turn_tokens), 2)  # caches the system
    ttfts, first_steps = [], []
    for _ in range(args.probes):
        engine.recent_timings.clear()
        ttft, _ = await timed(engine, system + _turn(rng, vocab, args.turn_tokens), 2)
        ttfts.append(ttft)
        # rank 0's (execute_s, gpu_s) of the prefill, the longest of the probe's steps (the
        # first may be a step that only releases the previous probe)
        first_steps.append(max(engine.recent_timings))
    # Where the first token's time goes: the rank's whole step (execute) and its GPU part.
    return {
        "ttft_ms": round(statistics.median(ttfts) * 1e3, 2),
        "first_step_execute_ms": round(statistics.median(t[0] for t in first_steps) * 1e3, 2),
        "first_step_gpu_ms": round(statistics.median(t[1] for t in first_steps) * 1e3, 2),
    }


async def shared_system(engine: Engine, pkg: Package, args, system: list[int]) -> dict:
    rng, vocab = random.Random(2), pkg.spec.vocab_size
    requests = [system + _turn(rng, vocab, args.turn_tokens) for _ in range(2 * args.users)]
    gate = asyncio.Semaphore(args.users)

    async def one(ids):
        async with gate:
            return await timed(engine, ids, args.reply_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(ids) for ids in requests))
    elapsed = time.perf_counter() - t0
    tokens = sum(len(t) for _, t in results)
    return {
        "ttft": _pcts([ttft for ttft, _ in results]),
        "tokens_per_s": round(tokens / elapsed, 1),
        "requests_per_s": round(len(requests) / elapsed, 2),
    }


async def multi_turn(engine: Engine, pkg: Package, args, system: list[int]) -> dict:
    vocab = pkg.spec.vocab_size

    async def chat(user: int) -> list[float]:
        rng, history, ttfts = random.Random(100 + user), list(system), []
        for _ in range(args.turns):
            history += _turn(rng, vocab, args.turn_tokens)
            ttft, reply = await timed(engine, history, args.reply_tokens)
            history += reply
            ttfts.append(ttft)
        return ttfts

    t0 = time.perf_counter()
    chats = await asyncio.gather(*map(chat, range(args.users)))
    ttfts = [t for chat_ttfts in chats for t in chat_ttfts]
    elapsed = time.perf_counter() - t0
    return {
        "requests_per_s": round(len(ttfts) / elapsed, 2),
        "ttft": _pcts(ttfts),
        "seconds": round(elapsed, 2),
    }


async def no_sharing(engine: Engine, pkg: Package, args, salt: int) -> float:
    gate = asyncio.Semaphore(args.users)

    async def one(ids):
        async with gate:
            return len((await timed(engine, ids, args.plain_new_tokens))[1])

    requests = [prompt(pkg, args.plain_prompt_tokens, salt=salt + i) for i in range(2 * args.users)]
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*map(one, requests)))
    return round(tokens / (time.perf_counter() - t0), 1)


async def run(args) -> dict:
    pkg = open_package(args.package)
    longest = args.system_tokens + args.turns * (args.turn_tokens + args.reply_tokens)
    if longest > pkg.capacities.max_seq_len:
        raise SystemExit(f"the last turn ({longest} tokens) exceeds max_seq_len")
    rng = random.Random(0)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    async with local_ranks(pkg, args.device, args.kv_pages) as link:
        salt = 1
        for rounds in range(2):
            for cache in (False, True):
                # A fresh system prompt per engine: nothing cached carries over.
                system = _turn(rng, pkg.spec.vocab_size, args.system_tokens)
                config = replace(engine_config(pkg, overlap=True), prefix_cache=cache)
                key = "cache" if cache else "no_cache"
                async with running_engine(config, link) as engine:
                    await timed(engine, prompt(pkg, 64, salt=10**6), 4)  # warm-up
                    if rounds == 0 and not cache:  # the first timed pass must not be cold
                        await no_sharing(engine, pkg, args, 10**7)
                    part = report.setdefault(key, {})
                    if rounds == 0:
                        part["ttft_alone"] = await ttft_alone(engine, pkg, args, system)
                        print(key, "ttft_alone", part["ttft_alone"], flush=True)
                        part["shared_system"] = await shared_system(engine, pkg, args, system)
                        print(key, "shared_system", part["shared_system"], flush=True)
                        if args.turns:
                            part["multi_turn"] = await multi_turn(engine, pkg, args, system)
                            print(key, "multi_turn", part["multi_turn"], flush=True)
                    tokens_per_s = await no_sharing(engine, pkg, args, salt)
                    salt += 4 * args.users
                    part.setdefault("no_sharing_tokens_per_s", []).append(tokens_per_s)
                    print(key, "no_sharing", tokens_per_s, flush=True)
    on, off = report["cache"], report["no_cache"]
    report["ratios"] = {
        "ttft_alone_cached_over_uncached": round(
            on["ttft_alone"]["ttft_ms"] / off["ttft_alone"]["ttft_ms"], 4
        ),
        "shared_system_ttft_p50_cached_over_uncached": round(
            on["shared_system"]["ttft"]["p50_ms"] / off["shared_system"]["ttft"]["p50_ms"], 4
        ),
        "no_sharing_cached_over_uncached": round(
            statistics.mean(on["no_sharing_tokens_per_s"])
            / statistics.mean(off["no_sharing_tokens_per_s"]),
            4,
        ),
    }
    if args.turns:
        report["ratios"]["multi_turn_requests_cached_over_uncached"] = round(
            on["multi_turn"]["requests_per_s"] / off["multi_turn"]["requests_per_s"], 3
        )
    print(json.dumps(report["ratios"]), flush=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--package", required=True, type=Path)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kv-pages", type=int, default=0, help="per rank; 0 sizes from memory")
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--plain-prompt-tokens", type=int, default=512)
    p.add_argument("--plain-new-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, help="write the JSON report to DIR/prefix_cache.json")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix_cache.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
