"""Speculative decoding's draft proposer on rank 0: a second, smaller package with the same
tokenizer, run whole (no tensor parallelism) next to rank 0's shard of the served model.

Only rank 0 drafts: the frontend puts its proposals in the next plan, so every rank verifies
the same tokens, and the other ranks would only compute what nobody reads. The draft's KV pages
are a pool of its own indexed by the sequences' page tables (the frontend hands out page ids
once, for both models), so pages, preemption and prefix caching need nothing new; the frontend
reserves pages for the draft's KV of the proposals beyond a row (Scheduler._ask_draft).

Per sequence the drafter keeps the tokens it has seen (from plans and draws) and how far its KV
is computed (`DraftState.computed`). A row whose plan asks for k draft tokens (SeqStep.
draft_tokens), once its draws are known: keep the proposals the frontend keeps (those equal to
the draws before them, runtime/scheduler.py), then run the draft over the known tokens it has
not computed (a whole prompt the first time) and greedily for k - 1 more steps, one token each.
The draft's KV of its own proposals stays and counts as computed for those the next
verification keeps. Draft KV that is stale (a page cached by a sequence that did not draft)
costs acceptance only: the served model's draws decide every output token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from runtime.runner import SeqInput
from runtime.speculation import num_kept

log = logging.getLogger("orbit.rank")


@dataclass
class DraftState:
    """One sequence's history as the drafter knows it."""

    base: int  # position of tokens[0] (earlier ones came from the prefix cache)
    tokens: list[int] = field(default_factory=list)
    computed: int = 0  # the draft's KV holds positions < computed
    ahead: list[int] = field(default_factory=list)  # proposals whose KV follows `computed`

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def write(self, pos: int, tokens: list[int]) -> None:
        """Known tokens from position pos on; a later known token is never different, so
        what follows them is dropped until written again."""
        del self.tokens[pos - self.base :]
        self.tokens += tokens

    def settle(self) -> None:
        """After a row's tokens are written: the draft's KV of its own proposals holds for
        those the known tokens confirm, short of the last known token (the next proposal
        needs its logits); the rest is computed again."""
        while (
            self.ahead
            and self.computed < self.end - 1
            and self.tokens[self.computed - self.base] == self.ahead[0]
        ):
            self.ahead.pop(0)
            self.computed += 1
        self.ahead.clear()
        self.computed = min(self.computed, self.end - 1)


@dataclass
class DraftRow:
    """One plan row's part in drafting: where its tokens go and what it asks for."""

    state: DraftState
    pages: list[int]
    start_pos: int
    token_ids: list[int] | None  # None: a follows_sample row (its token is the last draw)
    first_row: int  # index of its first sampling row in the step
    num_samples: int  # 0: it does not sample
    draft: int  # tokens to propose after its last kept draw
    failed: bool = False  # one of its draws failed: nothing to propose after


class Drafter:
    def __init__(self, runner, vocab_size: int, max_batch: int, max_step_tokens: int):
        self.runner, self.vocab_size = runner, vocab_size
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens

    def start(self, start_pos: int) -> DraftState:
        """A sequence the rank was just given, whose first row starts at start_pos."""
        return DraftState(start_pos, computed=start_pos)

    def record(self, rows: list[DraftRow], draws: list[int]) -> None:
        """Each row's known tokens: its inputs up to the proposals its draws keep, and the draw
        after them."""
        for r in rows:
            st = r.state
            if r.token_ids is not None:
                certain = len(r.token_ids) - max(r.num_samples - 1, 0)
                st.write(r.start_pos, r.token_ids[:certain])
            if not r.num_samples or r.failed:
                continue
            drawn = draws[r.first_row : r.first_row + r.num_samples]
            proposals = r.token_ids[1:] if r.num_samples > 1 else []
            kept = num_kept(proposals, drawn)
            at = r.start_pos + (len(r.token_ids) if r.token_ids is not None else 1)
            at -= len(proposals)
            st.write(at, proposals[:kept] + [drawn[kept]])
        for r in rows:
            r.state.settle()

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        """Each asking row's proposals (in the order of rows; [] for the others)."""
        asking = [i for i, r in enumerate(rows) if r.draft > 0 and not r.failed]
        out: list[list[int]] = [[] for _ in rows]
        if not asking:
            return out
        try:
            first = self._catch_up([rows[i] for i in asking])
            drafted = self._decode([rows[i] for i in asking], first)
        except Exception:  # the draft's failure costs these rows their proposals only
            log.exception("drafting failed; the rows go on without proposals")
            for i in asking:  # what the draft's KV holds is unknown: compute it all again
                rows[i].state.computed = rows[i].state.base
                rows[i].state.ahead.clear()
            return out
        for i, tokens in zip(asking, drafted):
            out[i] = tokens
        return out

    def _catch_up(self, rows: list[DraftRow]) -> torch.Tensor:
        """Run the draft over each row's known tokens it has not computed, in as many steps as
        the draft's step budget and batch need; the first proposal of each row, on the
        runner's device."""
        firsts: list[torch.Tensor | None] = [None] * len(rows)
        todo = list(range(len(rows)))
        while todo:
            inputs, sampled, budget, later = [], [], self.max_step_tokens, []
            for i in todo:
                st = rows[i].state
                n = st.end - st.computed
                take = min(n, budget)
                if take <= 0 or len(inputs) >= self.max_batch:
                    later.append(i)
                    continue
                at = st.computed - st.base
                done = take == n
                inputs.append(SeqInput(st.tokens[at : at + take], st.computed, rows[i].pages, done))
                st.computed += take
                budget -= take
                if done:
                    sampled.append(i)
                else:
                    later.append(i)
            tokens = self.runner.step(inputs)[:, : self.vocab_size].argmax(-1)
            for j, i in enumerate(sampled):
                firsts[i] = tokens[j : j + 1]
            todo = later
        return torch.cat(firsts)

    def _decode(self, rows: list[DraftRow], first: torch.Tensor) -> list[list[int]]:
        """k - 1 greedy steps after each row's first proposal, each fed the last one's tokens on
        the device (the host never waits between them); one copy to the host at the end."""
        cols, live_at = [first], [list(range(len(rows)))]  # step j's tokens, and whose
        for j in range(1, max(r.draft for r in rows)):
            prev = live_at[-1]
            live = [i for i in prev if rows[i].draft > j]
            if not live:
                break
            fed_row = {i: n for n, i in enumerate(prev)}
            self.runner.feed(cols[-1])
            inputs = [
                SeqInput([0], rows[i].state.computed + j - 1, rows[i].pages, True, fed_row[i])
                for i in live
            ]
            cols.append(self.runner.step(inputs)[:, : self.vocab_size].argmax(-1))
            live_at.append(live)
        flat = torch.cat(cols).tolist()
        out: list[list[int]] = [[] for _ in rows]
        at = 0
        for live in live_at:
            for i in live:
                out[i].append(flat[at])
                at += 1
        for r, tokens in zip(rows, out):
            r.state.ahead = tokens[:-1]  # their KV follows the computed tokens
        return out
