"""The draft proposer on rank 0 (ranks/drafting.py) over a real tiny Llama on the CPU path: with
the served model as its own draft, every proposal is the token greedy one-token steps would
draw, after prefill, after verifications that keep all, some or none of the proposals (the
draft's KV of its own proposals reused or computed again), and for two sequences in one step;
a draft package that cannot propose for the served one is refused naming why."""

from __future__ import annotations

import pytest
import torch

from proto import wire_pb2
from ranks.drafting import Drafter
from ranks.steps import StepExecutor
from runtime.package import check_draft, open_package
from runtime.sampling import sample
from tests.tp_harness import load_runner, result_samples

GREEDY = wire_pb2.SamplingParams(temperature=0.0, num_logprobs=-1)
PROMPTS = [[5, 9, 13, 2, 7, 40, 41], [3, 3, 8]]
PAGES = 16  # per sequence, so the draft's pages beyond each row are always there


def _executor(package, drafts: bool) -> StepExecutor:
    runner, _ = load_runner(package, rank=0, num_pages=2 * PAGES)
    drafter = None
    if drafts:
        draft_runner, _ = load_runner(package, rank=0, num_pages=2 * PAGES)
        vocab = open_package(package).spec.vocab_size
        drafter = Drafter(draft_runner, vocab, max_batch=4, max_step_tokens=4)
    return StepExecutor(runner, 0, torch.device("cpu"), sample, None, 4, drafter=drafter)


def _greedy(package, prompt: list[int], n: int) -> list[int]:
    """The first n greedy tokens after prompt, from one-token steps."""
    ex = _executor(package, drafts=False)
    plan = wire_pb2.StepPlan(step_id=1)
    plan.new_seqs.add(seq_id=1, sampling=GREEDY)
    plan.seqs.add(seq_id=1, token_ids=prompt, start_pos=0, new_pages=range(PAGES), sample=True)
    out = [result_samples(ex.finish(ex.launch(plan, None)))[0].token_id]
    while len(out) < n:
        plan = wire_pb2.StepPlan(step_id=len(out) + 1)
        plan.seqs.add(
            seq_id=1, token_ids=out[-1:], start_pos=len(prompt) + len(out) - 1, sample=True
        )
        out.append(result_samples(ex.finish(ex.launch(plan, None)))[0].token_id)
    return out


def test_a_draft_of_the_served_model_proposes_its_greedy_tokens(tiny_checkpoints, package_cache):
    package = package_cache(tiny_checkpoints["llama"], 1)
    truth = [_greedy(package, p, 24) for p in PROMPTS]
    assert len(set(truth[0])) > 5  # the model does not repeat one token
    ex = _executor(package, drafts=True)
    # both prompts in one step (the draft's step budget of 4 takes the first in two parts)
    plan = wire_pb2.StepPlan(step_id=1)
    for i, prompt in enumerate(PROMPTS):
        plan.new_seqs.add(seq_id=i + 1, sampling=GREEDY)
        plan.seqs.add(
            seq_id=i + 1, token_ids=prompt, start_pos=0, sample=True, draft_tokens=3,
            new_pages=range(i * PAGES, (i + 1) * PAGES),
        )  # fmt: skip
    result = ex.finish(ex.launch(plan, None))
    known = [[s.token_id] for s in result_samples(result)]
    for i, s in enumerate(result_samples(result)):
        assert known[i] == truth[i][:1]
        assert list(s.proposals) == truth[i][1:4]
    proposals = [list(s.proposals) for s in result_samples(result)]
    # Sequence 1 keeps all, then a wrong proposal in the middle, then all wrong; sequence 2
    # keeps all, then decodes without proposals, then verifies again.
    edits = [
        [lambda p: p, lambda p: p[:1] + [p[1] + 1] + p[2:], lambda p: [t + 1 for t in p]],
        [lambda p: p, lambda p: [], lambda p: p],
    ]
    for step in range(3):
        plan = wire_pb2.StepPlan(step_id=step + 2)
        rows = []
        for i, prompt in enumerate(PROMPTS):
            sent = edits[i][step](proposals[i])
            start = len(prompt) + len(known[i]) - 1
            plan.seqs.add(
                seq_id=i + 1, token_ids=known[i][-1:] + sent, start_pos=start, sample=True,
                num_samples=len(sent) + 1 if sent else 0, draft_tokens=3,
            )  # fmt: skip
            rows.append(len(sent) + 1)
        samples = result_samples(ex.finish(ex.launch(plan, None)))
        for i, n in enumerate(rows):
            mine, samples = samples[:n], samples[n:]
            drawn = [s.token_id for s in mine]
            sent = edits[i][step](proposals[i])
            kept = 0
            while kept < len(sent) and sent[kept] == drawn[kept]:
                kept += 1
            assert drawn[: kept + 1] == truth[i][len(known[i]) : len(known[i]) + kept + 1]
            known[i] += drawn[: kept + 1]
            proposals[i] = list(mine[-1].proposals)
            assert proposals[i] == truth[i][len(known[i]) : len(known[i]) + 3], (step, i)
    assert len(known[0]) == 1 + 4 + 2 + 1  # all kept, one kept, none kept


def test_a_draft_that_cannot_propose_is_refused(tiny_checkpoints, package_cache):
    served = open_package(package_cache(tiny_checkpoints["llama"], 1, kv_page_size=4))
    checks = [
        ({"tp": 2}, "prepare it with --tp 1"),
        ({"kv_page_size": 8}, "prepare it with --page-size 4"),
        ({"max_batch": 2, "kv_page_size": 4}, "--max-batch"),
    ]
    for opts, fix in checks:
        draft = open_package(package_cache(tiny_checkpoints["llama"], opts.pop("tp", 1), **opts))
        with pytest.raises(ValueError, match=fix):
            check_draft(served, draft)
    other_tokenizer = open_package(package_cache(tiny_checkpoints["qwen2"], 1, kv_page_size=4))
    with pytest.raises(ValueError, match="tokenizer.json differs"):
        check_draft(served, other_tokenizer)
    check_draft(served, served)  # itself: nothing to refuse


def test_orbit_up_passes_the_draft_to_rank_0_alone():
    """`orbit up --draft`: rank 0's command line names the pushed draft, and the draft's digest
    is part of the launch fingerprint (a running cluster without it is restarted, not reused);
    no draft adds nothing, so clusters brought up before the flag keep their fingerprint."""
    from orbit.cluster.config import parse_cluster_config
    from orbit.cluster.up import UpOptions, launch_fingerprint
    from ranks.config import RankConfig
    from tests.rank_argv import cluster_rank_argv

    def argv(rank: int, draft_dir: str) -> list[str]:
        return cluster_rank_argv(rank, tp=2, draft_dir=draft_dir)

    assert RankConfig.from_argv(argv(0, "/w/packages/e")[3:]).draft_package == "/w/packages/e"
    assert "--draft-package" not in argv(0, "")
    config = parse_cluster_config('package = "pkg"\n\n[[hosts]]\naddress = "gpu-a"\n')

    class Draft:
        digest = "e" * 64

    default = launch_fingerprint(config, UpOptions())
    assert launch_fingerprint(config, UpOptions(), (), None) == default
    assert launch_fingerprint(config, UpOptions(), (), Draft()) != default
