"""Prefix caching through `orbit serve` (real processes, TP 1 and 2): greedy outputs with the
cache on equal those with it off for shared-prefix, diverging, multi-turn and n > 1 requests,
in a pool small enough to evict cached pages and preempt; usage and /metrics report the hits."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server import ServerProcess

SYSTEM = (
    "You are a careful assistant for a small library. Answer in one sentence, name the rule "
    "you used, and never invent a book that is not in the catalogue. "
)
QUESTIONS = [
    "Which books are due this week?",
    "Can I renew a book twice?",
    "What is the fine for a lost map?",
    "Are e-books counted in the loan limit?",
    "Who may borrow rare manuscripts?",
    "Do children need a guardian's card?",
]
TURNS = [" Tell me more.", " Why is that?", " Thank you; one last thing?"]
GEN = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


async def _workload(url: str) -> dict:
    """Every request kind, in the order a cache can help: concurrent shared-prefix prompts,
    the same prompts again, prompts that diverge mid-page, n > 1, and multi-turn chats that
    resend their history. Returns every text produced and the usage of repeated prompts."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    model = (await client.models.list()).data[0].id

    async def complete(prompt: str, **kw) -> openai.types.Completion:
        return await client.completions.create(model=model, prompt=prompt, **{**GEN, **kw})

    out: dict = {}
    first = await asyncio.gather(*(complete(SYSTEM + q) for q in QUESTIONS))
    out["shared"] = [r.choices[0].text for r in first]
    again = await asyncio.gather(*(complete(SYSTEM + q) for q in QUESTIONS))
    out["again"] = [r.choices[0].text for r in again]
    out["again_cached"] = [r.usage.prompt_tokens_details.cached_tokens for r in again]
    out["again_uncached"] = [r.usage.prompt_tokens - n for r, n in zip(again, out["again_cached"])]
    stem = SYSTEM + "Summarise the loan rules for"
    diverging = await asyncio.gather(*(complete(f"{stem} {who}.") for who in ("staff", "guests")))
    out["diverging"] = [r.choices[0].text for r in diverging]
    many = await complete(SYSTEM + "List three services.", n=3)
    out["n3"] = [c.text for c in sorted(many.choices, key=lambda c: c.index)]

    async def conversation(question: str) -> list[str]:
        history = SYSTEM + question
        for turn in TURNS:
            history += (await complete(history)).choices[0].text + turn
        return [history]

    chats = await asyncio.gather(*(conversation(q) for q in QUESTIONS[:3]))
    out["multi_turn"] = chats
    await client.close()
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_outputs_with_the_cache_equal_outputs_without(tp, tiny_checkpoints, package_cache):
    pkg = package_cache(
        tiny_checkpoints["llama"], tp, max_batch=8, kv_page_size=4, max_step_tokens=32
    )
    with ServerProcess(pkg, "--kv-pages", "512", "--no-prefix-cache") as off:
        without = asyncio.run(_workload(off.url))
        metrics = off.metrics()
        assert "orbit_prefix_cache_hit_tokens_total" not in metrics
    assert without["again_cached"] == [0] * len(QUESTIONS)
    # 28 pages of 4 tokens: six ~45-token prompts with their output fill most of it, so cached
    # pages are evicted and, with n = 3 and the chats, sequences are preempted.
    with ServerProcess(pkg, "--kv-pages", "28") as on:
        with_cache = asyncio.run(_workload(on.url))
        metrics = on.metrics()
    for kind in ("shared", "again", "diverging", "n3", "multi_turn"):
        assert with_cache[kind] == without[kind], kind
    assert with_cache["shared"] == with_cache["again"]
    # The shared system prompt at least (the pool evicts some prompts' tails), and never the
    # last token: it is computed again for its logits.
    pairs = list(zip(with_cache["again_cached"], with_cache["again_uncached"]))
    assert all(cached >= 24 and uncached >= 1 for cached, uncached in pairs), pairs
    assert metrics["orbit_prefix_cache_hit_tokens_total"] > 0
    assert 0 < metrics["orbit_prefix_cache_hit_rate"] < 1
    assert metrics["orbit_kv_pages_in_use"] == 0
    assert metrics["orbit_prefix_cache_pages"] > 0
    assert metrics["orbit_prefix_cache_evictions_total"] > 0
    assert metrics["orbit_preemptions_total"] > 0
