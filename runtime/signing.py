"""Ed25519 signatures over a package's manifest.

The manifest holds the size and SHA-256 of every other file, so one signature over its bytes
covers the whole package. The signature lives beside it in `manifest.sig` (raw 64 bytes); keys
are PEM files (PKCS#8 private, SubjectPublicKeyInfo public) made by `orbit keygen`.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_NAME = "manifest.sig"


class SignatureError(ValueError):
    """A package is unsigned, wrongly signed, or a key cannot be read."""


def generate_keypair(private_path: Path) -> Path:
    """Write a new private key to private_path (mode 600) and its public key to PATH.pub."""
    key = Ed25519PrivateKey.generate()
    private_path = Path(private_path)
    if private_path.exists():
        raise SignatureError(f"{private_path} already exists; choose another path.")
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path = private_path.with_name(private_path.name + ".pub")
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise SignatureError(f"{path}: not a readable Ed25519 private key ({e}).") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{path}: not an Ed25519 private key; make one with `orbit keygen`.")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as e:
        raise SignatureError(f"{path}: not a readable Ed25519 public key ({e}).") from e
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{path}: not an Ed25519 public key.")
    return key


def sign_manifest(manifest_bytes: bytes, key: Ed25519PrivateKey) -> bytes:
    return key.sign(manifest_bytes)


def verify_manifest(
    package_dir: Path, manifest_bytes: bytes, trusted: list[Ed25519PublicKey]
) -> None:
    """Refuse unless manifest.sig is a valid signature by one of the trusted keys."""
    sig_path = Path(package_dir) / SIGNATURE_NAME
    if not sig_path.is_file():
        raise SignatureError(
            f"{package_dir} is not signed ({SIGNATURE_NAME} is missing) and signatures are "
            "required; prepare it with `orbit prepare --sign KEY`."
        )
    signature = sig_path.read_bytes()
    for key in trusted:
        try:
            key.verify(signature, manifest_bytes)
            return
        except InvalidSignature:
            continue
    raise SignatureError(
        f"{sig_path}: the signature does not match the manifest under any trusted key "
        "(tampered, or signed with another key)."
    )
