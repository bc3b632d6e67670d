"""Drive a runner (CUDA or CPU reference) the way a rank does: chunked prefill of several
prompts in shared steps, then batched decode. Pages come from the end of the pool, reversed,
so every page table is non-trivial."""

from __future__ import annotations

import torch

from runtime.runner import SeqInput

MAX_PAGES_PER_SEQ = 64  # 1024 tokens of 16


def page_tables(num_seqs: int, num_pages: int, per_seq: int = MAX_PAGES_PER_SEQ) -> list[list[int]]:
    pages = list(range(num_pages))[::-1]
    assert num_seqs * per_seq <= num_pages, "the pool has too few pages for these tables"
    return [pages[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]


def prefill(runner, prompts, tables, chunk: int = 64, budget: int = 256) -> list[torch.Tensor]:
    """Chunked prefill sharing steps of at most `budget` tokens; returns each prompt's last
    logits (float32, CPU)."""
    done = [0] * len(prompts)
    last: dict[int, torch.Tensor] = {}
    while any(d < len(p) for d, p in zip(done, prompts)):
        seqs, owners, left = [], [], budget
        for i, p in enumerate(prompts):
            n = min(chunk, len(p) - done[i], left)
            if n <= 0:
                continue
            seqs.append(
                SeqInput(p[done[i] : done[i] + n], done[i], tables[i], done[i] + n == len(p))
            )
            owners.append(i)
            done[i], left = done[i] + n, left - n
        out = runner.step(seqs)
        rows = [i for i, s in zip(owners, seqs) if s.sample]
        for j, i in enumerate(rows):
            last[i] = out[j].float().cpu()
    return [last[i] for i in range(len(prompts))]


def decode(runner, tokens, contexts, tables, eager: bool = False) -> torch.Tensor:
    """One decode step: tokens[i] at position contexts[i]. Returns logits (float32, CPU)."""
    seqs = [SeqInput([t], c, tab, True) for t, c, tab in zip(tokens, contexts, tables)]
    out = runner.step_eager(seqs) if eager else runner.step(seqs)
    return out.float().cpu()


def decode_run(runner, prompts, tables, vocab: int, num_steps: int) -> torch.Tensor:
    """Prefill the prompts, then num_steps decode steps of all of them, sequence i feeding
    token (97 i + 13 step) % vocab whatever was drawn (so two runners see the same inputs):
    the logits [num_steps, sequences, vocab] (float32, CPU)."""
    prefill(runner, prompts, tables)
    contexts = [len(p) for p in prompts]
    logits = []
    for step in range(num_steps):
        tokens = [(97 * i + 13 * step) % vocab for i in range(len(prompts))]
        logits.append(decode(runner, tokens, contexts, tables))
        contexts = [c + 1 for c in contexts]
    return torch.stack(logits)


def teacher_forced(runner, prompts, continuations, tables) -> list[list[torch.Tensor]]:
    """Logits at the last prompt position and after each continuation token, per sequence:
    prefill, then decode the continuations (all sequences in one batch)."""
    logits = [[row] for row in prefill(runner, prompts, tables)]
    contexts = [len(p) for p in prompts]
    for step in range(len(continuations[0])):
        out = decode(runner, [c[step] for c in continuations], contexts, tables)
        for i, row in enumerate(out):
            logits[i].append(row)
        contexts = [c + 1 for c in contexts]
    return logits


def greedy(
    runner, prompts, tables, max_new: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Free-running greedy decode of all prompts as one batch: (tokens, logits per step)."""
    first = prefill(runner, prompts, tables)
    tokens = [[int(row.argmax())] for row in first]
    logits = [[row] for row in first]
    contexts = [len(p) for p in prompts]
    for _ in range(max_new - 1):
        out = decode(runner, [t[-1] for t in tokens], contexts, tables)
        for i, row in enumerate(out):
            tokens[i].append(int(row.argmax()))
            logits[i].append(row)
        contexts = [c + 1 for c in contexts]
    return tokens, logits


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def verification_vs_one_row_steps(runner, vocab: int, seed: int) -> dict:
    """Two sequences of one prompt (one page table each, prefilled alike); one decodes a
    13-token continuation in one-row steps, the other takes it as one verification row beside
    a decode row of a third sequence (as a speculating batch does; 14 one-token rows, bucket
    16), its context crossing a page. Returns the largest absolute difference of the logits
    and of the layers' KV at the continuation's positions: 0 when verification rows compute
    exactly what one-row steps do."""
    torch.manual_seed(seed)
    prompt = torch.randint(0, vocab, (150,)).tolist()
    other = torch.randint(0, vocab, (40,)).tolist()
    cont = torch.randint(0, vocab, (13,)).tolist()
    tables = page_tables(3, 512)
    prefill(runner, [prompt, prompt, other], tables)
    start = len(prompt)
    alone = torch.cat([decode(runner, [t], [start + j], [tables[0]]) for j, t in enumerate(cont)])
    rows = [SeqInput(cont, start, tables[1], True, num_samples=len(cont)),
            SeqInput([7], len(other), tables[2], True)]  # fmt: skip
    verified = runner.step(rows).float().cpu()[: len(cont)]
    ps = runner.page_size
    kv = 0.0
    for cache in runner.kv.layers:
        for pos in range(start, start + len(cont)):
            a = cache[tables[0][pos // ps], :, pos % ps].float()
            b = cache[tables[1][pos // ps], :, pos % ps].float()
            kv = max(kv, (a - b).abs().max().item())
    return {"logits_max_abs_diff": (verified - alone).abs().max().item(), "kv_max_abs_diff": kv}
