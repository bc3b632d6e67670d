"""Speculative decoding on one GPU (issue 19), each part on its own:

- `verify`: the Llama-3.1-8B architecture (SmolLM2-135M's with --shape smollm2; random bf16,
  built on the GPU as benchmarks.decode builds it) on one rank's CudaGraphRunner: a
  verification row of 1 x (k+1) tokens against a 1-token decode step at the same context,
  both replayed from their graphs (the decode bucket's, the token bucket's), median of
  CUDA-event times around `runner.step`, which includes staging. Also 64 rows.
- `copy`: a package (the real SmolLM2-135M, from its GGUF) behind an engine core in this
  process over local ranks, speculation off and then on (n-gram): copy-heavy prompts (rewrite
  or correct a passage, repeat a code file with an edit, continue a code file), greedy, EOS
  honoured, each alone in turn and then all at once; tokens/s, and whether the outputs are
  identical.
- `batch`: the same engine over a package, --users concurrent streams of random 512-token
  prompts and 256 new tokens (EOS ignored), off/on/off/on (each off/on pair on the same prompts):
  output tokens/s (adaptive k must keep speculation from costing throughput when proposals
  fail); n-gram proposals, or the draft proposer with --draft.
- `draft`: --package at batch 1 with rank 0 drafting from --draft (a small random model with
  its tokenizer): greedy decode of --new-tokens after a --prompt-tokens prompt, speculation off
  and then the draft proposer with k = 1, 2, 4 fixed (no adaptation, no pauses: every step
  verifies), twice; tokens/s, wall time per step, acceptance. A random draft's proposals are
  all but always rejected, so each step yields one token and its time over the plain step's is
  the end-to-end cost of a rejected round of k proposals; from it, the acceptance rate per
  proposal at which the draft breaks even.
- `replay`: --package's greedy outputs for the copy prompts (speculation off, EOS honoured),
  then each n-gram policy (k at most 4, 8, 16; shortest n-gram 1, 2, 3; adaptive or fixed k)
  replayed over them as the scheduler would drive it one step at a time: decode steps, rows
  chained behind a plain row on a guess of its draw (right, and void), verification rows,
  tokens per step. Greedy outputs do not depend on speculation, so this counts exactly
  what each policy would do with them (chained rows aside); only the step costs need a GPU.
- `schedule`: the scheduler alone on the CPU (no ranks): --users sequences of
  --prompt-tokens random tokens and --new-tokens random draws, two steps in flight, speculation
  off then on: milliseconds of `schedule()` and `apply()` per step, the engine core's share
  of a step that the GPU does not see.

    python3 -m benchmarks.speculation verify [--shape smollm2] --out DIR
    python3 -m benchmarks.speculation copy --package PKG --device cuda [--spec-tokens 16 --ngram-min 3] [--rounds 5] [--exact-verification] --out DIR
    python3 -m benchmarks.speculation batch --package PKG --device cuda --users 64 --out DIR
    python3 -m benchmarks.speculation draft --package PKG --draft DRAFT --out DIR
    python3 -m benchmarks.speculation replay --package PKG --device cpu --out DIR
    python3 -m benchmarks.speculation schedule --users 128
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.decode import SHAPES
from benchmarks.step_overhead import GREEDY, engine_config, local_ranks, prompt, running_engine
from runtime.package import open_package
from runtime.speculation import GUESS_MIN_RATE, SpecState, SpeculationConfig, num_kept

PASSAGE = """The harbour town woke slowly in winter. The first boats went out before the light, \
their engines coughing in the cold, and the gulls followed them past the breakwater. By eight \
the bakery on the corner had its shutters up and a line of fishermen's children waiting with \
coins in their mittens. The harbour master walked the length of the quay twice each morning, \
once to count the boats that had gone and once to count the ones that had stayed, and he wrote \
both numbers in a ledger that nobody else ever read. In the afternoon the wind usually turned, \
and the boats came home low in the water, and the whole town smelled of diesel and salt and \
bread. The school let out at four. The children ran down to the quay to look for their fathers' \
boats, and the harbour master, who had no children of his own, pretended not to watch them."""

TYPOS = (
    PASSAGE.replace("slowly", "slowley")
    .replace("engines", "engins")
    .replace("waiting", "wating")
    .replace("morning", "mornig")
    .replace("afternoon", "afternon")
)

CODE = """import math
from dataclasses import dataclass


@dataclass
class Point:
    x: float
    y: float

    def distance(self, other: "Point") -> float:
        return math.hypot(self.x - other.x, self.y - other.y)


@dataclass
class Polygon:
    points: list[Point]

    def perimeter(self) -> float:
        total = 0.0
        for i, p in enumerate(self.points):
            total += p.distance(self.points[(i + 1) % len(self.points)])
        return total

    def area(self) -> float:
        total = 0.0
        for i, p in enumerate(self.points):
            q = self.points[(i + 1) % len(self.points)]
            total += p.x * q.y - q.x * p.y
        return abs(total) / 2
"""

TASKS = [
    "Rewrite the following passage, replacing every 'harbour' with 'port' and changing nothing "
    "else:\n\n" + PASSAGE,
    "Correct the spelling mistakes in this text and return the whole corrected text:\n\n" + TYPOS,
    "Repeat this Python file exactly, but rename the class Polygon to Shape:\n\n" + CODE,
    "Continue this Python file with a class Rectangle built the same way:\n\n" + CODE,
]


def chat_ids(tokenizer, text: str) -> list[int]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


async def generate(engine, ids: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
    out = []
    async for o in engine.generate(ids, max_tokens, GREEDY, ignore_eos=ignore_eos):
        out += o.token_ids
    return out


def spec_metrics(engine) -> dict:
    s = engine.scheduler
    rows = s.spec_verifications
    return {
        "proposed": s.spec_proposed,
        "accepted": s.spec_kept,
        "verifications": rows,
        "mean_acceptance_length": round(s.spec_tokens / rows, 3) if rows else 0.0,
        "waits": s.spec_waits,
        "guess_min_rate": round(s.guess_min_rate, 3),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def step_stats(engine, steps_before: int, elapsed: float) -> dict:
    steps = engine.steps - steps_before
    timings = list(engine.recent_timings)[-steps:] if steps else []
    return {
        "steps": steps,
        "wall_per_step_ms": round(elapsed / steps * 1e3, 3) if steps else 0.0,
        "rank_execute_ms_p50": round(statistics.median(t[0] for t in timings) * 1e3, 3),
        "rank_gpu_ms_p50": round(statistics.median(t[1] for t in timings) * 1e3, 3),
        # mean and share of the wall: verification steps are a minority, so the median hides
        # what they cost; a share near 1 says the GPU side (with the rank's staging) bounds
        # the run, well under 1 that the host's round trips do
        "rank_gpu_ms_mean": round(statistics.fmean(t[1] for t in timings) * 1e3, 3),
        "rank_gpu_share": round(sum(t[1] for t in timings) / elapsed, 3),
    }


async def timed_outputs(engine, prompts, max_tokens, together: bool) -> dict:
    steps, t0 = engine.steps, time.perf_counter()
    if together:
        outs = await asyncio.gather(*(generate(engine, p, max_tokens, False) for p in prompts))
    else:
        outs = [await generate(engine, p, max_tokens, False) for p in prompts]
    elapsed = time.perf_counter() - t0
    tokens = sum(map(len, outs))
    return {
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        **step_stats(engine, steps, elapsed),
        "outputs": outs,
    }


async def copy_part(args) -> dict:
    """Speculation off then on, --rounds times over one set of ranks (the first round warms
    up); the speedup alone and together averaged over the rounds after the first, since one
    pass varies by several percent on a lent GPU (±7% on the H100s of 2026-12-05)."""
    from transformers import AutoTokenizer

    pkg = open_package(args.package)
    tokenizer = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    prompts = [chat_ids(tokenizer, t) for t in TASKS]
    report: dict = {"prompt_tokens": [len(p) for p in prompts], "rounds": []}
    async with local_ranks(pkg, args.device, args.kv_pages, exact=args.exact_verification) as link:
        for _ in range(args.rounds):
            runs = {}
            ngram = SpeculationConfig(
                num_tokens=args.spec_tokens,
                ngram_min=args.ngram_min,
                ngram_max=max(4, args.ngram_min),
            )
            for spec in (None, ngram):
                key = "ngram" if spec else "off"
                config = replace(engine_config(pkg, overlap=True), speculation=spec)
                async with running_engine(config, link) as engine:
                    await generate(engine, prompts[0][:64], 16, True)  # warm-up
                    part = runs[key] = {}
                    part["alone"] = await timed_outputs(engine, prompts, args.max_tokens, False)
                    part["together"] = await timed_outputs(engine, prompts, args.max_tokens, True)
                    if spec:
                        part["spec"] = spec_metrics(engine)
            off, on = runs["off"], runs["ngram"]
            for mode in ("alone", "together"):
                # the first token where each prompt's output differs from the off run's alone
                # output: bf16 products of another shape round differently (off together too)
                for part in (off, on):
                    part[mode]["same_tokens_as_off_alone"] = [
                        common_prefix(a, b)
                        for a, b in zip(off["alone"]["outputs"], part[mode]["outputs"])
                    ]
                on[mode]["speedup"] = round(on[mode]["tokens_per_s"] / off[mode]["tokens_per_s"], 3)
            runs["sample_output"] = tokenizer.decode(on["alone"]["outputs"][0])[:300]
            for part in (off, on):
                for mode in ("alone", "together"):
                    part[mode]["output_tokens"] = [len(o) for o in part[mode].pop("outputs")]
            report["rounds"].append(runs)
            print(json.dumps({k: v for k, v in runs.items() if k != "sample_output"}), flush=True)
    warm = report["rounds"][1:] or report["rounds"]
    for mode in ("alone", "together"):
        speedups = [r["ngram"][mode]["speedup"] for r in warm]
        report[f"speedup_{mode}_mean"] = round(statistics.fmean(speedups), 3)
        report[f"speedup_{mode}_range"] = [min(speedups), max(speedups)]
    print(json.dumps({k: v for k, v in report.items() if k.startswith("speedup")}), flush=True)
    return report


def replay(
    config: SpeculationConfig,
    prompt: list[int],
    output: list[int],
    guess_min_rate: float = GUESS_MIN_RATE,
) -> dict:
    """One greedy output through the n-gram proposer, decode step by decode step (the
    prefill drew output[0]), as the scheduler drives a sequence with two steps in flight: while
    a plain row draws the sequence's next token, a sequence whose tail repeats gets a row
    chained behind it (SpecState.may_propose_next) whose first token guesses that draw and
    whose proposals follow the guess; a right guess keeps them, a wrong one voids the row (a
    step without a token) and the sequence proposes after the token once it is known; while its
    guesses are right less often than guess_min_rate (the engine core's measured break-even
    for a sequence alone) it waits for the token instead (a wait: not a step here, but the
    host's round trip on the GPU). The
    verification row before a chained one is taken as settled when the next is planned (the
    scheduler guesses its last draw, assuming every proposal kept), so a row that keeps less
    costs no void step here."""
    spec, known, given = SpecState(config), prompt + output, 0
    steps = guesses = void = waits = rows = proposed = kept = 0

    def unseen(end: int) -> list[int]:
        nonlocal given
        new, given = known[given:end], max(given, end)
        return new

    def verify(proposals: list[int], at: int) -> int:
        nonlocal rows, proposed, kept
        n = num_kept(proposals, output[at:])
        if proposals:
            spec.verified(len(proposals), n)
            rows, proposed, kept = rows + 1, proposed + len(proposals), kept + n
        return n

    pos, settled = 1, False  # settled: output[pos - 1] is known, no row in flight draws it
    while pos < len(output):
        steps += 1
        left = len(output) - pos - 1  # proposals past this never fit max_tokens
        if not spec.active:
            spec.decoded(1)
            pos, settled = pos + 1, False
        elif settled:
            pos, settled = (
                pos + verify(spec.propose(unseen(len(prompt) + pos), left), pos) + 1,
                False,
            )
        elif not spec.may_propose_next(unseen(len(prompt) + pos - 1)):
            pos += 1
        else:
            found = spec.index.propose_after([], [], min(spec.k, left) + 1)
            if not found:
                pos += 1
            elif spec.guess_rate < guess_min_rate:  # it waits for the token, then proposes
                waits += 1
                spec.guessed(found[0] == output[pos - 1])
                pos += verify(spec.propose(unseen(len(prompt) + pos), left), pos) + 1
            elif found[0] != output[pos - 1]:
                spec.guessed(False)
                void, settled = void + 1, True
                spec.missed()
            else:
                spec.guessed(True)
                guesses += 1
                pos += verify(found[1:], pos) + 1
    return {
        "steps": steps,
        "guesses": guesses,
        "void": void,
        "waits": waits,
        "rows": rows,
        "proposed": proposed,
        "kept": kept,
    }


async def replay_part(args) -> dict:
    from transformers import AutoTokenizer

    pkg = open_package(args.package)
    tokenizer = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    prompts = [chat_ids(tokenizer, t) for t in TASKS]
    async with (
        local_ranks(pkg, args.device, args.kv_pages) as link,
        running_engine(engine_config(pkg, overlap=True), link) as engine,
    ):
        outputs = [await generate(engine, p, args.max_tokens, False) for p in prompts]
    report: dict = {"output_tokens": [len(o) for o in outputs], "policies": []}
    for k, shortest, adaptive in itertools.product((4, 8, 16), (1, 2, 3), (True, False)):
        config = SpeculationConfig(
            num_tokens=k, ngram_min=shortest, ngram_max=max(4, shortest), adaptive=adaptive
        )
        runs = [replay(config, p, o) for p, o in zip(prompts, outputs)]
        total = {key: sum(r[key] for r in runs) for key in runs[0]}
        decoded = sum(len(o) - 1 for o in outputs)
        row = {"k": k, "ngram_min": shortest, "adaptive": adaptive, **total}
        row["tokens_per_step"] = round(decoded / total["steps"], 3)
        row["tokens_per_step_each"] = [
            round((len(o) - 1) / r["steps"], 2) for o, r in zip(outputs, runs)
        ]
        report["policies"].append(row)
        print(json.dumps(row), flush=True)
    return report


async def batch_part(args) -> dict:
    pkg = open_package(args.package)
    report: dict = {"users": args.users}
    gate = asyncio.Semaphore(args.users)

    async def one(engine, ids):
        async with gate:
            return len(await generate(engine, ids, args.new_tokens, True))

    method = "draft" if args.draft else "ngram"
    report["method"] = method
    async with local_ranks(pkg, args.device, args.kv_pages, draft=args.draft) as link:
        for salt in (0, 2 * args.users):  # off and on draw the same prompts in a round
            on = SpeculationConfig(
                method,
                num_tokens=args.spec_tokens,
                ngram_min=args.ngram_min,
                ngram_max=max(4, args.ngram_min),
            )
            for spec in (None, on):
                key = "on" if spec else "off"
                config = replace(engine_config(pkg, overlap=True), speculation=spec)
                async with running_engine(config, link) as engine:
                    await generate(engine, prompt(pkg, 64, salt=10**6), 8, True)  # warm-up
                    if not report.get("off"):  # the first timed pass must not be cold
                        warm = [
                            prompt(pkg, args.prompt_tokens, salt=10**7 + i)
                            for i in range(args.users)
                        ]
                        await asyncio.gather(*(one(engine, r) for r in warm))
                    requests = [
                        prompt(pkg, args.prompt_tokens, salt=salt + i)
                        for i in range(2 * args.users)
                    ]
                    t0 = time.perf_counter()
                    tokens = sum(await asyncio.gather(*(one(engine, r) for r in requests)))
                    rate = round(tokens / (time.perf_counter() - t0), 1)
                    report.setdefault(key, []).append(rate)
                    if spec:
                        report.setdefault("spec", []).append(spec_metrics(engine))
                    print(key, rate, report.get("spec", [""])[-1] if spec else "", flush=True)
    report["on_over_off"] = round(statistics.mean(report["on"]) / statistics.mean(report["off"]), 3)
    print(json.dumps({"batch_on_over_off": report["on_over_off"]}), flush=True)
    return report


def break_even(cost: float, k: int) -> float:
    """The acceptance rate a per proposal at which k proposals pay: the tokens a round yields,
    (1 - a^(k+1)) / (1 - a), equal `cost` (the round's time over a plain step's)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**i for i in range(k + 1)) < cost:
            lo = a
        else:
            hi = a
    return round(lo, 3)


async def draft_part(args) -> dict:
    pkg = open_package(args.package)
    report: dict = {"draft": str(args.draft), "runs": []}
    async with local_ranks(pkg, args.device, args.kv_pages, draft=args.draft) as link:
        for round_ in range(2):
            for k in (0, 1, 2, 4):
                spec = SpeculationConfig("draft", num_tokens=k, adaptive=False) if k else None
                config = replace(engine_config(pkg, overlap=True), speculation=spec)
                async with running_engine(config, link) as engine:
                    await generate(engine, prompt(pkg, 64, salt=10**6), 8, True)  # warm-up
                    ids = prompt(pkg, args.prompt_tokens, salt=100 * round_ + k)
                    steps, t0 = engine.steps, time.perf_counter()
                    out = await generate(engine, ids, args.new_tokens, True)
                    elapsed = time.perf_counter() - t0
                    run = {"k": k, "round": round_, "tokens_per_s": round(len(out) / elapsed, 1)}
                    run.update(step_stats(engine, steps, elapsed))
                    if spec:
                        run["spec"] = spec_metrics(engine)
                    report["runs"].append(run)
                    print(json.dumps(run), flush=True)
    warm = [r for r in report["runs"] if r["round"] == 1]
    plain = next(r for r in warm if r["k"] == 0)
    for r in warm:
        if r["k"]:
            # per token: a rejected round yields one token, an accepted proposal one more
            cost = (
                plain["tokens_per_s"]
                / r["tokens_per_s"]
                * (r["spec"]["mean_acceptance_length"] or 1.0)
            )
            report[f"k{r['k']}_round_over_plain_step"] = round(cost, 3)
            report[f"k{r['k']}_break_even_acceptance"] = break_even(cost, r["k"])
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    return report


def schedule_part(args) -> dict:
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Scheduler, SchedulerConfig, Sequence

    report: dict = {"users": args.users}
    for spec in (None, SpeculationConfig(num_tokens=args.spec_tokens)):
        rng, draws = random.Random(0), random.Random(1)
        pages = args.users * -(-(args.prompt_tokens + args.new_tokens + 32) // 16)
        config = SchedulerConfig(pages, 16, 256, 2048, 4096, speculation=spec)
        sched = Scheduler(config)
        for i in range(args.users):
            ids = [rng.randrange(49152) for _ in range(args.prompt_tokens)]
            sched.add(Sequence(i + 1, ids, args.new_tokens, SamplingParams()))
        in_flight, schedule_s, apply_s, steps = [], 0.0, 0.0, 0
        while sched.has_work or in_flight:
            step = None
            if len(in_flight) < 2:
                t0 = time.perf_counter()
                step = sched.schedule()
                schedule_s += time.perf_counter() - t0
            if step is not None:
                steps += 1
                sampled = {
                    c.seq.seq_id: [draws.randrange(128256) for _ in range(c.num_samples)]
                    if c.verifies
                    else draws.randrange(128256)
                    for c in step.sampling_chunks
                }
                in_flight.append((step, sampled))
                continue
            t0 = time.perf_counter()
            sched.apply(*in_flight.pop(0))
            apply_s += time.perf_counter() - t0
        report["ngram" if spec else "off"] = {
            "steps": steps,
            "schedule_ms_per_step": round(schedule_s / steps * 1e3, 3),
            "apply_ms_per_step": round(apply_s / steps * 1e3, 3),
            "verifications": sched.spec_verifications,
        }
    print(json.dumps(report), flush=True)
    return report


def use_few_tiles(tiles: dict[str, list[int]]) -> None:
    """The few-rows kernel takes tiles["NxK"] for an N x K weight (benchmarks.kernels --part
    fewsmall's best), its own rule for the others."""
    from runtime import cuda_ops

    rule = cuda_ops._few_tile

    def tile(n: int, k: int, m: int) -> tuple[int, int, int, int]:
        return tuple(tiles[f"{n}x{k}"]) if f"{n}x{k}" in tiles else rule(n, k, m)

    cuda_ops._few_tile = tile


def verify_part(args) -> dict:
    import torch

    from benchmarks.decode import (
        build_runner,
        hf_config,
        median_ms,
        random_shard,
        use_cublas_for_few_rows,
    )
    from prepare.model_spec import model_spec_from_config
    from runtime.runner import SeqInput

    if args.cublas_few_rows:
        use_cublas_for_few_rows()
    if args.few_tiles:
        use_few_tiles(json.loads(args.few_tiles.read_text()))
    spec = model_spec_from_config(hf_config(0, args.shape), 1)
    tensors = random_shard(spec)
    args.batches, args.kv_fraction, args.fused_decode_max_bucket = "256", 0.5, None
    runner, _ = build_runner(spec, tensors, args)
    for layer in runner.kv.layers:  # never time attention over zeros
        layer.normal_()
    ps, ctx = runner.page_size, args.context
    per_seq = -(-(ctx + 17) // ps)  # room for the longest verification row, 17 tokens
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(64)]
    report: dict = {"context": ctx, "device": torch.cuda.get_device_name()}
    for rows in (1, 64):
        decode = [SeqInput([7], ctx, tables[i], True) for i in range(rows)]
        base = median_ms(lambda d=decode: runner.step(d), iters=50)
        part = report[f"rows_{rows}"] = {"decode_ms": round(base, 4)}
        for n in (2, 3, 5, 8, 17):
            verify = [SeqInput([7] * n, ctx, tables[i], True, num_samples=n) for i in range(rows)]
            if rows * n > runner.caps.max_batch:
                continue  # a step samples at most max_batch rows
            ms = median_ms(lambda v=verify: runner.step(v), iters=50)
            part[f"verify_{n}_ms"] = round(ms, 4)
            part[f"verify_{n}_over_decode"] = round(ms / base, 3)
        print(rows, part, flush=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("part", choices=["verify", "copy", "batch", "draft", "schedule", "replay"])
    p.add_argument("--package", type=Path)
    p.add_argument("--draft", type=Path, help="draft: the draft package")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--kv-pages", type=int, default=0, help="per rank; 0 sizes from memory")
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument(
        "--ngram-min",
        type=int,
        default=2,
        help="copy, batch: the shortest n-gram a proposal matches",
    )
    p.add_argument("--max-tokens", type=int, default=320, help="copy: new tokens at most")
    p.add_argument("--rounds", type=int, default=2, help="copy: off/on rounds, the first warm-up")
    p.add_argument("--users", type=int, default=64, help="batch: concurrent streams")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="verify: tokens in the cache")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="verify")
    p.add_argument(
        "--cublas-few-rows",
        action="store_true",
        help="verify: the baseline, products of 2 to 32 rows through cuBLAS",
    )
    p.add_argument(
        "--few-tiles",
        type=Path,
        help="verify: a JSON of few-rows tiles by weight shape (benchmarks.kernels fewsmall's)",
    )
    p.add_argument(
        "--exact-verify-max-bucket",
        type=int,
        default=0,
        help="verify: the runner's option; 32 replays verification rows of up to 32 one-token "
        "rows and one-token steps from the exact graphs, 0 through FlashInfer's decode graph",
    )
    p.add_argument(
        "--exact-verification",
        action="store_true",
        help="copy: the ranks' --exact-verification (greedy outputs equal without speculation)",
    )
    p.add_argument("--out", type=Path, help="write DIR/speculation_PART.json")
    args = p.parse_args(argv)
    if args.part == "verify":
        report = verify_part(args)
    elif args.part == "schedule":
        report = schedule_part(args)
    else:
        if args.package is None:
            p.error(f"{args.part} needs --package")
        parts = {
            "copy": copy_part,
            "batch": batch_part,
            "draft": draft_part,
            "replay": replay_part,
        }
        report = asyncio.run(parts[args.part](args))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"speculation_{args.part}.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
