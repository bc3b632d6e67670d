"""Packages written by older Orbits (and one of each format version this one writes) still load
and compute what they did (docs/package-format.md)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.package import open_package
from tests.tp_harness import run_tp

PACKAGES = Path(__file__).resolve().parent / "data" / "packages"


def test_format_1_package_loads_and_matches_its_reference(tmp_path):
    pkg_dir = PACKAGES / "v1-tiny-llama-tp2"
    pkg = open_package(pkg_dir)
    assert pkg.manifest.format_version == 1
    ref = json.loads((PACKAGES / "v1-tiny-llama-tp2.reference.json").read_text())
    got = run_tp(pkg_dir, 2, [ref["prompt"]], max_new=1, chunk=3, tmp=tmp_path)
    logits, expected = torch.tensor(got[0]["logits"]), torch.tensor(ref["last_logits"])
    assert ((logits - expected).norm() / expected.norm()).item() <= 1e-4


def test_format_2_fp8_package_loads_and_matches_its_reference(tmp_path):
    pkg_dir = PACKAGES / "v2-tiny-llama-fp8-tp2"
    pkg = open_package(pkg_dir)
    assert pkg.manifest.format_version == 2
    assert pkg.quant.scheme == "fp8-channel"
    assert pkg.load_shard(1)["layers.0.down.weight"].dtype == torch.float8_e4m3fn
    ref = json.loads((PACKAGES / "v2-tiny-llama-fp8-tp2.reference.json").read_text())
    got = run_tp(pkg_dir, 2, [ref["prompt"]], max_new=1, chunk=3, tmp=tmp_path)
    logits, expected = torch.tensor(got[0]["logits"]), torch.tensor(ref["last_logits"])
    assert ((logits - expected).norm() / expected.norm()).item() <= 1e-4
