"""A request can fail only itself: a sequence whose draw fails on the ranks, or whose plan
cannot be built, ends alone with an error while the others finish with their own tokens and
the same rank group keeps serving; a step loop that dies fails the engine and says so. Real
rank processes (TP 2, gloo) driven by the frontend's engine in this process."""

from __future__ import annotations

import asyncio
import logging

import pytest

from benchmarks.step_overhead import engine_config, local_ranks, running_engine
from orbit.core.engine import SequenceFailed
from proto import core_pb2, wire_pb2
from runtime.package import open_package

PROMPT = [5, 9, 13, 2, 7, 11]
GREEDY = wire_pb2.SamplingParams(temperature=0, num_logprobs=-1)


@pytest.fixture(scope="module")
def pkg(tiny_checkpoints, package_cache):
    path = package_cache(tiny_checkpoints["llama"], 2, max_batch=8, kv_page_size=4)
    return open_package(path)


async def _tokens(engine, prompt, sampling, max_tokens: int = 12) -> list[int]:
    outputs = engine.generate(prompt, max_tokens, sampling, ignore_eos=True)
    return [t async for out in outputs for t in out.token_ids]


async def _outcome(engine, prompt, sampling, max_tokens: int = 12):
    try:
        return await _tokens(engine, prompt, sampling, max_tokens)
    except Exception as e:  # noqa: BLE001 - the test inspects which error it was
        return e


def _run(pkg, scenario):
    async def main():
        async with (
            local_ranks(pkg, "cpu", 256) as link,
            running_engine(engine_config(pkg, overlap=True), link) as engine,
        ):
            return await scenario(engine, link)

    return asyncio.run(main())


def test_a_draw_that_fails_on_the_ranks_ends_only_its_sequence(pkg):
    async def scenario(engine, link):
        alone = await _tokens(engine, PROMPT, GREEDY)
        # NaN passes the wire (the HTTP layer refuses it; this engine is driven directly): the
        # ranks' draw raises for that row only.
        bad = wire_pb2.SamplingParams(temperature=float("nan"), num_logprobs=-1)
        together = await asyncio.gather(
            _outcome(engine, PROMPT, GREEDY), _outcome(engine, PROMPT, bad)
        )
        after = await _tokens(engine, PROMPT, GREEDY)
        return alone, together, after, engine.is_ready(), link.failure

    alone, (good, bad), after, ready, failure = _run(pkg, scenario)
    assert isinstance(bad, SequenceFailed) and "sampling failed" in str(bad)
    assert bad.output.error == core_pb2.ERROR_SEQUENCE_FAILED
    assert good == alone and after == alone  # the other request, and the next, are unaffected
    assert ready and failure is None  # no engine failure, no rank-group failure


def test_a_sequence_whose_plan_cannot_be_built_ends_alone(pkg):
    async def scenario(engine, link):
        alone = await _tokens(engine, PROMPT, GREEDY)
        good = asyncio.ensure_future(_outcome(engine, PROMPT, GREEDY))
        bad = asyncio.ensure_future(_outcome(engine, PROMPT, GREEDY, max_tokens=13))
        await asyncio.sleep(0)  # both admitted, neither planned yet
        # A token id the wire cannot carry: a stand-in for any bug that makes one sequence's
        # part of a plan fail.
        (victim,) = [s for s in engine.scheduler.waiting if s.max_tokens == 13]
        victim.prompt_ids[0] = 1 << 40
        return alone, await good, await bad, engine.is_ready(), link.failure

    alone, good, bad, ready, failure = _run(pkg, scenario)
    assert isinstance(bad, SequenceFailed) and "planning failed" in str(bad)
    assert good == alone
    assert ready and failure is None


def test_a_step_loop_that_dies_fails_the_engine_and_logs_why(pkg, caplog):
    async def scenario(engine, link):
        await _tokens(engine, PROMPT, GREEDY)

        def broken():
            raise RuntimeError("scheduler bug")

        engine.scheduler.schedule = broken  # a bug inside the loop, whatever it may be
        outcome = await _outcome(engine, PROMPT, GREEDY)
        return outcome, engine.is_ready()

    with caplog.at_level(logging.ERROR, logger="orbit.core.engine"):
        outcome, ready = _run(pkg, scenario)
    assert isinstance(outcome, SequenceFailed) and "step loop failed" in str(outcome)
    assert outcome.output.error == core_pb2.ERROR_ENGINE_FAILED
    assert not ready  # /health answers 503 from here on
    assert any("the step loop failed" in r.getMessage() for r in caplog.records)
