"""Speculative decoding with a draft model through `orbit serve` (real processes, TP 1 and 2,
the official openai client): with `--speculate draft`, greedy and seeded outputs equal those
without speculation, token for token (stop strings, max_tokens inside a kept run, n > 1,
logprobs, preemption in a small pool, a cancelled stream), for a draft that is the served model
itself (proposals kept) and for another model (proposals rejected); unseeded sampling draws from
the same distribution; the flags are checked at start."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.models import make_tiny_checkpoint
from tests.server import REPO, ServerProcess
from tests.test_speculation_serve import _workload, check_same_distribution

CAPS = {"max_batch": 8, "kv_page_size": 4, "max_step_tokens": 32}


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory, tokenizer_dir):
    """A tiny Llama with the served one's tokenizer and other random weights."""
    return make_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("other") / "llama", tokenizer_dir, 99
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_outputs_with_a_draft_model_equal_outputs_without(
    tp, tiny_checkpoints, other_llama, package_cache
):
    pkg = package_cache(tiny_checkpoints["llama"], tp, **CAPS)
    drafts = {
        "itself": package_cache(tiny_checkpoints["llama"], 1, **CAPS),
        "other": package_cache(other_llama, 1, **CAPS),
    }
    with ServerProcess(pkg, "--kv-pages", "512") as off:
        without = asyncio.run(_workload(off.url))
    acceptance = {}
    for name, draft in drafts.items():
        # 48 pages of 4 tokens: five prompts of ~60 tokens with their outputs preempt.
        args = ("--kv-pages", "48", "--speculate", "draft", "--draft", str(draft))
        with ServerProcess(pkg, *args) as on:
            with_spec = asyncio.run(_workload(on.url))
            metrics = on.metrics()
        for kind in without.keys() - {"logprob_values"}:
            assert with_spec[kind] == without[kind], (name, kind)
        assert with_spec["logprob_values"] == pytest.approx(without["logprob_values"], abs=1e-3)
        assert [n for _, n in with_spec["short"]] == [3, 7, 13, 21, 34]
        assert metrics["orbit_preemptions_total"] > 0, name
        assert metrics["orbit_kv_pages_in_use"] == 0, name
        proposed = metrics["orbit_spec_proposed_tokens_total"]
        acceptance[name] = metrics["orbit_spec_accepted_tokens_total"] / proposed
    # the served model drafting for itself proposes what it then draws (greedy requests are
    # most of the workload); another model's proposals are mostly rejected
    assert acceptance["itself"] > 0.6
    assert acceptance["other"] < 0.2


def test_sampling_with_a_draft_model_draws_from_the_same_distribution(smollm2_path, package_cache):
    """Unseeded draws of the real SmolLM2 drafting for itself: its greedy proposals are kept
    when the draw makes them, so some are kept and some rejected; the outputs' distribution
    is that without speculation."""
    pkg = package_cache(smollm2_path, 1)
    check_same_distribution(pkg, ("--speculate", "draft", "--draft", str(pkg)))


def _serve_fails(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "orbit", "serve", *args, "--port", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    return " ".join((proc.stdout + proc.stderr).split())  # rich folds long lines


def test_draft_flags_are_checked(tiny_checkpoints, package_cache, tmp_path):
    pkg = str(package_cache(tiny_checkpoints["llama"], 1, **CAPS))
    assert "go together" in _serve_fails(pkg, "--speculate", "draft")
    assert "go together" in _serve_fails(pkg, "--draft", pkg)
    assert "no Orbit package there" in _serve_fails(
        pkg, "--speculate", "draft", "--draft", str(tmp_path)
    )
    other_page = str(package_cache(tiny_checkpoints["llama"], 1, kv_page_size=8))
    out = _serve_fails(pkg, "--speculate", "draft", "--draft", other_page)
    assert "prepare it with --page-size 4" in out
