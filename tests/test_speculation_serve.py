"""Speculative decoding through `orbit serve` (real processes, TP 1 and 2, the official openai
client): with n-gram proposals on, greedy and seeded outputs equal those with it off, token for
token, for copy-heavy prompts, stop strings, max_tokens landing inside a kept run, n > 1,
logprobs, preemption in a small pool and a cancelled stream; unseeded sampling draws from the
same distribution; /metrics reports the proposals."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from tests.server import ServerProcess

PASSAGE = (
    "The river rose in the night and the old mill wheel turned faster than it had in years. "
    "By morning the miller's daughter had counted the sacks twice and written the numbers on "
    "the slate beside the door. "
)
PROMPTS = [
    "Copy this passage exactly:\n" + PASSAGE + "\nCopy:\n" + PASSAGE[:60],
    (
        "def area(w, h):\n    return w * h\n\ndef volume(w, h, d):\n    return area(w, h) * d\n\n"
        "def area(w, h):\n    return"
    ),
    "one two three four one two three four one two three",
    "Edit the passage so that it is in the present tense:\n" + PASSAGE,
    "a b c a b c a b c a b",
]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


async def _workload(url: str) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    model = (await client.models.list()).data[0].id

    async def complete(prompt: str, **kw) -> openai.types.Completion:
        return await client.completions.create(model=model, prompt=prompt, **kw)

    out: dict = {}
    greedy = await asyncio.gather(*(complete(p, max_tokens=40, **GREEDY) for p in PROMPTS))
    out["greedy"] = [r.choices[0].text for r in greedy]
    lengths = [3, 7, 13, 21, 34]  # several end inside what one verification adds
    short = await asyncio.gather(
        *(complete(p, max_tokens=n, **GREEDY) for p, n in zip(PROMPTS, lengths))
    )
    out["short"] = [(r.choices[0].text, r.usage.completion_tokens) for r in short]
    # A stop string from the middle of an output: the same in both runs when outputs are.
    text = out["greedy"][0]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    stopped = await complete(PROMPTS[0], max_tokens=40, stop=[stop], **GREEDY)
    out["stop"] = (stop, stopped.choices[0].text, stopped.choices[0].finish_reason)
    seeded = await asyncio.gather(
        *(
            complete(
                p,
                max_tokens=30,
                temperature=0.7,
                top_p=0.95,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            for i, p in enumerate(PROMPTS)
        )
    )
    out["seeded"] = [r.choices[0].text for r in seeded]
    many = await complete(
        PROMPTS[2], max_tokens=25, n=3, temperature=0.5, seed=7, extra_body={"ignore_eos": True}
    )
    out["n3"] = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    lp = await complete(PROMPTS[4], max_tokens=12, logprobs=2, **GREEDY)
    out["logprobs"] = lp.choices[0].logprobs.tokens
    out["logprob_values"] = lp.choices[0].logprobs.token_logprobs
    # A stream cancelled after a few chunks: its pages come back (checked by the caller).
    stream = await complete(PROMPTS[0], max_tokens=60, stream=True, **GREEDY)
    chunks = 0
    async for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    await stream.close()
    after = await complete(PROMPTS[1], max_tokens=40, **GREEDY)
    out["after_cancel"] = after.choices[0].text
    await client.close()
    return out


# The last case also passes --exact-verification, which CPU ranks take and leave as they are
# (the exact graphs are CUDA's; tests/gpu/test_serve_cuda.py).
@pytest.mark.parametrize(
    ("tp", "spec_args"),
    [
        (1, ()),
        (2, ()),
        (1, ("--spec-tokens", "8", "--ngram-min", "3", "--exact-verification")),
    ],
)
def test_outputs_with_speculation_equal_outputs_without(
    tp, spec_args, tiny_checkpoints, package_cache
):
    pkg = package_cache(
        tiny_checkpoints["llama"], tp, max_batch=8, kv_page_size=4, max_step_tokens=32
    )
    with ServerProcess(pkg, "--kv-pages", "512") as off:
        without = asyncio.run(_workload(off.url))
        assert "orbit_spec_proposed_tokens_total" not in off.metrics()
    # 40 pages of 4 tokens: five prompts of ~60 tokens with their outputs preempt.
    with ServerProcess(pkg, "--kv-pages", "40", "--speculate", "ngram", *spec_args) as on:
        with_spec = asyncio.run(_workload(on.url))
        metrics = on.metrics()
    for kind in without.keys() - {"logprob_values"}:
        assert with_spec[kind] == without[kind], kind
    assert with_spec["logprob_values"] == pytest.approx(without["logprob_values"], abs=1e-3)
    assert [n for _, n in with_spec["short"]] == [3, 7, 13, 21, 34]
    stop, text, reason = with_spec["stop"]
    assert reason == "stop" and stop not in text
    # (rejections and the KV they leave behind: tests/test_speculation.py, test_rank_steps.py)
    proposed = metrics["orbit_spec_proposed_tokens_total"]
    assert proposed >= metrics["orbit_spec_accepted_tokens_total"] > 0
    assert metrics["orbit_spec_mean_acceptance_length"] > 1
    assert "orbit_spec_waits_total" in metrics  # (when counted: tests/test_speculation.py)
    assert 0 <= metrics["orbit_spec_guess_min_rate"] <= 0.95
    assert metrics["orbit_preemptions_total"] > 0
    assert metrics["orbit_kv_pages_in_use"] == 0


def _permutation_p(a: list, b: list, rounds: int = 2000) -> float:
    """Two-sample test that a and b come from one distribution: the chi-square statistic of
    their counts against its distribution under random relabelling."""

    def stat(x, y):
        cats = set(x) | set(y)
        total = 0.0
        for c in cats:
            cx, cy = x.count(c), y.count(c)
            expected_x = (cx + cy) * len(x) / (len(x) + len(y))
            expected_y = (cx + cy) - expected_x
            total += (cx - expected_x) ** 2 / expected_x + (cy - expected_y) ** 2 / expected_y
        return total

    observed, pooled, rng = stat(a, b), a + b, random.Random(0)
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        hits += stat(pooled[: len(a)], pooled[len(a) :]) >= observed
    return (hits + 1) / (rounds + 1)


def test_sampling_with_speculation_draws_from_the_same_distribution(smollm2_path, package_cache):
    """Unseeded draws of the real SmolLM2 continuing a repeated sentence (so proposals are often
    kept, and sometimes not): the outputs' distribution with speculation is that without. A
    broken acceptance rule (keeping proposals the draw did not make) would skew it toward
    repeating the prompt."""
    check_same_distribution(package_cache(smollm2_path, 1), ("--speculate", "ngram"))


def check_same_distribution(pkg, spec_args: tuple[str, ...]) -> None:
    """Serve pkg without speculation and then with spec_args; 160 unseeded 6-token draws at
    temperature 1 after a repeated sentence from each: proposals both kept and rejected, and
    the two sets of outputs (whole, and their last words) from one distribution."""
    prompt = "The fox jumps over the dog. The fox jumps over the dog. The fox jumps over the"

    async def draws(url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = (await client.models.list()).data[0].id
        texts = []
        for _ in range(20):
            r = await client.completions.create(
                model=model, prompt=prompt, max_tokens=6, temperature=1.0, n=8,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            texts += [c.text for c in r.choices]
        await client.close()
        return texts

    with ServerProcess(pkg, "--kv-cache-mb", "128") as off:
        without = asyncio.run(draws(off.url))
    with ServerProcess(pkg, "--kv-cache-mb", "128", *spec_args) as on:
        with_spec = asyncio.run(draws(on.url))
        metrics = on.metrics()
    kept = metrics["orbit_spec_accepted_tokens_total"]
    assert 0 < kept < metrics["orbit_spec_proposed_tokens_total"]  # kept and rejected
    assert 3 < len(set(without)) < len(without)  # the outputs vary, and repeat
    # whole outputs, and their last words (where proposals from the first ones can be kept)
    assert _permutation_p(without, with_spec) > 0.001
    tails = [[t.split()[-1] if t.split() else "" for t in ts] for ts in (without, with_spec)]
    assert _permutation_p(*tails) > 0.001


def test_the_engine_prices_a_wait_against_a_step(tiny_checkpoints, package_cache):
    """The engine core times the round trip a waiting sequence pays (the ranks' idle before a
    step sent the moment the last one answered, nothing else in flight) against a step, and
    sets from them the rate of right guesses above which a sequence decoding alone guesses the
    token being drawn rather than waits for it: 1 - round trip / step. Real rank processes."""
    from dataclasses import replace

    from benchmarks.step_overhead import engine_config, local_ranks, running_engine
    from proto import wire_pb2
    from runtime.package import open_package
    from runtime.speculation import GUESS_MIN_RATE, SpeculationConfig

    pkg = open_package(package_cache(tiny_checkpoints["llama"], 1, max_batch=8, kv_page_size=4))
    greedy = wire_pb2.SamplingParams(temperature=0, num_logprobs=-1)

    async def main():
        async with local_ranks(pkg, "cpu", 256) as link:
            config = replace(engine_config(pkg, overlap=True), speculation=SpeculationConfig())
            async with running_engine(config, link) as engine:
                # prompts whose tails repeat: each first decode waits for the first token
                for i in range(3):
                    prompt = [5 + i, 9, 13, 2] * 6
                    async for _ in engine.generate(prompt, 24, greedy, ignore_eos=True):
                        pass
                return engine.scheduler.guess_min_rate, engine.step_cost_s, engine.round_trip_s

    rate, step_s, trip_s = asyncio.run(main())
    assert step_s > 0 and trip_s > 0
    assert rate == pytest.approx(min(max(1 - trip_s / step_s, 0.0), 0.95))
    assert rate != GUESS_MIN_RATE


def _margin_safe_prefix(tops: list) -> int:
    """How many leading greedy tokens must agree, given the reference's (top ids, top logprobs)
    per token: up to the first position where its two best lie within float noise of each
    other (there another batch shape may flip the argmax, with or without speculation)."""
    for i, (_, top_lps) in enumerate(tops):
        if len(top_lps) > 1 and top_lps[0] - top_lps[1] < 1e-3:
            return i
    return len(tops)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_through_real_ranks_match_without_speculation(
    seed, tiny_checkpoints, package_cache
):
    """Random requests (repeating and plain prompts, greedy and seeded, lengths that end inside
    kept runs) through the engine core and real rank processes, all at once: without
    speculation in a roomy pool, then with random n-gram settings and stream interval in a
    pool small enough to preempt. Every request gets the same tokens and finish; greedy ones
    up to the reference's first near-tie."""
    from dataclasses import replace

    from benchmarks.step_overhead import engine_config, local_ranks, running_engine
    from proto import wire_pb2
    from runtime.package import open_package
    from runtime.speculation import SpeculationConfig

    rng = random.Random(seed)
    pkg = open_package(
        package_cache(tiny_checkpoints["llama"], 1, max_batch=8, kv_page_size=4, max_step_tokens=32)
    )
    requests = []
    for i in range(12):
        n = rng.randint(4, 40)
        period = rng.choice([3, 5, 7, n])  # n: no repeat within the prompt
        pattern = [rng.randrange(1, 4000) for _ in range(period)]
        prompt = [pattern[j % period] for j in range(n)]
        if rng.random() < 0.5:
            params = wire_pb2.SamplingParams(temperature=0, num_logprobs=2)
        else:
            params = wire_pb2.SamplingParams(temperature=0.8, seed=100 + i, num_logprobs=-1)
        requests.append((prompt, rng.randint(1, 40), params))
    spec = SpeculationConfig(num_tokens=rng.choice([2, 4, 8, 16]), ngram_min=rng.randint(1, 3))
    interval = rng.choice([1, 3])

    async def run(kv_pages: int, speculation, stream_interval: int):
        async with local_ranks(pkg, "cpu", kv_pages) as link:
            config = replace(
                engine_config(pkg, overlap=True),
                speculation=speculation,
                stream_interval=stream_interval,
            )
            async with running_engine(config, link) as engine:

                async def one(prompt, max_tokens, params):
                    outs = [o async for o in engine.generate(prompt, max_tokens, params, True)]
                    tops = [(list(t.token_ids), list(t.logprobs)) for o in outs for t in o.top]
                    return [t for o in outs for t in o.token_ids], outs[-1].finish, tops

                results = await asyncio.gather(*(one(*r) for r in requests))
                s = engine.scheduler
                return results, (s.spec_proposed, s.num_preemptions)

    without, _ = asyncio.run(run(512, None, 1))
    with_spec, (proposed, preemptions) = asyncio.run(run(40, spec, interval))
    assert proposed > 0 and preemptions > 0
    for (prompt, max_tokens, params), off, on in zip(requests, without, with_spec):
        tokens_off, finish_off, tops = off
        tokens_on, finish_on, _ = on
        if params.temperature == 0:
            agree = _margin_safe_prefix(tops)
            assert tokens_on[:agree] == tokens_off[:agree], (spec, interval)
            if agree == len(tokens_off):
                assert (tokens_on, finish_on) == (tokens_off, finish_off)
        else:
            assert (tokens_on, finish_on) == (tokens_off, finish_off), (spec, interval)
        assert len(tokens_on) == max_tokens  # EOS ignored
