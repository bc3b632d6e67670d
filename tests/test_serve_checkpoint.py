"""`orbit serve CHECKPOINT`: a GGUF file or Hugging Face directory is prepared once into the
package cache (prepare/cache.py) and served; later starts reuse it; an interrupted prepare
leaves nothing that is used; a wrong --tp fails at once naming the valid sizes. Real CLI
processes, the official openai client, transformers as the reference."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from orbit.core.local_ranks import free_port
from tests.cli import REPO, default_sigint, orbit
from tests.server import ServerProcess, live_in_group

# Small capacities keep the SmolLM2 package and its KV cache light on a 2-core runner.
SMOL_FLAGS = ("--max-seq-len", "512", "--max-batch", "8", "--max-step-tokens", "64")
PROMPT = "The capital of France is"


def _valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate: int) -> list[int]:
    return [n for n in range(1, 65) if not (num_heads % n or num_kv_heads % n or intermediate % n)]


@pytest.fixture(scope="module")
def smol_fields(smollm2_path) -> dict:
    """The GGUF's metadata as the gguf package's own reader parses it (every field, slowly)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(smollm2_path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_gguf_header_scan_matches_the_gguf_reader(smollm2_path, smol_fields):
    from prepare.source_header import gguf_metadata

    ours = gguf_metadata(smollm2_path)
    scalars = {k: v for k, v in smol_fields.items() if not isinstance(v, list)}
    assert ours.keys() == scalars.keys()
    for key, value in scalars.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value


def test_wrong_tp_fails_at_once_naming_the_valid_sizes(
    smollm2_path, smol_fields, tiny_checkpoints, tmp_path
):
    from transformers import AutoConfig

    arch = smol_fields["general.architecture"]
    smol_sizes = _valid_tp_sizes(
        smol_fields[f"{arch}.attention.head_count"],
        smol_fields[f"{arch}.attention.head_count_kv"],
        smol_fields[f"{arch}.feed_forward_length"],
    )
    tiny = tiny_checkpoints["llama"]
    c = AutoConfig.from_pretrained(tiny)
    tiny_sizes = _valid_tp_sizes(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
    cache = tmp_path / "cache"
    runs = [
        (smol_sizes, ["prepare", str(smollm2_path), "--out", str(tmp_path / "pkg")]),
        (smol_sizes, ["serve", str(smollm2_path), "--cache-dir", str(cache)]),
        (tiny_sizes, ["serve", str(tiny), "--cache-dir", str(cache)]),
    ]
    for sizes, args in runs:
        wrong = next(n for n in range(2, 65) if n not in sizes)
        start = time.monotonic()
        r = orbit(*args, "--tp", str(wrong))
        elapsed_s = time.monotonic() - start
        assert r.returncode == 1, r.stderr
        assert f"valid TP sizes for this model: {', '.join(map(str, sizes))}." in " ".join(
            r.stderr.split()
        )
        # Before this check read the header, the GGUF's weights were read first (18-35 s).
        assert elapsed_s < 8, f"{args[0]} took {elapsed_s:.1f} s to refuse --tp {wrong}"
    assert not (tmp_path / "pkg").exists() and not cache.exists()


def test_a_checkpoint_that_fails_to_prepare_is_named_in_one_error(tiny_checkpoints, tmp_path):
    """The prepare runs in a child process, and transformers' own errors (whose exception
    types cannot be rebuilt from their message) still reach the user as one line that says
    what is wrong; the cache is left without an entry."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoints["llama"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_attention_heads"] = 3  # 64 hidden units are not split into 3 heads
    (bad / "config.json").write_text(json.dumps(config))
    cache = tmp_path / "cache"
    r = orbit("serve", str(bad), "--cache-dir", str(cache), "--port", str(free_port()))
    said = " ".join(r.stderr.split())
    assert r.returncode == 1, r.stderr
    assert f"error: preparing {bad} failed" in said, r.stderr
    assert "not a multiple of the number of attention heads (3)" in said, r.stderr
    assert "Traceback" not in r.stderr and "BrokenProcessPool" not in r.stderr, r.stderr
    assert _entries(cache) == []


def _entries(cache: Path) -> list[Path]:
    return [p for p in (cache / "packages").iterdir() if not p.name.startswith(".")]


def _start(source: Path, *args: str, timeout_s: float = 180.0) -> tuple[ServerProcess, float]:
    server = ServerProcess(source, *args, ready_timeout_s=timeout_s)
    start = time.monotonic()
    server.__enter__()
    return server, time.monotonic() - start


def _stop(server: ServerProcess) -> str:
    server.stop()
    return server.proc.stdout.read().decode()


def _greedy_ids(source: Path, prompt_ids: list[int], max_new: int, gguf: str | None = None):
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf} if gguf else {}
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, **kw).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


def _complete(server: ServerProcess, prompt_ids: list[int], max_tokens: int) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    got = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0
    )
    assert got.usage.completion_tokens == max_tokens
    return got.choices[0].text


def test_hf_directory_tp2_is_prepared_once_then_reused(tiny_checkpoints, tmp_path):
    from transformers import AutoTokenizer

    ckpt, cache = tiny_checkpoints["llama"], tmp_path / "cache"
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = tok(PROMPT).input_ids
    reference = tok.decode(_greedy_ids(ckpt, ids, 16), skip_special_tokens=True)
    args = ("--tp", "2", "--cache-dir", str(cache), "--kv-pages", "256", "--api-servers", "1")

    server, first_s = _start(ckpt, *args)
    try:
        assert _complete(server, ids, 16) == reference
        assert len(server.rank_pids()) == 2
    finally:
        first_log = _stop(server)
    [entry] = _entries(cache)
    assert f"preparing {ckpt}" in first_log
    manifest_mtime = (entry / "manifest.pb").stat().st_mtime_ns
    memo_mtime = (cache / "source-digests.json").stat().st_mtime_ns

    server, second_s = _start(ckpt, *args)
    try:
        assert _complete(server, ids, 16) == reference
    finally:
        second_log = _stop(server)
    assert "preparing" not in second_log and f"using the package prepared from {ckpt}" in second_log
    assert (entry / "manifest.pb").stat().st_mtime_ns == manifest_mtime
    assert (cache / "source-digests.json").stat().st_mtime_ns == memo_mtime  # nothing rehashed
    assert _entries(cache) == [entry]
    print(f"tiny llama tp2: first start {first_s:.1f} s, second {second_s:.1f} s")

    # An entry without its manifest (a copy cut short) is not used: it is prepared again.
    (entry / "manifest.pb").unlink()
    server, _ = _start(ckpt, *args)
    try:
        assert _complete(server, ids, 16) == reference
    finally:
        third_log = _stop(server)
    assert f"preparing {ckpt}" in third_log and (entry / "manifest.pb").is_file()


def _signal_while_preparing(
    source: Path, cache: Path, sig: signal.Signals, *args: str
) -> tuple[list[Path], int, str, int]:
    """Start `orbit serve SOURCE` in a session of its own and send its process group `sig` once
    its prepare has begun writing; return the partial directories there then, its exit status,
    its output (which ends once every process of the group has closed it) and the group's id."""
    cmd = [sys.executable, "-m", "orbit", "serve", str(source), "--cache-dir", str(cache), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=default_sigint,  # noqa: PLW1509 - the SIGINT case must reach its Python
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            partial = list((cache / "packages").glob(".*.partial-*"))
            if partial:
                os.killpg(proc.pid, sig)
                out, _ = proc.communicate(timeout=120)
                return partial, proc.returncode, out.decode(), proc.pid
            time.sleep(0.05)
        raise AssertionError("orbit serve never began preparing")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_while_preparing_ends_the_prepare_and_leaves_nothing(smollm2_path, tmp_path):
    """The prepare runs in a child process: Ctrl-C (SIGINT to the terminal's process group)
    ends both, with one line and status 130, and the cache keeps no partial entry."""
    cache = tmp_path / "cache"
    args = (*SMOL_FLAGS, "--port", str(free_port()))
    partial, status, out, group = _signal_while_preparing(smollm2_path, cache, signal.SIGINT, *args)
    assert status == 130, out
    assert "error: interrupted; the cache holds nothing half-written." in out, out
    assert "Traceback" not in out, out
    assert not any(p.exists() for p in partial) and _entries(cache) == []
    # The prepare's process goes with the server: it may still be exiting (its output closed,
    # its command line already gone) as the server's status comes back.
    deadline = time.monotonic() + 10
    while live_in_group(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_in_group(group) == []


def test_gguf_served_with_one_command_after_an_interrupted_prepare(smollm2_path, tmp_path):
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    args = (*SMOL_FLAGS, "--dtype", "bfloat16", "--kv-cache-mb", "64", "--api-servers", "1")
    partial, *_ = _signal_while_preparing(
        smollm2_path, cache, signal.SIGKILL, *args, "--port", str(free_port())
    )
    assert all(p.exists() for p in partial) and not _entries(cache)

    server, first_s = _start(smollm2_path, "--cache-dir", str(cache), *args, timeout_s=600)
    try:
        tok = AutoTokenizer.from_pretrained(str(server_package(cache) / "tokenizer"))
        ids = tok(PROMPT).input_ids
        text = _complete(server, ids, 8)
    finally:
        first_log = _stop(server)
    assert f"preparing {smollm2_path}" in first_log
    # The prepare ran in a child process, so the serving process exits as quietly after a first
    # start as after any other (when it prepared itself, the nanobind bindings that
    # transformers' GGUF reader pulls in through scipy reported leaks, 27 lines, at its exit).
    assert "leaked" not in first_log, first_log[-3000:]
    assert not any(p.exists() for p in partial), "the interrupted prepare's leftovers stayed"
    [entry] = _entries(cache)
    manifest_mtime = (entry / "manifest.pb").stat().st_mtime_ns

    server, second_s = _start(smollm2_path, "--cache-dir", str(cache), *args)
    try:
        assert _complete(server, ids, 8) == text
    finally:
        second_log = _stop(server)
    assert "preparing" not in second_log
    assert f"using the package prepared from {smollm2_path}" in second_log
    assert (entry / "manifest.pb").stat().st_mtime_ns == manifest_mtime
    assert second_s < first_s
    print(f"SmolLM2 GGUF bf16: first start {first_s:.1f} s, second {second_s:.1f} s")

    # The bfloat16 package (the default model's dtype) greedily says what float32 transformers
    # says for the first 8 tokens of this prompt.
    reference = _greedy_ids(smollm2_path.parent, ids, 8, gguf=smollm2_path.name)
    assert text == tok.decode(reference, skip_special_tokens=True)


def server_package(cache: Path) -> Path:
    [entry] = _entries(cache)
    return entry
