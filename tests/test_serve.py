"""`orbit serve` end to end on CPU: real rank processes, real sockets, the official openai
client, and transformers as the reference."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal

import httpx
import openai
import pytest
import torch

from benchmarks.step_overhead import engine_config, local_ranks, running_engine
from orbit.http.core_client import SamplingParams
from proto import core_pb2
from runtime.package import open_package
from tests.server import ServerProcess, left_behind, started_at

GREEDY = dict(temperature=0, max_tokens=24)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def smollm2_pkg(smollm2_path, package_cache):
    return package_cache(smollm2_path, 1, max_seq_len=512, max_batch=8, max_step_tokens=64)


@pytest.fixture(scope="module")
def smol_server(smollm2_pkg):
    with ServerProcess(smollm2_pkg, "--kv-cache-mb", "128") as server:
        yield server


@pytest.fixture(scope="module")
def tiny_tp2_server(tiny_checkpoints, package_cache):
    pkg = package_cache(
        tiny_checkpoints["llama"], 2, max_batch=16, kv_page_size=4, max_step_tokens=32
    )
    with ServerProcess(pkg, "--kv-pages", "512") as server:
        yield server


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _model(server) -> str:
    return _client(server).models.list().data[0].id


def _load_reference(source, gguf=None):
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf} if gguf else {}
    return AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, **kw).eval()


@pytest.fixture(scope="module")
def smol_reference(smollm2_path):
    return _load_reference(smollm2_path.parent, gguf=smollm2_path.name)


def _transformers_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


def _tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(server.package / "tokenizer"))


def test_smollm2_greedy_completions_equal_transformers(smol_server, smol_reference):
    tok = _tokenizer(smol_server)
    client = _client(smol_server)
    for prompt in PROMPTS[:2]:
        ref = _transformers_greedy(smol_reference, tok(prompt).input_ids, 24)
        got = client.completions.create(model=_model(smol_server), prompt=prompt, **GREEDY)
        assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)
        assert got.usage.completion_tokens == len(ref)
        assert got.usage.prompt_tokens == len(tok(prompt).input_ids)


def test_smollm2_chat_equals_transformers(smol_server, smol_reference):
    tok = _tokenizer(smol_server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref = _transformers_greedy(smol_reference, tok(text, add_special_tokens=False).input_ids, 24)
    got = _client(smol_server).chat.completions.create(
        model=_model(smol_server), messages=messages, **GREEDY
    )
    assert got.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert got.choices[0].finish_reason == ("stop" if ref[-1] in tok.all_special_ids else "length")


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_llama_greedy_equals_transformers(tp, tiny_checkpoints, package_cache):
    ckpt = tiny_checkpoints["llama"]
    pkg = package_cache(ckpt, tp, max_batch=16, kv_page_size=4, max_step_tokens=32)
    with ServerProcess(pkg, "--kv-pages", "512") as server:
        tok = _tokenizer(server)
        client = _client(server)
        reference = _load_reference(ckpt)
        for prompt in PROMPTS:
            ids = tok(prompt).input_ids
            ref = _transformers_greedy(reference, ids, 24)
            got = client.completions.create(model=_model(server), prompt=ids, logprobs=0, **GREEDY)
            assert got.usage.completion_tokens == len(ref)
            assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)


def test_stream_concatenates_to_non_streamed_text(smol_server):
    client, model = _client(smol_server), _model(smol_server)
    full = client.completions.create(model=model, prompt=PROMPTS[2], **GREEDY)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPTS[2],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hi"}],
            stream=True,
            **GREEDY,
        )
    )
    chat_full = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi"}],
        **GREEDY,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    assert streamed == chat_full.choices[0].message.content


def _mixed_requests(n: int):
    words = [
        "orbit",
        "serves",
        "large",
        "language",
        "models",
        "across",
        "hosts",
        "with",
        "tensor",
        "parallel",
        "ranks",
    ]
    return [
        (" ".join(words[: 1 + i % len(words)]) * (1 + i % 3), 4 + (i * 7) % 29) for i in range(n)
    ]


def test_concurrent_requests_equal_their_single_outputs(tiny_tp2_server):
    client, model = _client(tiny_tp2_server), _model(tiny_tp2_server)
    reqs = _mixed_requests(32)
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=m, temperature=0)
        .choices[0]
        .text
        for p, m in reqs
    ]

    async def all_at_once():
        aclient = openai.AsyncOpenAI(
            base_url=tiny_tp2_server.url + "/v1", api_key="x", max_retries=0
        )
        outs = await asyncio.gather(
            *(
                aclient.completions.create(model=model, prompt=p, max_tokens=m, temperature=0)
                for p, m in reqs
            )
        )
        return [o.choices[0].text for o in outs]

    assert asyncio.run(all_at_once()) == alone


def _most_in_flight(link) -> asyncio.Future:
    """The most steps the engine had in flight at once, sampled at every turn of its loop
    until cancelled; awaiting it after cancelling gives the figure."""

    async def watch() -> int:
        most = 0
        try:
            while True:
                most = max(most, link.steps_in_flight)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            return most

    return asyncio.ensure_future(watch())


async def _engine_tokens(engine, prompt_ids, params) -> list[tuple[int, int]]:
    outputs = engine.generate(prompt_ids, params.max_tokens, params.wire(), params.ignore_eos)
    return [(out.token_ids[0], out.finish) async for out in outputs]


def test_a_step_ahead_gives_every_request_its_single_request_tokens(
    tiny_checkpoints, package_cache
):
    """TP 2 through the engine: greedy and seeded sampling, all at once with the next step sent
    ahead (ranks feeding their own samples), then with two steps ahead, under KV pressure
    (preemptions while steps are in flight) and with an EOS that is hit mid-stream (wasted
    rows), give each request exactly the tokens it gets alone, one step at a time."""
    pkg = open_package(
        package_cache(
            tiny_checkpoints["llama"], 2, max_batch=16, kv_page_size=4, max_step_tokens=32
        )
    )
    prompts = [[(300 + 17 * i + 101 * j) % 4000 for j in range(5 + 7 * i)] for i in range(8)]
    params = [
        SamplingParams(max_tokens=30 + i, temperature=0.8 * (i % 2), seed=i, logprobs=i % 3 - 1)
        for i in range(8)
    ]

    async def both_ways():
        # 24 pages of 4 tokens hold any one request, not all eight at once.
        async with local_ranks(pkg, "cpu", kv_pages=24) as link:
            # EOS: tokens that requests 0 and 1 draw mid-stream, so both stop early.
            async with running_engine(engine_config(pkg, overlap=False), link) as engine:
                probes = [await _engine_tokens(engine, prompts[i], params[i]) for i in (0, 1)]
                config = dataclasses.replace(
                    engine_config(pkg, overlap=False),
                    eos_token_ids=(probes[0][8][0], probes[1][12][0]),
                )
            async with running_engine(config, link) as engine:
                alone = [await _engine_tokens(engine, *r) for r in zip(prompts, params)]
            runs = []
            for ahead in (0, 1):  # two steps in flight; three from the first running sequence
                config = dataclasses.replace(config, overlap=True, three_ahead_min_running=ahead)
                async with running_engine(config, link) as engine:
                    most = _most_in_flight(link)
                    together = await asyncio.gather(
                        *(_engine_tokens(engine, *r) for r in zip(prompts, params))
                    )
                    most.cancel()
                    runs.append((together, engine.scheduler.num_preemptions, await most))
        return alone, runs

    alone, runs = asyncio.run(both_ways())
    assert [most for _, _, most in runs] == [2, 3]
    for together, preemptions, _ in runs:
        assert together == alone
        assert preemptions > 0
    finish = [t[-1][1] for t in alone]
    assert finish.count(core_pb2.FINISH_STOP) >= 2 and core_pb2.FINISH_LENGTH in finish


def test_kv_exhaustion_preempts_and_loses_nothing(tiny_checkpoints, package_cache):
    pkg = package_cache(
        tiny_checkpoints["qwen3"], 1, max_batch=8, kv_page_size=4, max_step_tokens=32
    )
    reqs = [(p, 40) for p, _ in _mixed_requests(8)]
    with ServerProcess(pkg, "--kv-pages", "512") as roomy:
        model = _model(roomy)
        alone = [
            _client(roomy)
            .completions.create(
                model=model, prompt=p, max_tokens=m, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p, m in reqs
        ]
    # 40 pages of 4 tokens cannot hold eight sequences of up to ~80 tokens at once.
    with ServerProcess(pkg, "--kv-pages", "40") as tight:

        async def all_at_once():
            aclient = openai.AsyncOpenAI(base_url=tight.url + "/v1", api_key="x", max_retries=0)
            outs = await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=model,
                        prompt=p,
                        max_tokens=m,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p, m in reqs
                )
            )
            return [o.choices[0].text for o in outs]

        assert asyncio.run(all_at_once()) == alone
        metrics = tight.metrics()
        assert metrics["orbit_preemptions_total"] > 0
        assert metrics["orbit_kv_pages_in_use"] == 0


def test_seeded_sampling_repeats(smol_server):
    client, model = _client(smol_server), _model(smol_server)
    kw = dict(model=model, prompt=PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=1234, n=2, **kw)
    b = client.completions.create(seed=1234, n=2, **kw)
    c = client.completions.create(seed=4321, n=2, **kw)
    texts = lambda r: [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)


def test_logprobs_are_consistent_with_greedy(smol_server):
    got = _client(smol_server).completions.create(
        model=_model(smol_server), prompt=PROMPTS[0], logprobs=3, **GREEDY
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == got.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy picks the best


def test_bad_requests_get_400_and_server_keeps_serving(smol_server):
    url = smol_server.url + "/v1/completions"
    model = _model(smol_server)
    cases = [
        ("{not json", None),
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": "many"}), "max_tokens"),
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": -1}), "max_tokens"),
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": 10**9}), "max_tokens"),
        (json.dumps({"model": model, "prompt": "hi " * 600, "max_tokens": 4}), "prompt"),
        (json.dumps({"model": model, "prompt": "hi", "temperature": -1}), "temperature"),
        (json.dumps({"model": model, "prompt": "hi", "top_p": 1.5}), "top_p"),
        (json.dumps({"model": model, "prompt": "hi", "top_p": 0}), "top_p"),
    ]
    for body, param in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body[:80], r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param:
            assert err["param"] == param, (body[:80], err)
    r = httpx.post(url, json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    ok = _client(smol_server).completions.create(model=model, prompt="Hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_the_sequence(smol_server):
    before = smol_server.metrics()
    body = {
        "model": _model(smol_server),
        "prompt": PROMPTS[2],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", smol_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert smol_server.metrics()["orbit_running_sequences"] == 1
    for _ in range(100):
        m = smol_server.metrics()
        if m["orbit_running_sequences"] == 0 and m["orbit_kv_pages_in_use"] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert m["orbit_running_sequences"] == 0
    assert m["orbit_kv_pages_in_use"] == 0
    aborted = sum(v for k, v in m.items() if k.startswith("orbit_aborted_requests_total"))
    aborted_before = sum(
        v for k, v in before.items() if k.startswith("orbit_aborted_requests_total")
    )
    assert aborted == aborted_before + 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(sig, tiny_checkpoints, package_cache):
    pkg = package_cache(
        tiny_checkpoints["llama"], 2, max_batch=16, kv_page_size=4, max_step_tokens=32
    )
    server = ServerProcess(pkg, "--kv-pages", "64").__enter__()
    ranks = {pid: started_at(pid) for pid in server.rank_pids()}
    assert len(ranks) == 2
    assert server.stop(sig) == 0
    left = left_behind(ranks)
    if left:  # what serve printed says how far its shutdown got
        said = server.proc.stdout.read().decode(errors="replace")[-3000:]
        pytest.fail(f"still running after orbit serve exited: {left}; it printed:\n{said}")
