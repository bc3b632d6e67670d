"""Which package `orbit serve [PATH]` serves: PATH itself when it is a package; for a Hugging
Face directory or a GGUF file, its package from the cache (prepare/cache.py), prepared there on
the first start; without PATH, the embedded default model's, the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from prepare.source_header import check_source_tp, is_checkpoint


class ServeSourceError(ValueError):
    """Prepare options given for a path that is already a package."""


@dataclass(frozen=True)
class PrepareFlags:
    """`orbit serve`'s prepare options; None: not given (the source's default applies)."""

    tp: int | None = None
    dtype: str | None = None
    max_seq_len: int | None = None
    max_batch: int | None = None
    kv_page_size: int | None = None
    max_step_tokens: int | None = None
    quantize: str | None = None

    def given(self) -> dict[str, object]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}


FLAG_NAMES = {
    "tp": "--tp",
    "dtype": "--dtype",
    "max_seq_len": "--max-seq-len",
    "max_batch": "--max-batch",
    "kv_page_size": "--page-size",
    "max_step_tokens": "--max-step-tokens",
    "quantize": "--quantize",
}


def served_package(
    path: Path | None, cache_dir: Path, flags: PrepareFlags, say: Callable[[str], None]
) -> Path:
    """The package to serve; `say` tells the user about a one-time preparation. Raises
    ServeSourceError, DefaultModelMissing, SourceError or ShardingError."""
    if path is not None and not is_checkpoint(path):
        if flags.given():
            names = " ".join(FLAG_NAMES[k] for k in flags.given())
            raise ServeSourceError(
                f"prepare options ({names}) apply to a checkpoint, but {path} is a prepared "
                "package; drop them, or serve the checkpoint itself."
            )
        return path  # a package, or not one: the package reader says which, as before
    if path is None:
        from orbit.default_model import DEFAULT_OPTIONS, default_gguf

        path, base = default_gguf(), DEFAULT_OPTIONS
    else:
        from prepare.options import PrepareOptions

        base = PrepareOptions()
    opts = replace(base, **flags.given())
    check_source_tp(path, opts.tp)  # before anything is hashed or read: a wrong --tp fails at once
    return _from_cache(path, cache_dir, opts, say)


def _from_cache(source: Path, cache_dir: Path, opts, say: Callable[[str], None]) -> Path:
    from prepare.cache import cached_package

    got = cached_package(source, cache_dir, opts, on_prepare=say)
    if got.prepared_s is None:
        say(f"using the package prepared from {source}: {got.path}")
    else:
        say(f"prepared {got.path} in {got.prepared_s:.1f} s; later starts reuse it")
    return got.path
