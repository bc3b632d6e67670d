"""Frozen views of a package's model spec and capacities, built once from the manifest."""

from __future__ import annotations

from dataclasses import dataclass

from proto import package_pb2


@dataclass(frozen=True)
class RopeScaling:
    type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "llama", "qwen2" or "qwen3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    padded_vocab_size: int
    rope_theta: float
    rope_scaling: RopeScaling
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int

    @classmethod
    def from_proto(cls, m: package_pb2.ModelSpec) -> ModelSpec:
        rs = m.rope_scaling
        return cls(
            family=m.family,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            intermediate_size=m.intermediate_size,
            vocab_size=m.vocab_size,
            padded_vocab_size=m.padded_vocab_size,
            rope_theta=m.rope_theta,
            rope_scaling=RopeScaling(
                type=rs.type or "default",
                factor=rs.factor or 1.0,
                low_freq_factor=rs.low_freq_factor or 1.0,
                high_freq_factor=rs.high_freq_factor or 1.0,
                original_max_position_embeddings=rs.original_max_position_embeddings,
            ),
            rms_norm_eps=m.rms_norm_eps,
            tie_word_embeddings=m.tie_word_embeddings,
            qkv_bias=m.qkv_bias,
            qk_norm=m.qk_norm,
            max_position_embeddings=m.max_position_embeddings,
        )

    def to_proto(self) -> package_pb2.ModelSpec:
        rs = self.rope_scaling
        return package_pb2.ModelSpec(
            family=self.family,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size,
            rope_theta=self.rope_theta,
            rope_scaling=package_pb2.RopeScaling(
                type=rs.type,
                factor=rs.factor,
                low_freq_factor=rs.low_freq_factor,
                high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position_embeddings,
            ),
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            max_position_embeddings=self.max_position_embeddings,
        )


@dataclass(frozen=True)
class Capacities:
    max_seq_len: int
    max_batch: int
    kv_page_size: int
    decode_batch_buckets: tuple[int, ...]
    prefill_chunk_sizes: tuple[int, ...]

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.kv_page_size)

    @property
    def max_step_tokens(self) -> int:
        """The per-step token budget: the largest prefill chunk."""
        return self.prefill_chunk_sizes[-1]

    @classmethod
    def from_proto(cls, c: package_pb2.Capacities) -> Capacities:
        return cls(
            max_seq_len=c.max_seq_len,
            max_batch=c.max_batch,
            kv_page_size=c.kv_page_size,
            decode_batch_buckets=tuple(c.decode_batch_buckets),
            prefill_chunk_sizes=tuple(c.prefill_chunk_sizes),
        )

    def to_proto(self) -> package_pb2.Capacities:
        return package_pb2.Capacities(
            max_seq_len=self.max_seq_len,
            max_batch=self.max_batch,
            kv_page_size=self.kv_page_size,
            decode_batch_buckets=list(self.decode_batch_buckets),
            prefill_chunk_sizes=list(self.prefill_chunk_sizes),
        )


def default_decode_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to 32 and of 16 beyond, ending exactly at max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 32 else 16
    return tuple(sizes) + (max_batch,)


def token_bucket(buckets: tuple[int, ...], num_tokens: int) -> int:
    """The prefill token bucket (capacities.prefill_chunk_sizes) a step of num_tokens replays
    on a GPU: the smallest that holds it. Its graph computes every row of the bucket, the
    padding too, in each product."""
    return min(b for b in buckets if b >= num_tokens)


def chosen_prefill_chunks(max_step_tokens: int, chosen: tuple[int, ...]) -> tuple[int, ...]:
    """The token buckets `orbit prepare --prefill-buckets` asked for, ending exactly at the
    per-step budget (added when not given); () gives default_prefill_chunks. Raises ValueError
    naming what is wrong."""
    if not chosen:
        return default_prefill_chunks(max_step_tokens)
    if any(b < 1 for b in chosen) or list(chosen) != sorted(set(chosen)):
        raise ValueError(
            f"--prefill-buckets {','.join(map(str, chosen))} must be positive and ascending, "
            "each once."
        )
    if chosen[-1] > max_step_tokens:
        raise ValueError(
            f"--prefill-buckets goes up to {chosen[-1]}, past --max-step-tokens "
            f"{max_step_tokens}; drop the larger buckets or raise --max-step-tokens."
        )
    return tuple(chosen) if chosen[-1] == max_step_tokens else (*chosen, max_step_tokens)


def default_prefill_chunks(max_step_tokens: int) -> tuple[int, ...]:
    """Powers of two from 16, ending exactly at the per-step token budget."""
    sizes = []
    n = 16
    while n < max_step_tokens:
        sizes.append(n)
        n *= 2
    return tuple(sizes) + (max_step_tokens,)
