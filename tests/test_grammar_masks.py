"""The rank side of structured outputs (runtime/grammar.py through ranks/steps.py) on the CPU
reference path, with the real SmolLM2-135M: constrained sequences decoded one step ahead (the
way the core drives ranks) produce JSON that validates against their schemas and end with an
EOS, an unconstrained neighbour is untouched, and a constrained sequence recomputed after a
preemption continues exactly where it was."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from proto import wire_pb2
from ranks.steps import StepExecutor
from runtime.grammar import GrammarError, GrammarMasks
from runtime.package import open_package
from runtime.sampling import sample
from tests.tp_harness import load_runner, result_samples

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
]
PAGES_PER_SEQ = 8


@pytest.fixture(scope="module")
def smol_pkg(smollm2_path, package_cache):
    return package_cache(smollm2_path, 1, max_seq_len=512, max_batch=8, max_step_tokens=64)


@pytest.fixture(scope="module")
def prompt_ids(smol_pkg) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(open_package(smol_pkg).tokenizer_dir))
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def executor(smol_pkg) -> tuple[StepExecutor, object]:
    runner, pkg = load_runner(smol_pkg, rank=0, num_pages=4 * PAGES_PER_SEQ)
    masks = GrammarMasks(
        pkg.tokenizer_dir,
        list(pkg.manifest.tokenizer.eos_token_ids),
        pkg.spec.padded_vocab_size,
        pkg.capacities.max_batch,
        torch.device("cpu"),
    )
    return StepExecutor(runner, 0, torch.device("cpu"), sample, None, 8, masks), pkg


def _sampling(schema: dict | None, seed: int, prompt_len: int) -> wire_pb2.SamplingParams:
    p = wire_pb2.SamplingParams(temperature=0.7, top_p=0.95, seed=seed, num_logprobs=-1)
    if schema is not None:
        p.grammar.json_schema = json.dumps(schema)
        p.grammar.num_prompt_tokens = prompt_len
    return p


def _join(plan, seq_id: int, sampling, tokens: list[int], page_size: int) -> None:
    pages = [PAGES_PER_SEQ * (seq_id - 1) + i for i in range(PAGES_PER_SEQ)]
    plan.new_seqs.append(wire_pb2.NewSequence(seq_id=seq_id, sampling=sampling))
    plan.seqs.append(
        wire_pb2.SeqStep(seq_id=seq_id, token_ids=tokens, start_pos=0, new_pages=pages, sample=True)
    )


def _decode(executor, plans_first, seq_lens: dict[int, int], eos: set[int], max_new: int):
    """Run the first plan, then follows_sample decode steps launched one step ahead until every
    sequence sampled an EOS or max_new tokens. Returns seq_id -> generated ids."""
    out: dict[int, list[int]] = {s: [] for s in seq_lens}
    done: set[int] = set()
    previous, step_id = executor.launch(plans_first, None), plans_first.step_id
    for _ in range(max_new):
        live = [s for s in seq_lens if s not in done]
        plan = wire_pb2.StepPlan(step_id=step_id + 1)
        for s in live:
            pos = seq_lens[s] + len(out[s])
            plan.seqs.append(
                wire_pb2.SeqStep(seq_id=s, start_pos=pos, sample=True, follows_sample=True)
            )
        step_id += 1
        launched = executor.launch(plan, previous) if live else None
        for sample_ in result_samples(executor.finish(previous)):
            assert not sample_.error
            if sample_.seq_id not in done:
                out[sample_.seq_id].append(sample_.token_id)
                if sample_.token_id in eos:
                    done.add(sample_.seq_id)
        previous = launched
        if previous is None:
            break
    if previous is not None:
        executor.finish(previous)
    return out


def test_constrained_rows_validate_and_end_with_eos(executor, prompt_ids):
    executor, pkg = executor
    eos = set(pkg.manifest.tokenizer.eos_token_ids)
    first = wire_pb2.StepPlan(step_id=1)
    n = len(prompt_ids)
    _join(first, 1, _sampling(SCHEMAS[0], 1, n), prompt_ids, pkg.capacities.kv_page_size)
    _join(first, 2, _sampling(SCHEMAS[1], 2, n), prompt_ids, pkg.capacities.kv_page_size)
    _join(first, 3, _sampling(None, 3, n), prompt_ids, pkg.capacities.kv_page_size)
    out = _decode(executor, first, {1: n, 2: n, 3: n}, eos, max_new=40)
    executor.launch(wire_pb2.StepPlan(step_id=1000, release_seq_ids=[1, 2, 3]), None)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    for seq_id, schema in ((1, SCHEMAS[0]), (2, SCHEMAS[1])):
        tokens = out[seq_id]
        assert tokens[-1] in eos, tok.decode(tokens)
        jsonschema.validate(json.loads(tok.decode(tokens[:-1])), schema)
    with pytest.raises(ValueError):  # free text: what a 135M model says is not a JSON value
        json.loads(tok.decode(out[3]))


def test_a_recomputed_sequence_continues_its_grammar(executor, prompt_ids):
    """Greedy: a few tokens, release (preemption), re-add with prompt + those tokens as
    prefill; the output equals an uninterrupted run's."""
    executor, pkg = executor
    n = len(prompt_ids)
    params = _sampling(SCHEMAS[1], 0, n)
    params.temperature = 0.0
    eos = set(pkg.manifest.tokenizer.eos_token_ids)
    first = wire_pb2.StepPlan(step_id=1)
    _join(first, 1, params, prompt_ids, pkg.capacities.kv_page_size)
    whole = _decode(executor, first, {1: n}, eos, max_new=30)[1]

    first = wire_pb2.StepPlan(step_id=100, release_seq_ids=[1])
    _join(first, 2, params, prompt_ids, pkg.capacities.kv_page_size)
    head = _decode(executor, first, {2: n}, eos, max_new=4)[2]
    again = wire_pb2.StepPlan(step_id=200, release_seq_ids=[2])
    _join(again, 2, params, prompt_ids + head, pkg.capacities.kv_page_size)
    tail = _decode(executor, again, {2: n + len(head)}, eos, max_new=30)[2]
    assert len(head) == 4 and whole[-1] in eos
    assert head + tail == whole


def test_a_schema_the_rank_cannot_compile_fails_its_sequence_alone(executor, prompt_ids):
    """The compile runs in the background and fails at the sequence's first masked row: that
    sequence's samples carry the reason, its neighbour's are constrained as usual."""
    executor, pkg = executor
    n = len(prompt_ids)
    first = wire_pb2.StepPlan(step_id=1)
    _join(first, 1, _sampling({"type": "frobnicate"}, 1, n), prompt_ids, 0)
    _join(first, 2, _sampling(SCHEMAS[1], 2, n), prompt_ids, 0)
    launched = executor.launch(first, None)
    samples = {s.seq_id: s for s in result_samples(executor.finish(launched))}
    executor.launch(wire_pb2.StepPlan(step_id=2, release_seq_ids=[1, 2]), None)
    assert "grammar: " in samples[1].error and "frobnicate" in samples[1].error
    assert not samples[2].error
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    assert tok.decode([samples[2].token_id]).startswith("{")


def test_masks_filled_by_several_threads_equal_one_by_one(smol_pkg):
    """A step's rows are filled by xgrammar's threads where the host has cores to spare; the
    masks must be those of filling the rows one by one, whatever state each matcher is in."""
    from transformers import AutoTokenizer

    pkg = open_package(smol_pkg)
    tok = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    eos, vocab = list(pkg.manifest.tokenizer.eos_token_ids), pkg.spec.padded_vocab_size
    grammar = wire_pb2.Grammar(json_schema=json.dumps(SCHEMAS[0]), num_prompt_tokens=0)
    prefixes = ['{"name": "Al', '{"name": "Alice", "age": 3', '{"name": "Bo", "age": 7, "pets": [']
    prefixes += ["", '{"', '{"name": "Zed", "age": 120, "pets": ["cat"]}']
    logits = {}
    for threads in (1, 3):
        masks = GrammarMasks(pkg.tokenizer_dir, eos, vocab, 8, torch.device("cpu"), threads)
        rows = [masks.start(grammar) for _ in prefixes]
        for row, text in zip(rows, prefixes):
            for pos, token_id in enumerate(tok(text, add_special_tokens=False).input_ids):
                row.accept(token_id, pos)
        logits[threads] = torch.zeros(len(rows) + 1, vocab)
        masks.mask(logits[threads], [*rows, None])  # and an unconstrained row
    allowed = torch.isfinite(logits[1])
    assert torch.equal(allowed, torch.isfinite(logits[3]))
    assert allowed[-1].all() and not allowed[:-1].all(dim=1).any()


def test_the_compiler_built_beside_start_up_and_a_failed_build_left_to_the_first_grammar(
    smol_pkg, tmp_path, caplog
):
    """A rank builds its grammar compiler in a thread that it joins before Ready (a thread left
    running after Ready took the interpreter from the step loop). A build that fails there is
    logged, and the first grammar raises its reason."""
    pkg = open_package(smol_pkg)
    eos, vocab = list(pkg.manifest.tokenizer.eos_token_ids), pkg.spec.padded_vocab_size
    masks = GrammarMasks(pkg.tokenizer_dir, eos, vocab, 8, torch.device("cpu"))
    masks.warm_async().join()
    assert masks._compiler is not None
    grammar = wire_pb2.Grammar(json_schema=json.dumps(SCHEMAS[1]), num_prompt_tokens=3)
    assert masks.start(grammar).compiled.result(timeout=60) is not None

    broken = GrammarMasks(tmp_path / "no-tokenizer", eos, vocab, 8, torch.device("cpu"))
    with caplog.at_level("WARNING", logger="runtime.grammar"):
        broken.warm_async().join()
    assert "building the grammar compiler failed" in caplog.text
    with pytest.raises(GrammarError):
        broken.start(grammar).compiled.result(timeout=60)
