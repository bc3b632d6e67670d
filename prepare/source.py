"""Read a checkpoint's config, tokenizer and tensors without holding the whole model twice.

A Hugging Face directory is read lazily through safetensors slices (memory-mapped). A GGUF file
is dequantised by transformers' GGUF loader into one in-memory copy of the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch


class SourceError(ValueError):
    """The checkpoint cannot be read as a supported model."""


class TensorSource(Protocol):
    def names(self) -> set[str]: ...

    def slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows or columns [start, stop) of one tensor along dim (0 or 1)."""
        ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor (small ones: scales)."""
        ...


class SafetensorsSource:
    """Tensors of an HF directory's *.safetensors files, read slice by slice."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise SourceError(
                f"{directory} has no *.safetensors files; Orbit reads safetensors checkpoints "
                "only (convert .bin files with transformers' save_pretrained)."
            )
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {n: h for h in self._handles for n in h.keys()}

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        s = self._where[name].get_slice(name)
        if dim == 0:
            return s[start:stop]
        return s[:, start:stop]


class StateDictSource:
    """Tensors held in memory (a GGUF file dequantised by transformers), loaded on first use so
    that a prepare refused for its config (e.g. a TP size that does not divide) costs nothing."""

    def __init__(self, load: Callable[[], dict[str, torch.Tensor]]):
        self._load = load

    @cached_property
    def _sd(self) -> dict[str, torch.Tensor]:
        return self._load()

    def names(self) -> set[str]:
        return set(self._sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def read(self, name: str) -> torch.Tensor:
        return self._sd[name]

    def slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self._sd[name].narrow(dim, start, stop - start)


@dataclass
class Checkpoint:
    name: str
    config: object  # a transformers PretrainedConfig
    generation_eos: list[int]
    tokenizer: object  # a transformers tokenizer
    tensors: TensorSource
    source_dtype: torch.dtype


def open_checkpoint(path: Path) -> Checkpoint:
    path = Path(path)
    if not path.exists():
        raise SourceError(
            f"{path} does not exist; pass a Hugging Face model directory or a .gguf file."
        )
    if path.is_file() and path.suffix == ".gguf":
        return _open_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _open_hf_dir(path)
    raise SourceError(
        f"{path} is neither a .gguf file nor a directory with config.json; pass a Hugging Face "
        "model directory (config + safetensors) or a GGUF file."
    )


def _open_hf_dir(path: Path) -> Checkpoint:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types here
        raise SourceError(f"{path}: cannot load its tokenizer ({e}).") from e
    gen_eos: list[int] = []
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        gen_eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return Checkpoint(path.name, config, gen_eos, tokenizer, SafetensorsSource(path), dtype)


def _open_gguf(path: Path) -> Checkpoint:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d, f = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(d, gguf_file=f)
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    except ImportError as e:
        raise SourceError(f"reading GGUF needs the gguf package ({e}).") from e

    def load() -> dict[str, torch.Tensor]:
        try:
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        except ImportError as e:
            raise SourceError(f"reading GGUF needs the gguf and accelerate packages ({e}).") from e
        return {k: v.detach() for k, v in model.state_dict().items()}

    # GGUF files carry EOS in their metadata, which transformers maps onto the config.
    eos = getattr(config, "eos_token_id", None)
    gen_eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return Checkpoint(path.name, config, gen_eos, tokenizer, StateDictSource(load), torch.float32)
