"""Bad packages and bad prepares are refused with messages that name the file and field."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prepare.build import PrepareOptions, prepare_package
from runtime.layout import ShardingError
from runtime.package import MANIFEST_NAME, PackageError, open_package, read_manifest
from tests.cli import default_sigint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pkg(tiny_checkpoints, package_cache, tmp_path) -> Path:
    src = package_cache(tiny_checkpoints["qwen2"], 2, max_batch=4)
    dst = tmp_path / "pkg"
    shutil.copytree(src, dst)
    return dst


def test_good_package_loads_every_shard(pkg):
    p = open_package(pkg)
    assert p.tp_size == 2
    for rank in range(2):
        tensors = p.load_shard(rank)
        assert tensors["layers.0.qkv.bias"].shape[0] == (4 + 2 * 2) // 2 * p.spec.head_dim


def test_non_dividing_tp_names_field_and_valid_sizes(smollm2_path, tmp_path):
    with pytest.raises(ShardingError) as e:
        prepare_package(smollm2_path, tmp_path / "out", PrepareOptions(tp=2), progress=False)
    assert str(e.value) == (
        "num_heads=9 is not divisible by --tp 2; valid TP sizes for this model: 1, 3."
    )
    assert not (tmp_path / "out").exists()


def test_cli_reports_non_dividing_tp(tiny_checkpoints, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "orbit",
            "prepare",
            str(tiny_checkpoints["llama"]),
            "--tp",
            "3",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "num_heads=4 is not divisible by --tp 3; valid TP sizes for this model: 1, 2." in (
        " ".join(r.stderr.split())
    )


def test_prefill_buckets_are_the_package_token_buckets(tiny_checkpoints, tmp_path):
    """`orbit prepare --prefill-buckets` sets the prompt-step graphs' token buckets, ending at
    the step budget; a list that is not ascending, passes the budget or is not numbers is
    refused with the fix, and nothing is written."""

    def prepare(out: str, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "orbit", "prepare", str(tiny_checkpoints["llama"])]
        cmd += ["--out", str(tmp_path / out), "--max-step-tokens", "96", *args]
        return subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
        )

    good = prepare("dense", "--prefill-buckets", "16,32,48,64,80")
    assert good.returncode == 0, good.stderr
    assert open_package(tmp_path / "dense").capacities.prefill_chunk_sizes == (
        16,
        32,
        48,
        64,
        80,
        96,
    )
    default = prepare("default")
    assert default.returncode == 0, default.stderr
    assert open_package(tmp_path / "default").capacities.prefill_chunk_sizes == (16, 32, 64, 96)
    for out, buckets, said in (
        ("down", "32,16", "--prefill-buckets 32,16 must be positive and ascending, each once."),
        ("past", "16,128", "--prefill-buckets goes up to 128, past --max-step-tokens 96"),
        ("words", "16,a", "--prefill-buckets '16,a' must be whole numbers separated by commas"),
    ):
        bad = prepare(out, "--prefill-buckets", buckets)
        assert bad.returncode == 1
        assert said in " ".join(bad.stderr.split())
        assert not (tmp_path / out).exists()


def test_missing_shard(pkg):
    shard = pkg / open_package(pkg).manifest.shards[1].file.path
    shard.unlink()
    with pytest.raises(PackageError, match=rf"{shard}: file is missing"):
        open_package(pkg).load_shard(1)


def test_flipped_byte_in_shard(pkg):
    shard = pkg / open_package(pkg).manifest.shards[0].file.path
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(
        PackageError, match=rf"{shard}: sha256 is [0-9a-f]{{64}}, the manifest says"
    ):
        open_package(pkg).load_shard(0)


def test_truncated_shard(pkg):
    shard = pkg / open_package(pkg).manifest.shards[0].file.path
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(
        PackageError, match=rf"size_bytes is {size - 100}, the manifest says {size}"
    ):
        open_package(pkg).load_shard(0)


def test_truncated_manifest(pkg):
    m = pkg / MANIFEST_NAME
    m.write_bytes(m.read_bytes()[:-7])
    with pytest.raises(PackageError, match="not a valid manifest|capacities|tp_size"):
        open_package(pkg)


def test_newer_format_version_refused(pkg):
    m = read_manifest(pkg)
    m.format_version = 99
    (pkg / MANIFEST_NAME).write_bytes(m.SerializeToString())
    with pytest.raises(PackageError, match="format_version 99 is not readable .* upgrade Orbit"):
        open_package(pkg)


def test_tokenizer_file_tampered(pkg):
    tok = pkg / open_package(pkg).manifest.tokenizer.files[0].path
    tok.write_bytes(tok.read_bytes() + b" ")
    with pytest.raises(PackageError, match=rf"{tok}: size_bytes"):
        open_package(pkg)


def test_wrong_tensor_shape_names_tensor(pkg):
    from safetensors.torch import load_file, save_file

    from runtime.package import sha256_file

    p = open_package(pkg)
    entry = p.manifest.shards[0].file
    path = pkg / entry.path
    tensors = load_file(str(path))
    tensors["layers.1.down.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path))
    m = p.manifest
    m.shards[0].file.size_bytes = path.stat().st_size
    m.shards[0].file.sha256 = sha256_file(path)
    (pkg / MANIFEST_NAME).write_bytes(m.SerializeToString())
    with pytest.raises(PackageError, match=r"tensor 'layers.1.down.weight' has shape \(3, 3\)"):
        open_package(pkg).load_shard(0)


def test_path_escaping_package_refused(pkg):
    m = read_manifest(pkg)
    m.shards[0].file.path = "../../etc/passwd"
    (pkg / MANIFEST_NAME).write_bytes(m.SerializeToString())
    with pytest.raises(PackageError, match="escapes the package"):
        open_package(pkg)


def test_existing_output_is_not_replaced_without_force(tiny_checkpoints, tmp_path):
    out = tmp_path / "pkg"
    out.mkdir()
    with pytest.raises(FileExistsError, match="pass --force"):
        prepare_package(tiny_checkpoints["llama"], out, PrepareOptions(), progress=False)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_prepare_leaves_no_package(smollm2_path, tmp_path, sig):
    out = tmp_path / "pkg"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orbit",
            "prepare",
            str(smollm2_path),
            "--tp",
            "3",
            "--out",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".pkg.partial-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not out.exists()
    for partial in tmp_path.glob(".pkg.partial-*"):  # only a SIGKILL can leave one behind
        assert sig == signal.SIGKILL
        with pytest.raises(PackageError, match="manifest.pb is missing"):
            open_package(partial)
