"""The host work of one decode step at B rows, without a model: the engine core's (schedule,
plan, apply, outputs) and the rank's (read the plan, build the runner's inputs, report the
samples), the parts of the chain between two steps that are the same on every device.

    python3 -m benchmarks.host_step [--rows 256] [--steps 300]

With the frontend one step ahead, a GPU waits between steps whenever this chain (rank 0
reports step N, the core applies it and plans N+2, rank 0 stages N+2) outlasts a step on the
GPU (on an H100 with FP8 weights and KV, 1.6 ms on that host against a 12.6 ms 256-row step:
docs/performance.md, 2026-12-06 15:48). The core runs the real Engine and Scheduler over a
link that answers each plan at once, its own time less the stand-in's; the rank runs the real
StepExecutor over a runner that returns logits without computing any, plans made as the
engine makes them. Both print ms per step.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import types

GREEDY = {"temperature": 0.0, "num_logprobs": -1}


class _AnsweringLink:
    """Stands in for the ranks: each plan is answered at once with token 7 for every sampling
    row, sent packed as rank 0 sends a step of tokens alone."""

    num_kv_pages, exact_rows, steps_in_flight = 1 << 20, 0, 0

    def __init__(self):
        self.ranks = [types.SimpleNamespace(ready=types.SimpleNamespace(draft_digest=""))]
        self.spent_s = 0.0  # the stand-in's own time, taken off the core's

    async def wait_ready(self, timeout_s: float) -> None:
        pass

    def submit(self, plan):
        from proto import wire_pb2

        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        data = wire_pb2.ToRank(step=plan).SerializeToString()
        plan = wire_pb2.ToRank.FromString(data).step
        ids = [s.seq_id for s in plan.seqs if s.sample] + list(plan.decode.seq_ids)
        result = wire_pb2.StepResult(step_id=plan.step_id)
        result.sample_seq_ids.extend(ids)
        result.sample_token_ids.extend([7] * len(ids))
        data = result.SerializeToString()
        self.spent_s += time.perf_counter() - t0
        fut.set_result(wire_pb2.StepResult.FromString(data))
        return fut

    async def result(self, step_id: int, fut, timeout_s: float):
        return await fut

    def abandon(self, step_id: int, fut) -> None:
        pass


async def core_ms(rows: int, steps: int) -> float:
    """The engine core's ms per step while `rows` sequences decode `steps` tokens each."""
    from orbit.core.engine import Engine, EngineConfig, Sink
    from proto import wire_pb2

    class Ended(Sink):
        def __init__(self):
            super().__init__()
            self.ended = 0

        def deliver(self, outputs) -> None:
            self.ended += sum(o.finish != 0 for o in outputs.outputs)

    config = EngineConfig(
        max_seq_len=4096, max_batch=rows, page_size=16, max_step_tokens=8192,
        eos_token_ids=(2,), overlap=True,
    )  # fmt: skip
    link = _AnsweringLink()
    engine = Engine(config, link)
    await engine.start(1.0)
    sink = Ended()
    for key in range(rows):
        params = wire_pb2.SamplingParams(**GREEDY)
        engine.submit(sink, key, [3 + key] * 16, steps, params, ignore_eos=True)
    loop = asyncio.create_task(engine.run())
    t0 = time.perf_counter()
    while sink.ended < rows and not loop.done():
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - t0
    loop.cancel()
    return (elapsed - link.spent_s) / engine.steps * 1e3


def rank_ms(rows: int, steps: int) -> tuple[float, float]:
    """The rank's ms per step: (read the plan and launch, finish and serialize the result)."""
    import torch

    from orbit.core.engine import write_decode_rows
    from proto import wire_pb2
    from ranks.steps import StepExecutor
    from runtime.sampling import Sampled

    class NoModel:
        def step(self, inputs):
            return torch.zeros(len(inputs), 8)

        def feed(self, tokens) -> None:
            pass

    def draw(logits, params, positions):
        return [Sampled(7, float("nan"), ()) for _ in params]

    executor = StepExecutor(NoModel(), 0, torch.device("cpu"), draw, None, rows)
    first = wire_pb2.StepPlan(step_id=1)
    for i in range(rows):
        first.new_seqs.add(seq_id=i + 1, sampling=wire_pb2.SamplingParams(**GREEDY))
        pages = range(i * 64, i * 64 + 2)
        first.seqs.add(seq_id=i + 1, token_ids=[5] * 16, start_pos=0, new_pages=pages, sample=True)
    previous = executor.launch(first, None)
    executor.finish(previous)
    plans = []
    for step in range(steps):
        pos = 16 + step
        decode = []
        for i in range(rows):  # as the engine plans them: a page every 16 tokens
            new = [i * 64 + pos // 16] if pos % 16 == 0 and pos >= 32 else []
            chunk = types.SimpleNamespace(seq=types.SimpleNamespace(seq_id=i + 1),
                                          start_pos=pos, new_pages=new)  # fmt: skip
            decode.append(chunk)
        plan = wire_pb2.StepPlan(step_id=step + 2)
        write_decode_rows(plan, decode)
        plans.append(wire_pb2.ToRank(step=plan).SerializeToString())
    launch_s = finish_s = 0.0
    for data in plans:
        t0 = time.perf_counter()
        launched = executor.launch(wire_pb2.ToRank.FromString(data).step, previous)
        t1 = time.perf_counter()
        executor.finish(previous).SerializeToString()
        finish_s += time.perf_counter() - t1
        launch_s += t1 - t0
        previous = launched
    return launch_s / steps * 1e3, finish_s / steps * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    core = asyncio.run(core_ms(args.rows, args.steps))
    launch, finish = rank_ms(args.rows, args.steps)
    print(
        f"{args.rows} decode rows: core {core:.3f} ms a step; rank {launch:.3f} ms to read the "
        f"plan and launch, {finish:.3f} ms to report; {core + launch + finish:.3f} ms together"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
