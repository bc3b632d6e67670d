"""What the frontend costs between steps: requests through the Engine (no HTTP) and the rank
processes. At batch 1, first one step at a time, then with the next step sent ahead
(EngineConfig.overlap); at each larger --batch B, B concurrent requests, overlapped.

    python3 -m benchmarks.step_overhead --package PKG --device cuda [--prompt-tokens 512]
        [--new-tokens 256] [--tp 1] [--batch 1,8,64] [--out DIR]

The ranks are started on this machine as `orbit serve` starts them. For each mode it prints
the median interval between consecutive tokens as the frontend receives them, the median time
rank 0 spent on a step (StepResult.execute_s, which one step ahead includes the wait behind
the step before), and on CUDA the median GPU time of a step (StepResult.gpu_s, CUDA events
around its work) and the host overhead: 1 - GPU time / token interval, the share of each
token's time in which the GPU had nothing of this request's to do (scheduler, ZeroMQ round
trip, input staging and copies, sampling read-back). With --out, one JSON line per run is
appended to DIR/step_overhead.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from orbit.core.engine import Engine, EngineConfig
from orbit.core.local_ranks import LocalRankOptions, LocalRanks
from orbit.core.rank_link import RankLink
from proto import wire_pb2
from runtime.curve import ServerKeys, create_keys
from runtime.package import Package, open_package

READY_TIMEOUT_S = 600.0


@contextlib.asynccontextmanager
async def local_ranks(
    pkg: Package, device: str, kv_pages: int, draft: Path | None = None, exact: bool = False
) -> AsyncIterator[RankLink]:
    """The package's ranks as child processes, connected and ready; stopped on exit. draft:
    a package rank 0 drafts with (speculative decoding); exact: --exact-verification."""
    log_dir = Path(tempfile.mkdtemp(prefix="orbit-step-overhead-"))
    keys = create_keys(log_dir / "keys", pkg.tp_size)
    link = RankLink(pkg.tp_size, ServerKeys.load(keys), package_digest=pkg.digest)
    link.start()
    opts = LocalRankOptions(
        device=device, kv_pages=kv_pages, draft_package=draft, exact_verification=exact
    )
    ranks = LocalRanks(pkg.root, pkg.tp_size, link.endpoint, log_dir, opts, keys)
    ranks.start()
    try:
        await link.wait_ready(READY_TIMEOUT_S)
        yield link
    finally:
        await link.shutdown("benchmark done")
        await asyncio.to_thread(ranks.stop)
        link.close()


def engine_config(pkg: Package, overlap: bool) -> EngineConfig:
    caps = pkg.capacities
    return EngineConfig(
        max_seq_len=caps.max_seq_len,
        max_batch=caps.max_batch,
        page_size=caps.kv_page_size,
        max_step_tokens=caps.max_step_tokens,
        token_buckets=caps.prefill_chunk_sizes,
        eos_token_ids=tuple(pkg.manifest.tokenizer.eos_token_ids),
        overlap=overlap,
    )


@contextlib.asynccontextmanager
async def running_engine(config: EngineConfig, link: RankLink) -> AsyncIterator[Engine]:
    """An engine over ranks that are already ready, its step loop running until exit. Each
    engine numbers its sequences and steps from 1, so one engine at a time per link, and on
    exit the loop stops only once every step it sent has answered. While it runs, what existed
    when it started is frozen out of the garbage collector's reach, as `orbit serve` does after
    its start-up (and thawed on exit, for whatever runs next in the process): a full
    collection walks this process's heap (torch, transformers, the package) for 70-240 ms on
    the 2-core VM, and speculation's per-token tuples set one off within a pass (measured
    2026-12-05: one of 239 ms in a CPU pass), which a served engine never pays."""
    engine = Engine(config, link)
    await engine.start(READY_TIMEOUT_S)
    gc.collect()
    gc.freeze()
    loop = asyncio.create_task(engine.run())
    try:
        yield engine
    finally:
        while link.steps_in_flight and not loop.done():
            await asyncio.sleep(0.001)
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        gc.unfreeze()


GREEDY = wire_pb2.SamplingParams(temperature=0, num_logprobs=-1)


async def token_times(
    engine: Engine, prompt_ids: list[int], max_tokens: int, steps_at: list[int] | None = None
) -> list:
    """perf_counter() at each token's arrival (greedy, EOS ignored); with steps_at, appends
    how many step timings the engine held when the 9th token came (where decode begins)."""
    times = []
    async for out in engine.generate(prompt_ids, max_tokens, GREEDY, ignore_eos=True):
        if steps_at is not None and len(times) < DECODE_FROM <= len(times) + len(out.token_ids):
            steps_at.append(len(engine.recent_timings))
        times += [time.perf_counter()] * len(out.token_ids)
    return times


DECODE_FROM = 9  # a request's tokens from its 9th on come once every request decodes together


async def measure(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Run len(prompts) requests at once (the decode batch) after a one-request warm-up."""
    await token_times(engine, prompts[0], 4)
    engine.recent_timings.clear()
    steps_at: list[int] = []
    runs = await asyncio.gather(*(token_times(engine, p, new_tokens, steps_at) for p in prompts))
    # Intervals of the decode phase only: from each request's 8th token on, when every
    # request of the batch has finished its prefill and they step together.
    at = DECODE_FROM - 1
    intervals = [b - a for times in runs for a, b in zip(times[at:], times[at + 1 :])]
    itl_ms = statistics.median(intervals) * 1e3
    # Steps timed after every request had its 9th token: the full batch's decode steps (the
    # prefill of B prompts takes fewer steps than B once several fit the step's token budget).
    decode = list(engine.recent_timings)[max(steps_at) :]
    execute_ms = statistics.median(t[0] for t in decode) * 1e3
    gpu_ms = statistics.median(t[1] for t in decode) * 1e3
    out = {
        "batch": len(prompts),
        "median_token_interval_ms": round(itl_ms, 4),
        "median_rank_execute_ms": round(execute_ms, 4),
        "median_other_ms": round(itl_ms - execute_ms, 4),
        "tokens_per_s": round(len(prompts) * 1e3 / itl_ms, 2),
        "steps": len(engine.recent_timings),
    }
    if gpu_ms > 0:  # CUDA: the share of each token's interval the GPU did not work
        out["median_step_gpu_ms"] = round(gpu_ms, 4)
        out["host_overhead_frac"] = round(1 - gpu_ms / itl_ms, 4)
    return out


def _copy_bandwidth() -> float:
    import torch

    from benchmarks.decode import copy_bandwidth

    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    return bw


def roofline_tokens_per_s(pkg: Package, batch: int, context: float, bandwidth: float) -> float:
    """Decode tokens/s if a step took only its bytes over the copy bandwidth: every weight but
    the embedding table (one rank's share), each sequence's KV, the float32 logits written
    (the same model as benchmarks/decode.py's roofline)."""
    from runtime.layout import shard_shapes

    spec, tp = pkg.spec, pkg.tp_size
    weights = sum(
        math.prod(shape) * 2
        for name, shape in shard_shapes(spec, tp).items()
        if name != "embed.weight"
    )
    kv_per_token = spec.num_layers * 2 * (spec.num_kv_heads // tp) * spec.head_dim * 2
    step_bytes = weights + batch * context * kv_per_token + batch * spec.vocab_size * 4
    return batch * bandwidth / step_bytes


def prompt(pkg: Package, num_tokens: int, salt: int = 0) -> list[int]:
    """Deterministic ids spread over the vocabulary (the model's output does not matter)."""
    vocab = pkg.spec.vocab_size
    return [(1000 + 7919 * i + 104729 * salt) % vocab for i in range(num_tokens)]


async def run(args) -> dict:
    pkg = open_package(args.package)
    caps = pkg.capacities
    if pkg.tp_size != args.tp:
        raise SystemExit(f"the package is for TP {pkg.tp_size}, not --tp {args.tp}")
    total = args.prompt_tokens + args.new_tokens
    if total > caps.max_seq_len:
        raise SystemExit(f"prompt + new tokens ({total}) exceed max_seq_len {caps.max_seq_len}")
    # Room for the run and its warm-up, and at least one max_seq_len sequence (what a rank
    # insists on).
    batches = [int(b) for b in args.batch.split(",")]
    if max(batches) > caps.max_batch:
        raise SystemExit(f"--batch {max(batches)} exceeds the package's max_batch {caps.max_batch}")
    kv_pages = (max(batches) + 1) * -(-total // caps.kv_page_size) + 8
    kv_pages = max(kv_pages, caps.max_pages_per_seq)
    report = {"args": {k: str(v) for k, v in vars(args).items()}}
    bandwidth = _copy_bandwidth() if args.device == "cuda" else 0.0
    async with local_ranks(pkg, args.device, kv_pages) as link:
        for batch in batches:
            prompts = [prompt(pkg, args.prompt_tokens, salt=i) for i in range(batch)]
            for overlap in (False, True) if batch == 1 else (True,):
                mode = f"batch{batch}_" + ("overlap" if overlap else "one_at_a_time")
                config = engine_config(pkg, overlap)
                if args.two_ahead:  # never three steps in flight (EngineConfig)
                    config = dataclasses.replace(config, three_ahead_min_running=0)
                async with running_engine(config, link) as engine:
                    report[mode] = await measure(engine, prompts, args.new_tokens)
                if bandwidth:
                    avg_context = args.prompt_tokens + args.new_tokens / 2
                    roof = roofline_tokens_per_s(pkg, batch, avg_context, bandwidth)
                    report[mode]["roofline_tokens_per_s"] = round(roof, 1)
                    report[mode]["of_roofline"] = round(report[mode]["tokens_per_s"] / roof, 4)
                print(mode, json.dumps(report[mode]), flush=True)
    return report


async def in_process_levels(
    package: Path,
    device: str,
    tp: int,
    prompt_tokens: int,
    new_tokens: int,
    concurrencies: list[int],
    vocab_size: int = 32000,
) -> dict[int, dict]:
    """The same requests as benchmarks/serving_sweep.py's levels (the same prompt ids, its
    --vocab-size), submitted to the engine core in this process (no HTTP, no tokenization or
    detokenization): at each concurrency C, C x REQUESTS_PER_STREAM requests, at most C at a
    time, none repeating an earlier level's prompt. Returns {C: figures}: output tokens/s
    ("tokens_per_s") over the wall time of each level, prefill included, and the level's step
    figures as the sweep gives them through HTTP."""
    from benchmarks.serving_sweep import level_salts, parse_counters, prompt_ids, step_figures

    pkg = open_package(package)
    if pkg.tp_size != tp:
        raise SystemExit(f"the package is for TP {pkg.tp_size}, not --tp {tp}")
    total = prompt_tokens + new_tokens
    kv_pages = max((max(concurrencies) + 1) * -(-total // pkg.capacities.kv_page_size) + 8,
                   pkg.capacities.max_pages_per_seq)  # fmt: skip
    out = {}
    async with (
        local_ranks(pkg, device, kv_pages) as link,
        running_engine(engine_config(pkg, overlap=True), link) as engine,
    ):
        await token_times(engine, prompt_ids(prompt_tokens, 10**6, vocab_size), 4)  # warm-up
        for index, level in enumerate(concurrencies):
            requests = [
                prompt_ids(prompt_tokens, salt, vocab_size)
                for salt in level_salts(concurrencies, index)
            ]
            gate = asyncio.Semaphore(level)

            async def one(ids: list[int], gate: asyncio.Semaphore = gate) -> int:
                async with gate:
                    return len(await token_times(engine, ids, new_tokens))

            before = parse_counters(engine.metrics_text())
            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(ids) for ids in requests)))
            wall_s = time.perf_counter() - t0
            # the step figures the sweep gives each level through HTTP, from the same counters
            steps = step_figures(before, parse_counters(engine.metrics_text()), wall_s)
            out[level] = {"tokens_per_s": round(tokens / wall_s, 2), **steps}
            rate = out[level]["tokens_per_s"]
            print(f"in-process concurrency {level}: {rate} tokens/s, {steps}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--package", required=True, type=Path)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--batch", default="1", help="comma-separated concurrent requests (> 1: overlap only)"
    )
    p.add_argument("--out", type=Path, help="append a JSON line to DIR/step_overhead.jsonl")
    p.add_argument(
        "--two-ahead", action="store_true",
        help="at most two steps in flight, as before three_ahead_min_running (EngineConfig)",
    )  # fmt: skip
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "step_overhead.jsonl", "a") as f:
            f.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
