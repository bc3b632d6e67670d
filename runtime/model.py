"""The decoder-only transformer of the Llama, Qwen2 and Qwen3 families, one TP rank's part.

Reads like the architecture; the tensor-parallel collectives are the all-reduces inside
RowParallelLinear and VocabParallelEmbedding and the all-gather inside ParallelLMHead.
Attention, RoPE included, goes through the step's attention object (ReferenceAttention on
CPU, the FlashInfer ones of runtime/cuda_attention.py on GPU).

The residual stream is carried beside each layer's output, so that every "add the residual,
normalise, project" triple is one call, norm_linear (one kernel on CUDA for a single row, the
fused add + norm kernel then the GEMM for more): layer i returns (its MLP output, the stream
before that output), and layer i+1 adds them. The sums are the same ones, in the same
precision, as h = x + attn(norm(x)); h + mlp(norm(h)).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers import (
    Linear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    norm_linear,
)
from runtime.matmul import matmul_for
from runtime.quant import WeightQuant
from runtime.rope import cos_sin_table
from runtime.spec import ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, group: TPGroup, index: int, quant: WeightQuant | None):
        super().__init__()
        tp, hd, h = group.size, spec.head_dim, spec.hidden_size
        self.index = index
        self.num_heads, self.num_kv_heads = spec.num_heads // tp, spec.num_kv_heads // tp
        self.head_dim = hd
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        inter = spec.intermediate_size // tp

        def scale(rows: int, cols: int):  # an FP8 weight's scale, None for a dense one
            return quant.scale_shape(rows, cols) if quant else None

        self.attn_norm = RMSNorm(h, spec.rms_norm_eps)
        self.qkv = Linear(h, q + 2 * kv, bias=spec.qkv_bias, scale_shape=scale(q + 2 * kv, h))
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.o = RowParallelLinear(q, h, group, scale_shape=scale(h, q))
        self.mlp_norm = RMSNorm(h, spec.rms_norm_eps)
        self.gate_up = Linear(h, 2 * inter, scale_shape=scale(2 * inter, h))
        self.down = RowParallelLinear(inter, h, group, scale_shape=scale(h, inter))

    def forward(self, x, residual, cos, sin, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embedding, with residual None, for layer 0);
        residual: the stream before it. Returns (this layer's MLP output, the stream before it)."""
        qkv, residual = norm_linear(self.attn_norm, self.qkv, x, residual)
        x = self.attention(qkv, cos, sin, attn)
        gate_up, residual = norm_linear(self.mlp_norm, self.gate_up, x, residual)
        return self.down.after_silu_and_mul(gate_up), residual

    def attention(self, qkv, cos, sin, attn) -> torch.Tensor:
        """qkv: this layer's fused q, k, v projection of the normalised stream."""
        n, hd = qkv.shape[0], self.head_dim
        q, k, v = qkv.split(
            [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1
        )
        q = q.view(n, self.num_heads, hd)
        k = k.view(n, self.num_kv_heads, hd)
        v = v.view(n, self.num_kv_heads, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = attn.attend(self.index, q, k, v, cos, sin)  # RoPE, then attention: [n, heads, hd]
        return self.o(o.reshape(n, self.num_heads * hd))


class Transformer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        group: TPGroup,
        max_positions: int,
        quant: WeightQuant | None = None,
    ):
        super().__init__()
        vocab_local = spec.padded_vocab_size // group.size
        self.spec = spec
        self.embed = VocabParallelEmbedding(vocab_local, spec.hidden_size, group)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, group, i, quant) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(vocab_local, spec.hidden_size, spec.vocab_size, group)
        cos, sin = cos_sin_table(spec, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """Hidden states after the final norm for every token: [num_tokens, hidden]."""
        x, residual = self.embed(token_ids), None
        cos = self.rope_cos[positions].to(x.dtype)
        sin = self.rope_sin[positions].to(x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return self.norm.add_forward(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, vocab] float32, identical on every rank."""
        return self.lm_head(hidden).float()


def build_model(
    spec: ModelSpec,
    tensors: dict[str, torch.Tensor],
    group: TPGroup,
    max_positions: int,
    device: torch.device | str = "cpu",
    quant: WeightQuant | None = None,
) -> Transformer:
    """A Transformer whose parameters are the shard's tensors themselves (no copy; FP8 weights
    that cannot run as FP8 here are dequantized, runtime/matmul.py), each linear layer's way
    of multiplying chosen here, once."""
    with torch.device("meta"):
        model = Transformer(spec, group, max_positions, quant)
    tensors = dict(tensors)
    if spec.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["embed.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    # The tables in the weights' dtype: a step gathers its rows without a cast kernel, and
    # the values are those a per-step cast of the float32 rows gives.
    cos, sin = cos_sin_table(spec, max_positions)
    dtype = tensors["embed.weight"].dtype
    model.rope_cos, model.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.mm = matmul_for(layer, quant, dtype)
    return model.eval()
