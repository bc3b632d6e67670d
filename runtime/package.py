"""Read and verify a package: the manifest, every file's size and SHA-256, and shard tensors.

Nothing is substituted: any mismatch raises PackageError naming the file and the field.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath

import torch
from google.protobuf.message import DecodeError

from proto import package_pb2
from runtime.layout import shard_tensors
from runtime.quant import KV_FP8, SCHEMES, KVQuant, WeightQuant, kv_quant_for
from runtime.spec import Capacities, ModelSpec

MANIFEST_NAME = "manifest.pb"
# Format versions this Orbit reads; see docs/package-format.md for what each one means. A
# package is written with the lowest version that can hold it: 2 only for FP8 weights, so
# older Orbits keep loading every package they could load before.
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)


def format_version_for(quant: WeightQuant | None) -> int:
    return 1 if quant is None else 2


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PackageError(ValueError):
    """The package is missing, damaged or not one this Orbit can load."""


def shard_path(rank: int, tp: int) -> str:
    return f"shards/rank-{rank:05d}-of-{tp:05d}.safetensors"


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(package_dir: Path) -> package_pb2.Manifest:
    path = Path(package_dir) / MANIFEST_NAME
    if not path.is_file():
        raise PackageError(
            f"{package_dir} is not an Orbit package: {MANIFEST_NAME} is missing "
            "(create one with `orbit prepare MODEL --tp N --out PKG`)."
        )
    manifest = package_pb2.Manifest()
    try:
        manifest.ParseFromString(path.read_bytes())
    except DecodeError as e:
        raise PackageError(f"{path}: not a valid manifest ({e}).") from e
    v = manifest.format_version
    if v not in READABLE_FORMAT_VERSIONS:
        newest = max(READABLE_FORMAT_VERSIONS)
        fix = "upgrade Orbit" if v > newest else "re-create the package with `orbit prepare`"
        raise PackageError(
            f"{path}: format_version {v} is not readable by this Orbit "
            f"(reads up to {newest}); {fix}."
        )
    return manifest


@dataclass(frozen=True)
class Package:
    """A verified package directory. Build with open_package()."""

    root: Path
    manifest: package_pb2.Manifest

    @cached_property
    def spec(self) -> ModelSpec:
        return ModelSpec.from_proto(self.manifest.model)

    @cached_property
    def capacities(self) -> Capacities:
        return Capacities.from_proto(self.manifest.capacities)

    @property
    def tp_size(self) -> int:
        return self.manifest.tp_size

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest.dtype]

    @cached_property
    def quant(self) -> WeightQuant | None:
        return WeightQuant.from_proto(self.manifest.quantization)

    def kv_quant(self, kv_dtype: str = "auto") -> KVQuant | None:
        """What the KV pages hold for `orbit serve --kv-dtype` (runtime/quant.py KV_DTYPES):
        None for the package's dtype, else FP8 with the package's per-layer scales."""
        return kv_quant_for(self.manifest.quantization, self.spec.num_layers, kv_dtype)

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the manifest: names this exact package (it holds every file's hash)."""
        return hashlib.sha256((self.root / MANIFEST_NAME).read_bytes()).hexdigest()

    def shard_file(self, rank: int) -> Path:
        return self.root / self.manifest.shards[rank].file.path

    def load_shard(self, rank: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Verify one rank's shard file and return its tensors, checked against the spec."""
        from safetensors.torch import load_file

        entry = self.manifest.shards[rank].file
        verify_file(self.root, entry)
        path = self.root / entry.path
        try:
            tensors = load_file(str(path), device=str(device))
        except Exception as e:  # safetensors raises its own error types
            raise PackageError(f"{path}: cannot be read as safetensors ({e}).") from e
        expected = shard_tensors(self.spec, self.tp_size, self.dtype, self.quant)
        check_shard_tensors(path, tensors, expected)
        return tensors


def _safe_relative(root: Path, rel: str) -> Path:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not rel:
        raise PackageError(f"{root / MANIFEST_NAME}: file path {rel!r} escapes the package.")
    return root / p


def verify_file(root: Path, entry: package_pb2.FileEntry) -> None:
    path = _safe_relative(root, entry.path)
    if not path.is_file():
        raise PackageError(f"{path}: file is missing from the package (listed in the manifest).")
    size = path.stat().st_size
    if size != entry.size_bytes:
        raise PackageError(
            f"{path}: size_bytes is {size}, the manifest says {entry.size_bytes} "
            "(truncated or replaced; copy the package again)."
        )
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise PackageError(
            f"{path}: sha256 is {digest}, the manifest says {entry.sha256} "
            "(corrupted; copy the package again)."
        )


def check_shard_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise PackageError(f"{path}: tensor {missing[0]!r} is missing.")
    if extra:
        raise PackageError(f"{path}: unexpected tensor {extra[0]!r}.")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise PackageError(
                f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}."
            )
        if t.dtype != dtype:
            raise PackageError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected {dtype}.")


def check_manifest(root: Path, m: package_pb2.Manifest) -> None:
    """Structural checks that need no file reads."""
    where = root / MANIFEST_NAME
    if m.dtype not in DTYPES:
        raise PackageError(f"{where}: dtype {m.dtype!r} is not one of {', '.join(DTYPES)}.")
    if m.tp_size < 1 or len(m.shards) != m.tp_size:
        raise PackageError(
            f"{where}: tp_size is {m.tp_size} but {len(m.shards)} shards are listed."
        )
    for i, shard in enumerate(m.shards):
        if shard.rank != i:
            raise PackageError(f"{where}: shards[{i}].rank is {shard.rank}, expected {i}.")
        _safe_relative(root, shard.file.path)
    c = m.capacities
    if not (c.max_seq_len and c.max_batch and c.kv_page_size):
        raise PackageError(
            f"{where}: capacities are incomplete (max_seq_len, max_batch, kv_page_size)."
        )
    if not c.decode_batch_buckets or c.decode_batch_buckets[-1] != c.max_batch:
        raise PackageError(f"{where}: capacities.decode_batch_buckets must end at max_batch.")
    if not c.prefill_chunk_sizes:
        raise PackageError(f"{where}: capacities.prefill_chunk_sizes is empty.")
    quant = WeightQuant.from_proto(m.quantization)
    if quant is not None:
        if quant.scheme not in SCHEMES:
            raise PackageError(
                f"{where}: quantization.weights {quant.scheme!r} is not one of "
                f"{', '.join(SCHEMES)}; upgrade Orbit."
            )
        if quant.scheme == "fp8-block" and min(quant.block) < 1:
            raise PackageError(f"{where}: fp8-block quantization without a block size.")
        if m.format_version < 2:
            raise PackageError(
                f"{where}: quantized weights need format_version 2, the manifest says "
                f"{m.format_version}; re-create the package with `orbit prepare`."
            )
    _check_kv_quant(where, m)
    # raises on a spec that cannot split (or split without cutting a scale block)
    shard_tensors(ModelSpec.from_proto(m.model), m.tp_size, DTYPES[m.dtype], quant)


def _check_kv_quant(where: str, m: package_pb2.Manifest) -> None:
    q = m.quantization
    if q.kv_cache not in ("", KV_FP8):
        raise PackageError(
            f"{where}: quantization.kv_cache {q.kv_cache!r} is not {KV_FP8!r} or empty; "
            "upgrade Orbit."
        )
    for name in ("kv_k_scales", "kv_v_scales"):
        scales = getattr(q, name)
        if len(scales) not in (0, m.model.num_layers) or len(scales) != len(q.kv_k_scales):
            raise PackageError(
                f"{where}: quantization.{name} has {len(scales)} values; it needs one per "
                f"layer ({m.model.num_layers}) for both k and v, or none."
            )
        if not all(math.isfinite(x) and x > 0 for x in scales):
            raise PackageError(f"{where}: quantization.{name} holds a scale that is not > 0.")


def open_package(
    package_dir: Path | str, verify_tokenizer: bool = True, trusted_keys: list | None = None
) -> Package:
    """Read the manifest and check its structure (and tokenizer files); shards are verified
    when a rank loads them, so a host checks only the shards it holds. With trusted_keys
    (Ed25519 public keys), the manifest must carry a valid signature by one of them."""
    root = Path(package_dir)
    manifest = read_manifest(root)
    if trusted_keys is not None:
        from runtime.signing import SignatureError, verify_manifest

        try:
            verify_manifest(root, (root / MANIFEST_NAME).read_bytes(), trusted_keys)
        except SignatureError as e:
            raise PackageError(str(e)) from None
    check_manifest(root, manifest)
    if verify_tokenizer:
        for entry in manifest.tokenizer.files:
            verify_file(root, entry)
    return Package(root, manifest)


def check_draft(target: Package, draft: Package) -> None:
    """Refuse, naming the difference and the fix, a draft package that cannot propose for the
    served one."""

    def tokenizer_json(pkg: Package) -> str:
        files = {f.path.rsplit("/", 1)[-1]: f.sha256 for f in pkg.manifest.tokenizer.files}
        return files.get("tokenizer.json", "")

    t, d = target.capacities, draft.capacities
    problems = []
    if draft.tp_size != 1:
        problems.append(
            f"it is prepared for TP {draft.tp_size}, but runs whole on rank 0: "
            "prepare it with --tp 1"
        )
    if draft.spec.vocab_size != target.spec.vocab_size:
        problems.append(
            f"its vocabulary has {draft.spec.vocab_size} tokens, the served model's "
            f"{target.spec.vocab_size}: use a draft with the same tokenizer"
        )
    elif tokenizer_json(draft) != tokenizer_json(target):
        problems.append(
            "its tokenizer.json differs from the served model's: use a draft with the same "
            "tokenizer"
        )
    if d.kv_page_size != t.kv_page_size:
        problems.append(
            f"its KV pages hold {d.kv_page_size} tokens, the served model's "
            f"{t.kv_page_size}: prepare it with --page-size {t.kv_page_size}"
        )
    if d.max_seq_len < t.max_seq_len or d.max_batch < t.max_batch:
        problems.append(
            f"its capacities (max_seq_len {d.max_seq_len}, max_batch {d.max_batch}) are below "
            f"the served model's ({t.max_seq_len}, {t.max_batch}): prepare it with "
            f"--max-seq-len {t.max_seq_len} --max-batch {t.max_batch}"
        )
    if problems:
        raise ValueError(f"the draft package {draft.root} cannot draft: " + "; ".join(problems))
