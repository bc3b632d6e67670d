"""Run a package's reference forward in `tp` real processes joined by gloo, as ranks would."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Far above any run here (at most minutes on a 2-core VM), far below CI's limit.
RUN_TIMEOUT_S = 600.0


def result_samples(result) -> list:
    """A StepResult's samples whichever way rank 0 sent them: a step whose samples are tokens
    alone comes packed (wire.proto StepResult.sample_seq_ids), as Samples of a token alone."""
    from proto import wire_pb2

    if result.sample_seq_ids:
        pairs = zip(result.sample_seq_ids, result.sample_token_ids, strict=True)
        return [wire_pb2.Sample(seq_id=s, token_id=t) for s, t in pairs]
    return list(result.samples)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_runner(package_dir: str, rank: int, num_pages: int, kv_dtype: str = "auto"):
    """Rank `rank`'s ReferenceRunner over a fresh num_pages cache (pages as `orbit serve
    --kv-dtype kv_dtype`), and the package."""
    from runtime.kv_cache import KVCache, KVCacheShape
    from runtime.layers import TPGroup
    from runtime.model import build_model
    from runtime.package import open_package
    from runtime.runner import ReferenceRunner

    pkg = open_package(package_dir)
    group = TPGroup(rank, pkg.tp_size)
    shard = pkg.load_shard(rank)
    model = build_model(pkg.spec, shard, group, pkg.capacities.max_seq_len, quant=pkg.quant)
    shape = KVCacheShape.for_spec(pkg.spec, pkg.tp_size, num_pages, pkg.capacities.kv_page_size)
    kv = KVCache(shape, pkg.dtype, "cpu", pkg.kv_quant(kv_dtype))
    return ReferenceRunner(model, kv), pkg


def _finish(rank: int, tp: int, out_path: str) -> None:
    """Mark this rank's work done, then leave without the interpreter's teardown.

    Twice in CI (TCP store, then file store) one rank aborted in gloo's C++ teardown
    ("terminate called without an active exception") after every result was computed. The
    marker, written before the barrier so every rank's exists once any rank passes it, lets
    `_spawn` tell such an abort from a failure of the work itself."""
    Path(f"{out_path}.done{rank}").touch()
    if tp > 1:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, args: tuple, tp: int, out_path: Path, store: str) -> None:
    """Run fn on tp spawned processes; an abort after every rank finished its work is not
    a failure of that work (see `_finish`), any other exit is."""
    # An earlier run's into the same directory; its ranks left through os._exit, so nothing
    # removed its file store, and a group never forms over a used one.
    for stale in (Path(store), out_path, *(Path(f"{out_path}.done{r}") for r in range(tp))):
        stale.unlink(missing_ok=True)
    group = mp.start_processes(fn, args=args, nprocs=tp, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not group.join(timeout=1.0):
            if time.monotonic() > deadline:  # a hung group must fail its test, not stall CI
                for process in group.processes:
                    process.kill()
                raise TimeoutError(f"{tp} ranks did not finish within {RUN_TIMEOUT_S:.0f} s")
    except mp.ProcessExitedException:
        if not all(Path(f"{out_path}.done{r}").exists() for r in range(tp)):
            raise


def _greedy(runner, page_size: int, prompt: list[int], max_new: int, eos: set[int], chunk: int):
    """Prefill in chunks of `chunk` tokens, then decode greedily; pages in reverse order so the
    page table is exercised. Returns (prompt-end logits, generated ids)."""
    from runtime.runner import SeqInput

    total = len(prompt) + max_new
    num_pages = -(-total // page_size)
    pages = list(range(num_pages))[::-1]
    first_logits = None
    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        last = start + len(piece) == len(prompt)
        out = runner.step([SeqInput(piece, start, pages, sample=last)])
        if last:
            first_logits = out[0]
    out_ids = [int(first_logits.argmax())]
    while len(out_ids) < max_new and out_ids[-1] not in eos:
        pos = len(prompt) + len(out_ids) - 1
        logits = runner.step([SeqInput([out_ids[-1]], pos, pages, sample=True)])
        out_ids.append(int(logits[0].argmax()))
    return first_logits, out_ids


def _worker(rank, tp, store_path, package_dir, prompts, max_new, chunk, out_path, kv_dtype):
    if tp > 1:
        # A file store, not rank 0's TCPStore: with TCP, rank 0 could exit and take the store
        # down while another rank was still tearing down, which aborted that rank in C++
        # ("terminate called without an active exception") once in a CI run.
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=tp
        )
    torch.set_num_threads(1)
    runner, pkg = load_runner(package_dir, rank, num_pages=256, kv_dtype=kv_dtype)
    eos = set(pkg.manifest.tokenizer.eos_token_ids)
    results = []
    for prompt in prompts:
        logits, ids = _greedy(runner, pkg.capacities.kv_page_size, prompt, max_new, eos, chunk)
        results.append({"logits": logits.tolist(), "ids": ids})
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    _finish(rank, tp, out_path)


def run_tp(
    package_dir: Path,
    tp: int,
    prompts: list[list[int]],
    max_new: int,
    chunk: int,
    tmp: Path,
    kv_dtype: str = "auto",
) -> list[dict]:
    """Greedy-generate each prompt on `tp` processes; returns rank 0's logits and ids."""
    out = tmp / f"result-tp{tp}.json"
    store = str(tmp / f"store-tp{tp}")
    _spawn(
        _worker,
        (tp, store, str(package_dir), prompts, max_new, chunk, str(out), kv_dtype),
        tp,
        out,
        store,
    )
    return json.loads(out.read_text())


def _score_worker(rank, tp, store_path, package_dir, tokens, chunk, out_path, kv_dtype):
    """Teacher-forced log-likelihood of tokens[1:] given the tokens before each, in chunks."""
    from runtime.runner import SeqInput

    if tp > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=tp
        )
    from runtime.package import open_package

    torch.set_num_threads(1)
    page = open_package(package_dir).capacities.kv_page_size
    pages = list(range(-(-len(tokens) // page)))
    runner, _ = load_runner(package_dir, rank, num_pages=len(pages), kv_dtype=kv_dtype)
    total = 0.0
    for start in range(0, len(tokens) - 1, chunk):
        piece = tokens[start : min(start + chunk, len(tokens) - 1)]
        logits = runner.step([SeqInput(piece, start, pages, sample=True, num_samples=len(piece))])
        nxt = torch.tensor(tokens[start + 1 : start + 1 + len(piece)])
        total += torch.log_softmax(logits, -1).gather(1, nxt[:, None]).sum().item()
    if rank == 0:
        Path(out_path).write_text(json.dumps(total))
    _finish(rank, tp, out_path)


def score_tp(
    package_dir: Path, tp: int, tokens: list[int], chunk: int, tmp: Path, kv_dtype: str = "auto"
) -> float:
    """Sum of log p(tokens[i + 1] | tokens[:i + 1]) on `tp` processes (rank 0's)."""
    out = tmp / f"score-tp{tp}.json"
    store = str(tmp / f"score-store-tp{tp}")
    _spawn(
        _score_worker,
        (tp, store, str(package_dir), tokens, chunk, str(out), kv_dtype),
        tp,
        out,
        store,
    )
    return json.loads(out.read_text())
