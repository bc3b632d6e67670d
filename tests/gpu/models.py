"""Random-weight models for the GPU tests, built from configs on the machine (no download):
a Llama-architecture model with head_dim 128 (the kernels the carried FlashInfer cache holds)
and the SmolLM2-135M architecture (head_dim 64: FlashInfer compiles those kernels on first use).

Weights are drawn with std 0.01. Random weights are not trained ones: at std 0.04 transformers'
own bf16 logits sat 2.3% from its float32 ones on the Llama model (measured on CPU), so no bf16
implementation could meet a 1e-2 bound against another; at 0.01 that spread is 0.7%.
"""

from __future__ import annotations

import torch

from runtime.spec import Capacities, default_decode_buckets, default_prefill_chunks

CAPACITIES = Capacities(
    max_seq_len=1024,
    max_batch=16,
    kv_page_size=16,
    decode_batch_buckets=default_decode_buckets(16),  # 1, 2, 4, 8, 16
    prefill_chunk_sizes=default_prefill_chunks(256),
)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.01,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )


def smollm2_config():
    """SmolLM2-135M's architecture (its config.json), random weights."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.01,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )


def random_hf_model(config, seed: int = 1234):
    """A float32 transformers model on the CPU with random weights, norms drawn around 1."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(mean=1.0, std=0.1)
    return model


def shard_tensors(hf_model, tp: int = 1, rank: int = 0):
    """(spec, this rank's tensors) cut by prepare's own code from the model's state dict."""
    from prepare.model_spec import model_spec_from_config
    from prepare.shard import rank_tensors
    from prepare.source import StateDictSource

    spec = model_spec_from_config(hf_model.config, tp)
    state = hf_model.state_dict()
    return spec, dict(rank_tensors(StateDictSource(lambda: state), spec, rank, tp))


def cuda_runner(
    spec, tensors, group, capacities=CAPACITIES, max_kv_pages=512, quant=None, **options
):
    """A captured CudaGraphRunner over bf16 copies of the tensors (FP8 weights and their
    scales, with quant, as they are); options: further CudaRunnerOptions fields."""
    from runtime.cuda_runner import CudaGraphRunner, CudaRunnerOptions
    from runtime.model import build_model

    def on_gpu(name, t):
        kept = t.dtype == torch.float8_e4m3fn or name.endswith("weight_scale")
        return t.to("cuda") if kept else t.to("cuda", torch.bfloat16)

    gpu = {k: on_gpu(k, v) for k, v in tensors.items()}
    model = build_model(spec, gpu, group, capacities.max_seq_len, "cuda", quant)
    opts = CudaRunnerOptions(max_kv_pages=max_kv_pages, **options)
    runner = CudaGraphRunner(model, capacities, opts)
    runner.capture()
    return runner


def reference_runner(spec, tensors, capacities=CAPACITIES, num_pages=512):
    """The CPU reference path in float32 over the same weights rounded to bf16 first, so the
    two paths differ only in arithmetic precision, not in weights."""
    from runtime.kv_cache import KVCache, KVCacheShape
    from runtime.layers import TPGroup
    from runtime.model import build_model
    from runtime.runner import ReferenceRunner

    cpu = {k: v.to(torch.bfloat16).float() for k, v in tensors.items()}
    model = build_model(spec, cpu, TPGroup(), capacities.max_seq_len, "cpu")
    shape = KVCacheShape.for_spec(spec, 1, num_pages, capacities.kv_page_size)
    return ReferenceRunner(model, KVCache(shape, torch.float32, "cpu"))
