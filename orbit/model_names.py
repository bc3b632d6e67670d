"""The ids a package is served under: `--model-name a,b` (the first is the listed id, every one
is accepted in requests), or a clean name derived from the package's source name.

A source name is what `orbit prepare` read: a Hugging Face directory's name, or a GGUF file's
(`SmolLM2-135M-Instruct.Q4_1.gguf`). The served id drops the `.gguf` extension and a trailing
quantization tag (`.Q4_1`, `-Q4_K_M`, `.f16`, `-IQ4_XS`, ...), which name how the file was
stored, not the model: `SmolLM2-135M-Instruct`.
"""

from __future__ import annotations

import re

# A GGUF quantization or storage-type tag at the end of a file's stem, after "." or "-".
_QUANT_TAG = re.compile(
    r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|[BF]F?16|F32|FP(?:16|32)|BF16)$", re.IGNORECASE
)


class ModelNameError(ValueError):
    """--model-name is malformed."""


def clean_model_id(source_name: str) -> str:
    """The served id of a package whose source is `source_name`."""
    stem = source_name.strip().rstrip("/").rsplit("/", 1)[-1]
    if stem.lower().endswith(".gguf"):
        stem = _QUANT_TAG.sub("", stem[: -len(".gguf")])
    return stem or source_name


def served_model_ids(model_name_flag: str, source_name: str) -> tuple[str, ...]:
    """Every id the server answers to, the listed one first: `--model-name` split at commas,
    or the clean id of the source name when the flag is empty."""
    if not model_name_flag.strip():
        return (clean_model_id(source_name),)
    names = [n.strip() for n in model_name_flag.split(",")]
    if not all(names):
        raise ModelNameError(
            f"--model-name {model_name_flag!r} has an empty name; give names separated by "
            "single commas, e.g. --model-name my-model,alias."
        )
    return tuple(dict.fromkeys(names))  # in order, each once
