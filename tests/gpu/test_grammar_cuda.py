"""Grammar masks on the GPU (runtime/grammar.py): the mask, copied into the device buffer
allocated once and applied by xgrammar's kernel, leaves exactly the logits the CPU reference
leaves, and the GPU sampler then draws only allowed tokens. Needs the SmolLM2 tokenizer saved as
HF files in $ORBIT_TEST_TOKENIZER."""

from __future__ import annotations

import json
import os

import pytest
import torch

from proto import wire_pb2
from runtime.grammar import GrammarMasks
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def test_cuda_masks_match_the_cpu_reference_and_the_draws_obey_them():
    from runtime import cuda_sampling

    tok_dir = os.environ.get("ORBIT_TEST_TOKENIZER")
    if not tok_dir:
        pytest.skip("set ORBIT_TEST_TOKENIZER to a saved SmolLM2 tokenizer folder")
    vocab = 49152
    grammar = wire_pb2.Grammar(json_schema=json.dumps(SCHEMA), num_prompt_tokens=0)
    masks = {d: GrammarMasks(tok_dir, [2], vocab, 4, torch.device(d)) for d in ("cpu", "cuda")}
    rows = {d: [m.start(grammar), None, m.start(grammar)] for d, m in masks.items()}
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(1.0, seed=3),
        SamplingParams(1.0, seed=5),
    ]
    g = torch.Generator().manual_seed(0)
    drawn = []
    for pos in range(40):
        logits = torch.randn(3, vocab, generator=g) * 4
        on_cpu, on_gpu = logits.clone(), logits.cuda()
        masks["cpu"].mask(on_cpu, rows["cpu"])
        masks["cuda"].mask(on_gpu, rows["cuda"])
        assert torch.equal(on_gpu.cpu(), on_cpu)
        tokens = cuda_sampling.sample_tokens(on_gpu, params, [pos] * 3).tolist()
        for i in (0, 2):
            assert on_cpu[i, tokens[i]] > float("-inf")
            for d in masks:
                rows[d][i].accept(tokens[i], pos)
        drawn.append(tokens)
        if all(rows["cpu"][i].terminated for i in (0, 2)):
            break
    assert all(rows["cpu"][i].terminated for i in (0, 2)), drawn
