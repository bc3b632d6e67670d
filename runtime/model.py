"""The decoder-only transformer of the Llama, Qwen2 and Qwen3 families, one TP rank's part.

Reads like the architecture; the tensor-parallel collectives are the all-reduces inside
RowParallelLinear and VocabParallelEmbedding and the all-gather inside ParallelLMHead.
Attention goes through the step's attention object (ReferenceAttention on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers import (
    Linear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from runtime.rope import apply_rope, cos_sin_table
from runtime.spec import ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, group: TPGroup, index: int):
        super().__init__()
        tp, hd, h = group.size, spec.head_dim, spec.hidden_size
        self.index = index
        self.num_heads, self.num_kv_heads = spec.num_heads // tp, spec.num_kv_heads // tp
        self.head_dim = hd
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        inter = spec.intermediate_size // tp
        self.attn_norm = RMSNorm(h, spec.rms_norm_eps)
        self.qkv = Linear(h, q + 2 * kv, bias=spec.qkv_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.o = RowParallelLinear(q, h, group)
        self.mlp_norm = RMSNorm(h, spec.rms_norm_eps)
        self.gate_up = Linear(h, 2 * inter)
        self.down = RowParallelLinear(inter, h, group)

    def forward(self, x, cos, sin, attn) -> torch.Tensor:
        h = x + self.attention(self.attn_norm(x), cos, sin, attn)
        return h + self.mlp(self.mlp_norm(h))

    def attention(self, x, cos, sin, attn) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv(x).split(
            [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1
        )
        q = q.view(n, self.num_heads, hd)
        k = k.view(n, self.num_kv_heads, hd)
        v = v.view(n, self.num_kv_heads, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn.attend(self.index, q, k, v)  # [n, heads, hd]
        return self.o(o.reshape(n, self.num_heads * hd))

    def mlp(self, x) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec, group: TPGroup, max_positions: int):
        super().__init__()
        vocab_local = spec.padded_vocab_size // group.size
        self.spec = spec
        self.embed = VocabParallelEmbedding(vocab_local, spec.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(spec, group, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(vocab_local, spec.hidden_size, spec.vocab_size, group)
        cos, sin = cos_sin_table(spec, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """Hidden states after the final norm for every token: [num_tokens, hidden]."""
        x = self.embed(token_ids)
        cos = self.rope_cos[positions].to(x.dtype)
        sin = self.rope_sin[positions].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, vocab] float32, identical on every rank."""
        return self.lm_head(hidden).float()


def build_model(
    spec: ModelSpec,
    tensors: dict[str, torch.Tensor],
    group: TPGroup,
    max_positions: int,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A Transformer whose parameters are the shard's tensors themselves (no copy)."""
    with torch.device("meta"):
        model = Transformer(spec, group, max_positions)
    tensors = dict(tensors)
    if spec.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["embed.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    cos, sin = cos_sin_table(spec, max_positions)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval()
