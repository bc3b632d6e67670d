"""benchmarks.serving_sweep against a real tiny `orbit serve` on the CPU: its report adds up."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks import serving_sweep
from benchmarks.serving_sweep import RequestRecord, itl_samples_s, percentiles_ms
from tests.server import ServerProcess

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_package(tiny_checkpoints, package_cache):
    return package_cache(
        tiny_checkpoints["llama"], 1, max_batch=8, kv_page_size=8, max_step_tokens=64
    )


@pytest.fixture(scope="module")
def tiny_server(tiny_package):
    with ServerProcess(tiny_package, "--kv-pages", "256") as server:
        yield server


def test_sweep_report_adds_up(tiny_server, tmp_path):
    out = tmp_path / "sweep.json"
    args = ["--url", tiny_server.url, "--server-pid", str(tiny_server.proc.pid)]
    args += ["--concurrency", "1,4", "--prompt-tokens", "16", "--new-tokens", str(NEW_TOKENS)]
    args += ["--client-procs", "1", "--gpu-busy", "off", "--ttft-prompt-tokens", "32"]
    report = serving_sweep.main(args + ["--out", str(out)])

    assert json.loads(out.read_text()) == report
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert level["requests"] == 2 * level["concurrency"]
        assert level["failures"] == 0, level["first_errors"]
        assert level["output_tokens"] == level["requests"] * NEW_TOKENS
        assert level["output_tokens_per_s"] > 0 and level["requests_per_s"] > 0
        assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"]
        assert 0 < level["itl_ms"]["p50"] <= level["itl_ms"]["p90"] <= level["itl_ms"]["p99"]
        assert level["tokens_per_chunk"] >= 1
        # the core's steps in the level: each request's prompt (16 tokens, fewer where the
        # prefix cache served some) and a decode row for each output token but its last
        assert level["steps"] >= NEW_TOKENS
        assert level["cached_prompt_tokens"] == 0  # no level repeats an earlier one's prompts
        computed = level["steps"] * level["tokens_per_step"]
        n = level["requests"]
        assert n * (NEW_TOKENS - 1) - 1 <= computed <= n * (16 + NEW_TOKENS) + 1
        # the steps that computed prompts, those of decode rows alone (a row per stream at
        # most), and the rest, which only released sequences
        n_prompt, n_decode = level["prompt_steps"], level["decode_steps"]
        assert 1 <= n_prompt <= 2 * n  # a 16-token prompt is one chunk, or two where cut short
        assert n_prompt + n_decode <= level["steps"]
        assert 1 <= level["tokens_per_decode_step"] <= level["concurrency"]
        split = (
            n_prompt * level["tokens_per_prompt_step"] + n_decode * level["tokens_per_decode_step"]
        )
        # both sides count the same tokens; each mean is rounded to 0.1 (half of it either
        # way), times its step count
        rounding = 0.05 * (level["steps"] + n_prompt + n_decode) + 1e-6
        assert split == pytest.approx(computed, abs=rounding)
        # the share of the prompt steps' graph buckets that a GPU would pad (16, 32 or 64
        # tokens here; tests/test_step_counters.py checks the buckets step by step)
        assert 0 <= level["prompt_step_padding_frac"] < 1
        assert "gpu_ms_per_step" not in level  # rank 0's GPU time: none on the CPU
        # the API servers' view of TTFT: the core's queue and prefill are parts of it, and it
        # is part of the client's (measured from before the client sent the request)
        server = level["server_ttft_mean_ms"]
        assert 0 < server["queue"] + server["prefill"] <= server["ttft"] <= level["ttft_mean_ms"]
        assert 0 < level["client_busy_frac"] <= 1.05
        cpu = level["frontend_cpu"]
        # /proc counts CPU time in 10 ms ticks, and a level of a few dozen tokens may see none
        assert cpu["us_per_token"] >= 0 and cpu["cpu_s"] >= 0
        roles = {p["role"] for p in cpu["processes"]}
        assert "core" in roles and not any("-m ranks" in p["cmd"] for p in cpu["processes"])
        by_role = sum(cpu["us_per_token_by_role"].values())
        assert by_role == pytest.approx(cpu["us_per_token"], abs=0.01)
    # the core's steps over both levels take whole ticks of its CPU time
    assert sum(level["frontend_cpu"]["cpu_s"] for level in report["levels"]) > 0
    probe = report["ttft_probe"]
    assert probe["failures"] == 0
    for key in ("ttft_ms", "openai_client_ttft_ms", "openai_client_text_ttft_ms"):
        assert 0 < probe[key]["p50"] <= probe[key]["p99"]


def test_in_process_reference_repeats_no_prompt(tiny_package):
    """The in-process reference submits the sweep's requests level by level, and no level's
    prompts are an earlier level's, which the prefix cache would serve (they were until
    2026-12-07, so its second level computed a quarter fewer tokens than HTTP's)."""
    from benchmarks.step_overhead import in_process_levels

    figures = asyncio.run(in_process_levels(tiny_package, "cpu", 1, 16, 4, [1, 2]))
    assert list(figures) == [1, 2]
    for level, f in figures.items():
        assert f["tokens_per_s"] > 0
        assert f["cached_prompt_tokens"] == 0, level
        # every prompt computed: 2 x level requests of 16 tokens, and a decode row for each
        # output token but its last
        computed = f["steps"] * f["tokens_per_step"]
        n = 2 * level
        assert computed == pytest.approx(n * (16 + 4 - 1), abs=0.05 * f["steps"] + 1e-6)


def test_exact_text_has_exactly_the_tokens_asked(tiny_server):
    """The TTFT probe's text prompts, counted by the package's tokenizer (not the server's
    /tokenize, which built them): exactly the length asked, and no two alike."""
    from transformers import AutoTokenizer

    from runtime.package import open_package

    tokenizer = AutoTokenizer.from_pretrained(str(open_package(tiny_server.package).tokenizer_dir))
    model = httpx.get(f"{tiny_server.url}/v1/models").json()["data"][0]["id"]
    job = serving_sweep.ClientJob(
        url=tiny_server.url, api_key="unused", model=model, prompt_tokens=0, new_tokens=1,
        temperature=0.0, logprobs=False, vocab_size=0, timeout_s=30.0,
    )  # fmt: skip
    texts = [serving_sweep.exact_text(job, n, salt) for salt, n in enumerate((1, 7, 100, 100))]
    assert [len(tokenizer(t).input_ids) for t in texts] == [1, 7, 100, 100]
    assert texts[2] != texts[3]


def test_chunk_tokens_exact_where_said_else_spread():
    record = RequestRecord(sent_s=0.0, times_s=[1.0, 2.0, 4.0, 5.0])
    record.chunk_tokens = [None, 3, None, None]
    record.usage_tokens = 8  # 5 tokens left for 3 chunks that did not say: 1, 2, 2
    assert record.resolved_chunk_tokens() == [1, 3, 2, 2]
    # After the first chunk each token counts once: its chunk's gap over the chunk's tokens.
    assert itl_samples_s(record.times_s, [1, 3, 2, 2]) == [1 / 3] * 3 + [1.0] * 2 + [0.5] * 2


def test_percentiles_nearest_rank():
    values_s = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentiles_ms(values_s) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles_ms([]) == {"p50": None, "p90": None, "p99": None}
