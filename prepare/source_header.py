"""What a checkpoint's header says about its TP sizes, read in milliseconds: config.json of a
Hugging Face directory, or the key-value metadata of a GGUF file, scanned without building
its token tables and without touching a tensor.

`orbit prepare` and `orbit serve PATH` check `--tp` with this before anything reads weights (or
imports torch), so a wrong TP size is one error line at once, naming the valid sizes.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from runtime.layout import ShardingError, check_tp


@dataclass(frozen=True)
class HeadCounts:
    """The sizes a TP size must divide (the fields runtime/layout.py's check_tp reads)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int


def is_checkpoint(path: Path) -> bool:
    """A GGUF file, or a Hugging Face directory (config.json) that is not an Orbit package."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf"
    return (path / "config.json").is_file() and not (path / "manifest.pb").is_file()


def check_source_tp(source: Path, tp: int) -> None:
    """Raise ShardingError naming the valid TP sizes if tp cannot split source. A source whose
    header this cannot read passes: the full prepare checks it again from the real config."""
    heads = read_head_counts(source)
    if heads is not None:
        check_tp(heads, tp)
    elif tp < 1:
        raise ShardingError(f"--tp must be at least 1, got {tp}.")


def read_head_counts(source: Path) -> HeadCounts | None:
    """The head counts from the header, or None where the header does not hold them."""
    source = Path(source)
    try:
        if source.is_file() and source.suffix == ".gguf":
            return _gguf_head_counts(gguf_metadata(source))
        if source.is_dir() and (source / "config.json").is_file():
            return _hf_head_counts(json.loads((source / "config.json").read_text()))
    except (OSError, ValueError, struct.error):
        return None  # unreadable here: the full reader says why, in its own words
    return None


def _hf_head_counts(config: dict) -> HeadCounts | None:
    try:
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        return HeadCounts(heads, kv, int(config["intermediate_size"]))
    except (KeyError, TypeError, ValueError):
        return None


def _gguf_head_counts(meta: dict[str, object]) -> HeadCounts | None:
    arch = meta.get("general.architecture")
    heads = meta.get(f"{arch}.attention.head_count")
    kv = meta.get(f"{arch}.attention.head_count_kv", heads)
    inter = meta.get(f"{arch}.feed_forward_length")
    if not all(isinstance(v, int) for v in (heads, kv, inter)):
        return None  # absent, or per-layer arrays: leave it to the full reader
    return HeadCounts(heads, kv, inter)


# GGUF value types (gguf-py's GGUFValueType): code -> struct format of a scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict[str, object]:
    """A GGUF file's scalar and string metadata (arrays, such as the vocabulary, are skipped:
    only their lengths are read). Raises ValueError if the file is not GGUF."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic).")
        # A little-endian reader sees a big-endian file's small version as a huge number.
        order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        _, kv_count = struct.unpack_from(order + "QQ", buf, 8)
        return _GgufScan(buf, order, 24).read_kvs(kv_count)


class _GgufScan:
    def __init__(self, buf: mmap.mmap, order: str, offset: int):
        self.buf, self.order, self.pos = buf, order, offset

    def _unpack(self, fmt: str):
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def read_kvs(self, count: int) -> dict[str, object]:
        out: dict[str, object] = {}
        for _ in range(count):
            key = self._string()
            value = self._value(self._unpack("I"))
            if value is not None:
                out[key] = value
        return out

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        self._skip_array()
        return None

    def _skip_array(self) -> None:
        kind, count = self._unpack("I"), self._unpack("Q")
        if kind in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[kind])
            return
        for _ in range(count):  # strings (the vocabulary, merges) and nested arrays
            if kind == _STRING:
                self.pos += 8 + struct.unpack_from(self.order + "Q", self.buf, self.pos)[0]
            else:
                self._value(kind)
