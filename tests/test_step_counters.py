"""The engine core's step counters (orbit_steps_total and the split beside it) over real CPU
ranks: what each step computed, and the token bucket a GPU would replay it in."""

from __future__ import annotations

import asyncio
import json
import shutil

from benchmarks.step_overhead import engine_config, local_ranks, running_engine
from proto import wire_pb2
from runtime.package import open_package
from runtime.spec import token_bucket

MAX_TOKENS = 5


def test_token_bucket_is_the_smallest_that_holds_the_step():
    buckets = (16, 32, 64, 128)
    assert [token_bucket(buckets, n) for n in (1, 16, 17, 33, 64, 65, 128)] == [
        16, 16, 32, 64, 64, 128, 128,
    ]  # fmt: skip


def test_prompt_steps_decode_steps_and_their_buckets(tiny_checkpoints, package_cache):
    """Requests one at a time: each prompt (at most the 64-token budget) is one prompt step of
    exactly its length, which a GPU replays in the smallest power-of-two bucket from 16 that
    holds it, and each later token one decode step of one row."""
    pkg = open_package(
        package_cache(tiny_checkpoints["llama"], 1, max_batch=4, kv_page_size=4, max_step_tokens=64)
    )
    assert pkg.capacities.prefill_chunk_sizes == (16, 32, 64)
    lengths = (20, 33, 64, 5)
    prompts = [[(500 + 97 * i + 13 * j) % 4000 for j in range(n)] for i, n in enumerate(lengths)]

    async def run() -> dict[str, int]:
        config = engine_config(pkg, overlap=True)
        async with (
            local_ranks(pkg, "cpu", kv_pages=64) as link,
            running_engine(config, link) as engine,
        ):
            params = wire_pb2.SamplingParams(temperature=0, num_logprobs=-1)
            before = _counts(engine)
            for prompt in prompts:
                outs = engine.generate(prompt, MAX_TOKENS, params, True)
                assert len([t async for out in outs for t in out.token_ids]) == MAX_TOKENS
            after = _counts(engine)
        return {k: after[k] - before[k] for k in after}

    got = asyncio.run(run())
    decode_steps = len(prompts) * (MAX_TOKENS - 1)
    assert got["prompt_steps"] == len(prompts)
    assert got["prompt_step_tokens"] == sum(lengths)
    assert got["prompt_bucket_tokens"] == 32 + 64 + 64 + 16
    assert got["decode_steps"] == decode_steps
    assert got["step_tokens"] == sum(lengths) + decode_steps
    # the rest only released finished sequences: at most one such step per request
    assert 0 <= got["steps"] - len(prompts) - decode_steps <= len(prompts)


def _counts(engine) -> dict[str, int]:
    names = ("steps", "step_tokens", "prompt_steps", "prompt_step_tokens", "decode_steps")
    return {n: getattr(engine, n) for n in names} | {
        "prompt_bucket_tokens": engine.prompt_bucket_tokens
    }


def test_a_prompt_step_is_cut_to_a_bucket_that_spares_padding(
    tiny_checkpoints, package_cache, tmp_path
):
    """A 600-token prompt alone, under a 2,048-token budget with power-of-two buckets: one step
    of 600 would replay the 1,024 bucket, so the scheduler computes 512 tokens, then 88 (a
    128 bucket): 640 rows on a GPU instead of 1,024, and the same greedy tokens as a package
    whose only bucket is the budget (where nothing is cut)."""

    def run(pkg) -> tuple[list[int], dict[str, int]]:
        async def go():
            async with (
                local_ranks(pkg, "cpu", kv_pages=256) as link,
                running_engine(engine_config(pkg, overlap=True), link) as engine,
            ):
                params = wire_pb2.SamplingParams(temperature=0, num_logprobs=-1)
                before = _counts(engine)
                outs = engine.generate(prompt, MAX_TOKENS, params, True)
                tokens = [t async for out in outs for t in out.token_ids]
                after = _counts(engine)
            return tokens, {k: after[k] - before[k] for k in after}

        return asyncio.run(go())

    # the tiny Llama with room for the prompt (RoPE: its weights do not depend on the length)
    source = tmp_path / "llama-1024"
    shutil.copytree(tiny_checkpoints["llama"], source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    prompt = [(300 + 7 * j) % 4000 for j in range(600)]
    common = {"max_batch": 4, "kv_page_size": 16, "max_seq_len": 1024, "max_step_tokens": 2048}
    cut = open_package(package_cache(source, 1, **common))
    whole = open_package(package_cache(source, 1, prefill_buckets=(2048,), **common))
    assert whole.capacities.prefill_chunk_sizes == (2048,)
    tokens, got = run(cut)
    assert got["prompt_steps"] == 2 and got["prompt_step_tokens"] == 600
    assert got["prompt_bucket_tokens"] == 512 + 128
    whole_tokens, whole_got = run(whole)
    assert whole_got["prompt_steps"] == 1 and whole_got["prompt_bucket_tokens"] == 2048
    assert tokens == whole_tokens
