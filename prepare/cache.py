"""Prepared packages kept in a cache, so `orbit serve CHECKPOINT` prepares a checkpoint once and
every later start serves the package it made, without reading the weights again.

How this works:
- An entry is `CACHE/packages/<source name>-tp<N>-<dtype>-<key>/`, a package as
  `orbit prepare` writes it. `key` is the start of a SHA-256 over the source's name and content
  digest, the prepare options that change the package (TP size, dtype, capacities) and the
  package format version: a changed file, option or format makes another entry.
- The content digest is the SHA-256 of a GGUF file, or, for a Hugging Face directory, of the
  names and SHA-256s of its top-level files (weights formats Orbit does not read, such as
  *.bin and *.pth, and hidden files left out). Hashing a large checkpoint takes a while, so
  each file's SHA-256 is remembered in `CACHE/source-digests.json` under its absolute path,
  size, modification time (ns) and inode: a second start stats the files and hashes nothing.
  A file rewritten in place with the same size and modification time would not be noticed;
  editors, copies and downloads all change the modification time.
- An entry is complete when it exists: prepare_package assembles it in a hidden
  `.NAME.partial-*` directory and renames that into place last. One process at a time prepares
  a given entry (an flock on `.NAME.lock`); it removes what an interrupted prepare of the same
  entry left (partial directories, or an entry without manifest.pb) before starting.
- The prepare itself runs in a spawned child process (`_prepare_apart`): `orbit serve` goes on
  to serve in the process that asked, which should not carry the prepare's memory and imports.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from prepare.build import PrepareOptions, prepare_package
from prepare.source_header import check_source_tp
from runtime.package import MANIFEST_NAME

DIGESTS_NAME = "source-digests.json"
# Weights formats Orbit never reads: hashing them would only slow the first start down.
IGNORED_SUFFIXES = (".bin", ".pth", ".pt", ".h5", ".msgpack", ".onnx", ".gguf", ".ckpt")


@dataclass(frozen=True)
class CachedPackage:
    path: Path
    prepared_s: float | None  # seconds this call spent preparing it; None: it was in the cache


def cached_package(
    source: Path,
    cache_dir: Path,
    opts: PrepareOptions,
    progress: bool = True,
    on_prepare: Callable[[str], None] | None = None,
) -> CachedPackage:
    """The package of `source` prepared with `opts`, from the cache, prepared there if absent
    (`on_prepare` hears one line before that starts)."""
    check_source_tp(source, opts.tp)  # before hashing: a wrong --tp fails at once
    entry = entry_path(source, cache_dir, opts, progress)
    if (entry / MANIFEST_NAME).is_file():
        return CachedPackage(entry, None)
    with _entry_lock(entry):
        if (entry / MANIFEST_NAME).is_file():  # another process finished it while we waited
            return CachedPackage(entry, None)
        _remove_leftovers(entry)
        if on_prepare is not None:
            on_prepare(f"preparing {source} into {entry} (once; later starts reuse it)")
        start = time.monotonic()
        _prepare_apart(source, entry, opts, progress)
        return CachedPackage(entry, time.monotonic() - start)


class PrepareFailed(RuntimeError):
    """A prepare failed in its child process with an error that cannot come back as itself
    (a library's exception whose constructor takes other arguments than its message)."""


def _prepare_apart(source: Path, entry: Path, opts: PrepareOptions, progress: bool) -> None:
    """prepare_package in a child process: the process that asked goes on to serve, and keeps
    none of what a prepare loads (the dequantized weights, transformers' GGUF reader and what
    it imports, such as scipy, whose bindings reported leaks at every exit after a first
    start). Its errors are raised here, as themselves or as PrepareFailed."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(_prepare_in_child, source, entry, opts, progress).result()


def _prepare_in_child(source: Path, entry: Path, opts: PrepareOptions, progress: bool) -> None:
    try:
        prepare_package(source, entry, opts, progress)
    except Exception as e:
        try:  # the executor sends the error back pickled; one that cannot be is re-stated
            pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 - whatever the reason, the message must get through
            raise PrepareFailed(f"preparing {source} failed: {_messages(e)}") from None
        raise


def _messages(e: BaseException | None) -> str:
    """The error's type and message, then each cause's that says more."""
    parts, said = [], ""
    while e is not None and len(parts) < 4:
        text = " ".join(str(e).split())
        if text not in said:
            parts.append(f"{type(e).__name__}: {text}")
            said += text
        e = e.__cause__ or e.__context__
    return "; caused by ".join(parts)


def entry_path(source: Path, cache_dir: Path, opts: PrepareOptions, progress: bool = True) -> Path:
    source, cache_dir = Path(source).resolve(), Path(cache_dir).resolve()
    digest = source_digest(source, cache_dir / DIGESTS_NAME, progress)
    fields = {
        "source_name": source.name,
        "source_sha256": digest,
        # What prepare writes for the same source and options; bump when that changes.
        "format_version": 1,
        "tp": opts.tp,
        "dtype": opts.dtype,
        "max_seq_len": opts.max_seq_len,
        "max_batch": opts.max_batch,
        "kv_page_size": opts.kv_page_size,
        "max_step_tokens": opts.max_step_tokens,
    }
    if opts.quantize:  # absent otherwise, so entries prepared before the flag existed still hit
        fields["quantize"] = opts.quantize
    if opts.kv_dtype:  # likewise
        fields["kv_dtype"] = opts.kv_dtype
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source.stem if source.is_file() else source.name)
    return cache_dir / "packages" / f"{stem}-tp{opts.tp}-{opts.dtype}-{key}"


def source_files(source: Path) -> list[Path]:
    """The files whose content names the source (see the module docstring)."""
    if source.is_file():
        return [source]
    return sorted(
        p
        for p in source.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix not in IGNORED_SUFFIXES
    )


def source_digest(source: Path, memo_file: Path, progress: bool = True) -> str:
    """SHA-256 naming the source's content; file hashes are memoized in memo_file."""
    source = Path(source).resolve()
    memo = _read_memo(memo_file)
    files = source_files(source)
    stats = {str(p): _stat_key(p) for p in files}
    todo = [p for p in files if memo.get(str(p), {}).get("stat") != stats[str(p)]]
    for path, sha in _hash_files(todo, progress):
        memo[str(path)] = {"stat": stats[str(path)], "sha256": sha}
    if todo:
        _write_memo(memo_file, memo)
    if source.is_file():
        return memo[str(source)]["sha256"]
    lines = "".join(f"{p.name}\0{memo[str(p)]['sha256']}\n" for p in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _hash_files(paths: list[Path], progress: bool) -> Iterator[tuple[Path, str]]:
    total = sum(p.stat().st_size for p in paths)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns, TimeRemainingColumn(), disable=not progress, transient=True) as bar:
        task = bar.add_task("hashing the checkpoint (once)", total=total)
        for path in paths:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
                    bar.advance(task, len(chunk))
            yield path, h.hexdigest()


def _read_memo(memo_file: Path) -> dict:
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: it only saves time, so start over
    return memo if isinstance(memo, dict) else {}


def _write_memo(memo_file: Path, memo: dict) -> None:
    """Atomically, keeping only files that still exist; two processes writing at once lose at
    most the other's new hashes, which the next start computes again."""
    memo = {k: v for k, v in memo.items() if os.path.exists(k)}
    memo_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo, indent=1, sort_keys=True))
    os.replace(tmp, memo_file)


@contextmanager
def _entry_lock(entry: Path) -> Iterator[None]:
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(f".{entry.name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def _remove_leftovers(entry: Path) -> None:
    """What an interrupted prepare of this entry left; called with the entry's lock held."""
    for partial in entry.parent.glob(f".{entry.name}.partial-*"):
        shutil.rmtree(partial, ignore_errors=True)
    if entry.exists():  # no manifest: not made by a completed prepare
        shutil.rmtree(entry)
