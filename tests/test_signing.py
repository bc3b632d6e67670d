"""Signed packages: ranks and the frontend refuse unsigned, tampered or wrongly signed ones."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.package import MANIFEST_NAME, PackageError, open_package, read_manifest
from runtime.signing import load_public_key

REPO = Path(__file__).resolve().parents[1]


def _orbit(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orbit", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    for name in ("good", "other"):
        r = _orbit("keygen", str(d / name))
        assert r.returncode == 0, r.stderr
    return {n: (d / n, d / f"{n}.pub") for n in ("good", "other")}


@pytest.fixture(scope="module")
def signed(keys, tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("signed") / "pkg"
    r = _orbit(
        "prepare",
        str(tiny_checkpoints["qwen3"]),
        "--out",
        str(out),
        "--max-batch",
        "4",
        "--sign",
        str(keys["good"][0]),
    )
    assert r.returncode == 0, r.stderr
    return out


def test_signed_package_opens_with_its_key(signed, keys):
    pkg = open_package(signed, trusted_keys=[load_public_key(keys["good"][1])])
    assert pkg.tp_size == 1


def test_wrong_key_is_refused(signed, keys):
    with pytest.raises(PackageError, match="does not match the manifest under any trusted key"):
        open_package(signed, trusted_keys=[load_public_key(keys["other"][1])])


def test_tampered_manifest_is_refused(signed, keys, tmp_path):
    pkg = tmp_path / "pkg"
    shutil.copytree(signed, pkg)
    m = read_manifest(pkg)
    m.capacities.max_batch = 64
    (pkg / MANIFEST_NAME).write_bytes(m.SerializeToString())
    with pytest.raises(PackageError, match="does not match the manifest"):
        open_package(pkg, trusted_keys=[load_public_key(keys["good"][1])])


def test_unsigned_package_is_refused_by_serve_and_by_a_rank(keys, tiny_checkpoints, package_cache):
    unsigned = package_cache(tiny_checkpoints["qwen3"], 1, max_batch=4)
    r = _orbit("serve", str(unsigned), "--port", "1", "--trusted-key", str(keys["good"][1]))
    assert r.returncode == 1
    assert "is not signed (manifest.sig is missing)" in " ".join(r.stderr.split())
    # A rank checks on its own too: a tampered frontend cannot make it load an unsigned package.
    rank = subprocess.run(
        [
            sys.executable,
            "-m",
            "ranks",
            "--package",
            str(unsigned),
            "--rank",
            "0",
            "--tp-size",
            "1",
            "--frontend",
            "tcp://127.0.0.1:9",
            "--dist-init",
            "tcp://127.0.0.1:9",
            "--trusted-key",
            str(keys["good"][1]),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rank.returncode == 1
    assert "is not signed" in rank.stderr
