"""Run one step of the model on one rank: gather the step's tokens, attend over the paged KV
cache, and return the logits of the tokens that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention import ReferenceAttention, SeqSpan
from runtime.kv_cache import KVCache
from runtime.model import Transformer


@dataclass(slots=True)  # one per row of every step
class SeqInput:
    """One sequence's work in a step."""

    token_ids: list[int]  # new tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0]
    page_table: list[int]  # pages covering start_pos + len(token_ids) tokens
    sample: bool  # whether this step's last token yields a next-token distribution
    # >= 0: a decode row whose one token is row `fed_row` of the tokens last given to the
    # runner's feed() (a sample still on the device); token_ids then holds a placeholder.
    fed_row: int = -1
    # With sample: how many of the last tokens yield one (more than one: a verification row of
    # speculative decoding, the last known token then proposals).
    num_samples: int = 1

    @property
    def num_logits(self) -> int:
        return self.num_samples if self.sample else 0


class ReferenceRunner:
    """The CPU execution path: eager PyTorch, one forward per step."""

    def __init__(self, model: Transformer, kv: KVCache, device: str | torch.device = "cpu"):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.scale = model.spec.head_dim**-0.5
        self._fed = torch.zeros(0, dtype=torch.long)

    def feed(self, tokens: torch.Tensor) -> None:
        """Tokens that later steps' rows name by `SeqInput.fed_row`."""
        self._fed = tokens.to("cpu", torch.long)

    @torch.inference_mode()
    def step(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Returns float32 logits [sampling rows, vocab]: each sampling sequence's last
        num_samples tokens, in the order of seqs."""
        ids, pos, spans, last_rows = [], [], [], []
        for s in seqs:
            n = len(s.token_ids)
            ids.extend([int(self._fed[s.fed_row])] if s.fed_row >= 0 else s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + n))
            spans.append(SeqSpan(n, s.start_pos + n, torch.tensor(s.page_table, dtype=torch.long)))
            last_rows.extend(range(len(ids) - s.num_logits, len(ids)))
        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        attn = ReferenceAttention(spans, self.kv, self.scale)
        hidden = self.model(token_ids, positions, attn)
        return self.model.logits(hidden[last_rows])
