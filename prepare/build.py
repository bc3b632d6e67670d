"""`orbit prepare`: checkpoint -> package, one rank's shard in memory at a time, written atomically.

The package is assembled in a hidden temporary directory beside the output and renamed into
place only after the manifest (written last) is on disk, so an interrupted prepare never leaves
anything that loads as a package.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from rich.progress import Progress

from prepare.model_spec import model_spec_from_config, sliding_window_limit
from prepare.options import PrepareOptions
from prepare.shard import LinearCutter, check_source_names, rank_tensors
from prepare.source import Checkpoint, SourceError, open_checkpoint
from prepare.source_quant import SourceQuant, source_quant
from proto import package_pb2
from runtime.layout import check_block_split, check_tp, shard_tensors
from runtime.package import (
    DTYPES,
    MANIFEST_NAME,
    check_shard_tensors,
    format_version_for,
    sha256_file,
    shard_path,
)
from runtime.quant import KV_FP8, WeightQuant
from runtime.signing import SIGNATURE_NAME, load_private_key, sign_manifest
from runtime.spec import Capacities, chosen_prefill_chunks, default_decode_buckets
from runtime.version import __version__


def prepare_package(model: Path, out: Path, opts: PrepareOptions, progress: bool = True) -> Path:
    out = Path(out).resolve()
    if out.exists() and not opts.force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it.")
    signer = load_private_key(opts.sign_key) if opts.sign_key else None
    ckpt = open_checkpoint(Path(model))
    source = source_quant(ckpt.config)
    quant = _package_quant(source, opts.quantize)
    manifest = _manifest_head(ckpt, opts, quant)
    spec = model_spec_from_config(ckpt.config, opts.tp)
    check_source_names(ckpt.tensors, spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_tokenizer(ckpt, tmp, manifest)
        _write_shards(ckpt, tmp, manifest, LinearCutter(ckpt.tensors, quant, source), progress)
        data = manifest.SerializeToString()
        if signer is not None:
            _write_atomic(tmp / SIGNATURE_NAME, sign_manifest(data, signer))
        _write_atomic(tmp / MANIFEST_NAME, data)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _package_quant(source: SourceQuant | None, quantize: str) -> WeightQuant | None:
    if quantize not in ("", "fp8"):
        raise SourceError(f"--quantize {quantize!r} is not supported; the one scheme is fp8.")
    if source is not None:
        return source.quant
    return WeightQuant("fp8-channel") if quantize == "fp8" else None


def _manifest_head(
    ckpt: Checkpoint, opts: PrepareOptions, quant: WeightQuant | None
) -> package_pb2.Manifest:
    spec = model_spec_from_config(ckpt.config, opts.tp)
    check_tp(spec, opts.tp)
    if quant is not None:
        check_block_split(spec, opts.tp, quant)
    dtype = opts.dtype
    if dtype == "auto":
        dtype = {v: k for k, v in DTYPES.items()}.get(ckpt.source_dtype, "float32")
    if dtype not in DTYPES:
        raise SourceError(f"--dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}.")
    max_seq_len = opts.max_seq_len or min(spec.max_position_embeddings, 4096)
    if max_seq_len > spec.max_position_embeddings:
        raise SourceError(
            f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})."
        )
    window = sliding_window_limit(ckpt.config)
    if window is not None and max_seq_len > window:
        raise SourceError(
            f"--max-seq-len {max_seq_len} exceeds the model's sliding_window ({window}); Orbit "
            f"attends to the whole context, so pass --max-seq-len {window} or less."
        )
    if opts.max_batch < 1 or opts.kv_page_size < 1 or opts.max_step_tokens < 1:
        raise SourceError("--max-batch, --page-size and --max-step-tokens must be at least 1.")
    try:
        prefill_chunks = chosen_prefill_chunks(opts.max_step_tokens, opts.prefill_buckets)
    except ValueError as e:
        raise SourceError(str(e)) from None
    caps = Capacities(
        max_seq_len=max_seq_len,
        max_batch=opts.max_batch,
        kv_page_size=opts.kv_page_size,
        decode_batch_buckets=default_decode_buckets(opts.max_batch),
        prefill_chunk_sizes=prefill_chunks,
    )
    manifest = package_pb2.Manifest(
        format_version=format_version_for(quant),
        producer_version=__version__,
        source_name=ckpt.name,
        model=spec.to_proto(),
        dtype=dtype,
        tp_size=opts.tp,
        capacities=caps.to_proto(),
    )
    if quant is not None:
        manifest.quantization.CopyFrom(quant.to_proto())
    _record_kv(ckpt, opts, spec.num_layers, manifest.quantization)
    return manifest


def _record_kv(
    ckpt: Checkpoint, opts: PrepareOptions, num_layers: int, q: package_pb2.Quantization
) -> None:
    """The default KV dtype and any calibrated per-layer k/v scales of the checkpoint
    (compressed-tensors kv_cache_scheme: self_attn.k_scale / v_scale, one number a layer)."""
    if opts.kv_dtype not in ("", "fp8"):
        raise SourceError(
            f"--kv-dtype {opts.kv_dtype!r} is not supported; pass fp8 or leave it out."
        )
    names = ckpt.tensors.names()
    scales: dict[str, list[float]] = {"k": [], "v": []}
    for kind, values in scales.items():
        found = [f"model.layers.{i}.self_attn.{kind}_scale" in names for i in range(num_layers)]
        if any(found) and not all(found):
            raise SourceError(
                f"the checkpoint has self_attn.{kind}_scale for some layers but not layer "
                f"{found.index(False)}; its KV scales are incomplete."
            )
        for i in range(num_layers if all(found) else 0):
            value = ckpt.tensors.read(f"model.layers.{i}.self_attn.{kind}_scale").float()
            if value.numel() != 1 or not float(value) > 0 or not math.isfinite(float(value)):
                raise SourceError(
                    f"model.layers.{i}.self_attn.{kind}_scale is not one positive number; "
                    "Orbit reads per-tensor KV scales only."
                )
            values.append(float(value))
    if bool(scales["k"]) != bool(scales["v"]):
        raise SourceError("the checkpoint has k_scale without v_scale (or the reverse).")
    q.kv_k_scales.extend(scales["k"])
    q.kv_v_scales.extend(scales["v"])
    if opts.kv_dtype == "fp8" or _has_kv_scheme(ckpt.config):
        q.kv_cache = KV_FP8


def _has_kv_scheme(config) -> bool:
    """A compressed-tensors checkpoint calibrated for an FP8 KV cache says so."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return bool(qc and qc.get("kv_cache_scheme"))


def _file_entry(root: Path, path: Path) -> package_pb2.FileEntry:
    return package_pb2.FileEntry(
        path=path.relative_to(root).as_posix(),
        size_bytes=path.stat().st_size,
        sha256=sha256_file(path),
    )


def _write_tokenizer(ckpt: Checkpoint, root: Path, manifest: package_pb2.Manifest) -> None:
    tok_dir = root / "tokenizer"
    ckpt.tokenizer.save_pretrained(str(tok_dir))
    tok = manifest.tokenizer
    for path in sorted(p for p in tok_dir.rglob("*") if p.is_file()):
        tok.files.append(_file_entry(root, path))
    tok.chat_template = ckpt.tokenizer.chat_template or ""
    bos = ckpt.tokenizer.bos_token_id
    if bos is not None:
        tok.bos_token_id, tok.has_bos = bos, True
    eos = list(ckpt.generation_eos)
    for candidate in (getattr(ckpt.config, "eos_token_id", None), ckpt.tokenizer.eos_token_id):
        for e in candidate if isinstance(candidate, list) else [candidate]:
            if e is not None and e not in eos:
                eos.append(e)
    tok.eos_token_ids.extend(eos)


def _write_shards(
    ckpt: Checkpoint,
    root: Path,
    manifest: package_pb2.Manifest,
    linears: LinearCutter,
    progress: bool,
) -> None:
    from safetensors.torch import save_file

    spec = model_spec_from_config(ckpt.config, manifest.tp_size)
    tp, dtype = manifest.tp_size, DTYPES[manifest.dtype]
    expected = shard_tensors(spec, tp, dtype, linears.target)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("preparing shards", total=tp * len(expected))
        for rank in range(tp):
            tensors = {}
            for name, t in rank_tensors(ckpt.tensors, spec, rank, tp, linears):
                tensors[name] = t.to(expected[name][1]).contiguous()
                bar.advance(task)
            path = root / shard_path(rank, tp)
            check_shard_tensors(path, tensors, expected)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path), metadata={"orbit_rank": str(rank), "orbit_tp": str(tp)})
            del tensors
            _fsync(path)
            manifest.shards.append(package_pb2.Shard(rank=rank, file=_file_entry(root, path)))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _replace_dir(new: Path, out: Path) -> None:
    if out.exists():
        # Move the old package aside first so `out` is never a half-written mix of both.
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "pkg")
        os.rename(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(new, out)
