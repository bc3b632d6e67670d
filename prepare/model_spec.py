"""Map a transformers config onto Orbit's ModelSpec, refusing what the runtime cannot run."""

from __future__ import annotations

from prepare.source import SourceError
from runtime.layout import padded_vocab
from runtime.spec import ModelSpec, RopeScaling

# model_type -> (family, q/k/v bias, q/k norm)
FAMILIES = {
    "llama": ("llama", False, False),
    "mistral": ("llama", False, False),
    "qwen2": ("qwen2", True, False),
    "qwen3": ("qwen3", False, True),
}


def model_spec_from_config(config, tp: int) -> ModelSpec:
    model_type = getattr(config, "model_type", "")
    if model_type not in FAMILIES:
        raise SourceError(
            f"model_type {model_type!r} is not supported; Orbit serves {', '.join(FAMILIES)}."
        )
    family, qkv_bias, qk_norm = FAMILIES[model_type]
    if model_type in ("llama", "mistral", "qwen3"):
        qkv_bias = bool(getattr(config, "attention_bias", False))
    if getattr(config, "mlp_bias", False):
        raise SourceError("mlp_bias=true is not supported.")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise SourceError(f"hidden_act={config.hidden_act!r} is not supported; only silu is.")
    num_heads = config.num_attention_heads
    return ModelSpec(
        family=family,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        padded_vocab_size=padded_vocab(config.vocab_size, tp),
        rope_theta=_rope_params(config).get("rope_theta", 10000.0),
        rope_scaling=rope_scaling_from_config(config),
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        max_position_embeddings=config.max_position_embeddings,
    )


def _rope_params(config) -> dict:
    # transformers 5 keeps theta and scaling together in rope_parameters; 4.x splits them.
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_scaling_from_config(config) -> RopeScaling:
    p = _rope_params(config)
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(type="linear", factor=float(p["factor"]))
    if kind == "llama3":
        return RopeScaling(
            type="llama3",
            factor=float(p["factor"]),
            low_freq_factor=float(p["low_freq_factor"]),
            high_freq_factor=float(p["high_freq_factor"]),
            original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        )
    raise SourceError(
        f"rope scaling type {kind!r} is not supported; Orbit supports default, linear and llama3."
    )


def sliding_window_limit(config) -> int | None:
    """The attention window if the model uses one, else None."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return int(window)
    return None
