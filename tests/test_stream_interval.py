"""`--stream-interval N`: a sequence's tokens reach its owner in groups of N (its first token
and its last at once; every stream's groups go out on the same steps, so a stream's second
group may be shorter while it falls in step), the same tokens, logprobs and finish as one at a
time. Real rank processes (CPU) behind the engine core in this process, then a real `orbit
serve` through the official client, stop strings included."""

from __future__ import annotations

import asyncio
import dataclasses

import openai
import pytest

from benchmarks.step_overhead import engine_config, local_ranks, running_engine
from orbit.core.engine import Sink
from proto import core_pb2, wire_pb2
from runtime.package import open_package
from runtime.speculation import SpeculationConfig
from tests.server import ServerProcess

# Each repeats a 6-token pattern, so n-gram speculation has matches to propose from.
PROMPTS = [[(300 + 17 * i + 101 * (j % 6)) % 4000 for j in range(5 + 7 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def pkg_path(tiny_checkpoints, package_cache):
    return package_cache(tiny_checkpoints["llama"], 1, max_batch=8, kv_page_size=4)


async def _outputs(engine, prompt, params, max_tokens):
    return [out async for out in engine.generate(prompt, max_tokens, params, ignore_eos=False)]


def _run_both(pkg, eos: int):
    """Every prompt's outputs with interval 1, with 5, and with 5 and n-gram speculation (which
    brings several tokens a step), all at once (greedy; seeded sampling with top logprobs), with
    an EOS token that some draw mid-stream. Also the tokens the speculating run proposed."""
    params = [
        wire_pb2.SamplingParams(temperature=0, num_logprobs=-1),
        wire_pb2.SamplingParams(temperature=0.9, seed=7, num_logprobs=2),
    ]

    async def main():
        runs, proposed = {}, 0
        async with local_ranks(pkg, "cpu", 256) as link:
            for interval, spec in ((1, None), (5, None), (5, SpeculationConfig())):
                config = dataclasses.replace(
                    engine_config(pkg, overlap=True),
                    eos_token_ids=(eos,),
                    stream_interval=interval,
                    speculation=spec,
                )
                async with running_engine(config, link) as engine:
                    runs[interval, spec is not None] = await asyncio.gather(
                        *(_outputs(engine, p, params[i % 2], 23 + i) for i, p in enumerate(PROMPTS))
                    )
                    if spec is not None:
                        proposed = engine.scheduler.spec_proposed
        return runs, proposed

    return asyncio.run(main())


def _flat(outputs):
    return (
        [t for o in outputs for t in o.token_ids],
        [lp for o in outputs for lp in o.logprobs],
        [list(t.token_ids) for o in outputs for t in o.top],
        outputs[-1].finish,
    )


def test_grouped_outputs_carry_the_same_tokens_logprobs_and_finish(pkg_path):
    pkg = open_package(pkg_path)
    # an EOS that one request draws mid-stream: found with the interval-1 run of an arbitrary
    # token first, then the runs that count
    probe = _run_both(pkg, eos=-1)[0][1, False]
    eos = _flat(probe[0])[0][9]
    runs, proposed = _run_both(pkg, eos)
    finishes = []
    for one, grouped, speculated in zip(runs[1, False], runs[5, False], runs[5, True]):
        assert _flat(grouped) == _flat(one)
        sizes = [len(o.token_ids) for o in grouped]
        assert all(len(o.logprobs) in (0, len(o.token_ids)) for o in grouped)
        assert sizes[0] == 1 and 1 <= sizes[-1] <= 5
        assert len(sizes) < 3 or 1 <= sizes[1] <= 5 and all(n == 5 for n in sizes[2:-1])
        assert len(grouped) < len(one) or len(one) <= 2
        assert all(o.finish == core_pb2.FINISH_NONE for o in grouped[:-1])
        finishes.append(grouped[-1].finish)
        # With speculation a step may bring several tokens: a group goes out once it holds 5
        # or more, or on the steps every stream's groups go out (every fifth), so there are at
        # most two groups per five tokens besides the first and the last; tokens and finish as
        # one at a time, logprobs within float noise (a verification row computes them in
        # another batch shape).
        tokens, logprobs, tops, finish = _flat(speculated)
        assert (tokens, tops, finish) == (_flat(one)[0], _flat(one)[2], _flat(one)[3])
        assert logprobs == pytest.approx(_flat(one)[1], abs=1e-3)
        sizes = [len(o.token_ids) for o in speculated]
        assert sizes[0] == 1 and len(sizes) <= 2 + 2 * -(-sum(sizes) // 5)
    assert core_pb2.FINISH_STOP in finishes and core_pb2.FINISH_LENGTH in finishes
    assert proposed > 0


def test_streams_started_apart_send_their_groups_on_the_same_steps(pkg_path):
    """Four streams started two steps apart: after each stream's first token, every output that
    is neither a first token nor a last goes out on a step whose number is a multiple of the
    interval, so the owner gets one message for all of them there, not one on each step that
    some stream filled its group."""
    pkg, interval = open_package(pkg_path), 4
    sent: list[tuple[int, int, int]] = []  # (step, key, finish) of each output delivered

    class Recorder(Sink):
        def deliver(self, outputs) -> None:
            sent.extend((engine.steps, out.seq_key, out.finish) for out in outputs.outputs)
            sent.extend((engine.steps, key, core_pb2.FINISH_NONE) for key in outputs.next_keys)

    async def main():
        nonlocal engine
        async with local_ranks(pkg, "cpu", 256) as link:
            config = dataclasses.replace(engine_config(pkg, overlap=True), stream_interval=interval)
            async with running_engine(config, link) as engine, asyncio.timeout(120):
                sink = Recorder()
                params = wire_pb2.SamplingParams(temperature=0, num_logprobs=-1)
                for key, prompt in enumerate(PROMPTS):
                    engine.submit(sink, key, prompt, 30, params, ignore_eos=True)
                    start = engine.steps
                    while engine.steps < start + 2:
                        await asyncio.sleep(0.001)
                while sink.live:
                    await asyncio.sleep(0.01)

    engine = None
    asyncio.run(main())
    firsts = {}
    middles = 0
    for step, key, finish in sent:
        if key not in firsts:
            firsts[key] = step
        elif finish == core_pb2.FINISH_NONE:
            assert step % interval == 0, (step, key)
            middles += 1
    assert len(set(firsts.values())) == len(PROMPTS)  # the streams did start apart
    assert middles >= len(PROMPTS) * (30 // interval - 2)


def test_a_server_streams_in_groups_and_stops_at_a_stop_string(pkg_path):
    with ServerProcess(pkg_path, "--kv-pages", "256") as plain:
        client = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        ask = {"model": model, "prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0}
        text = client.completions.create(**ask).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    with ServerProcess(pkg_path, "--kv-pages", "256", "--stream-interval", "4") as grouped:
        client = openai.OpenAI(base_url=grouped.url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(**ask, stream=True))
        pieces = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(pieces) == text
        assert len([p for p in pieces if p]) <= 2 + 40 // 4
        stopped = list(client.completions.create(**ask, stop=[stop], stream=True))
        assert "".join(c.choices[0].text for c in stopped if c.choices) == text[: text.index(stop)]
        assert stopped[-1].choices[0].finish_reason == "stop"
