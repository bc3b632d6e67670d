"""The API server's schema check (orbit/http/schema_check.py) with its real child process and
the SmolLM2 tokenizer: a schema xgrammar refuses is refused with its reason, one whose compile
runs over the time limit is refused at the limit (the child killed and replaced), one whose
compiled grammar is over the size limit is refused, and an answer once given is remembered."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from orbit.http.schema_check import SchemaChecker, SchemaTooCostly
from runtime.grammar import GrammarError

# 30 bytes of pattern, 11 s of compile on a 2-core test machine (the 49k-token vocabulary).
SLOW_SCHEMA = json.dumps({"type": "string", "pattern": "^(.{1,30}x){1,40}$"})
SMALL_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
TIMEOUT_S = 1.0
# Killing the child and answering; generous for a loaded machine, far below the compile's 11 s.
SLACK_S = 2.0


@pytest.fixture(scope="module")
def checker(tokenizer_dir) -> SchemaChecker:
    checker = SchemaChecker(AutoTokenizer.from_pretrained(str(tokenizer_dir)), TIMEOUT_S)
    checker.check(SMALL_SCHEMA)  # the child started: the timings below are the compiles'
    return checker


def _timed(checker: SchemaChecker, schema: str) -> tuple[Exception | None, float]:
    started = time.monotonic()
    try:
        checker.check(schema)
    except GrammarError as e:
        return e, time.monotonic() - started
    return None, time.monotonic() - started


def test_an_unsupported_schema_is_refused_with_xgrammar_s_reason(checker):
    error, _ = _timed(checker, json.dumps({"type": "frobnicate"}))
    assert type(error) is GrammarError
    assert str(error) == 'Unsupported type "frobnicate"'


def test_a_slow_schema_is_refused_at_the_time_limit_and_the_next_one_compiles(checker):
    error, took_s = _timed(checker, SLOW_SCHEMA)
    assert isinstance(error, SchemaTooCostly)
    assert f"did not compile within {TIMEOUT_S:g} s" in str(error)
    assert TIMEOUT_S <= took_s < TIMEOUT_S + SLACK_S
    other = json.dumps({"type": "array", "items": {"type": "boolean"}})
    assert _timed(checker, other)[0] is None  # a fresh child, started after the kill


def test_a_refusal_for_time_is_not_remembered(checker):
    """The same schema may compile in time on a less busy host: each try compiles again."""
    for _ in range(2):
        error, took_s = _timed(checker, SLOW_SCHEMA)
        assert isinstance(error, SchemaTooCostly) and took_s >= TIMEOUT_S


def test_answers_are_remembered(checker):
    bad = json.dumps({"type": "object", "properties": {"x": {"type": "frobnicate"}}})
    for schema in (SMALL_SCHEMA, bad):
        _timed(checker, schema)
    checker._child.kill()  # a remembered answer does not ask the child
    checker._child.wait()
    assert _timed(checker, SMALL_SCHEMA)[0] is None
    assert "frobnicate" in str(_timed(checker, bad)[0])


def test_a_grammar_over_the_size_limit_is_refused(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    checker = SchemaChecker(tokenizer, TIMEOUT_S + 60, max_grammar_bytes=1000)
    error, _ = _timed(checker, SMALL_SCHEMA)
    assert isinstance(error, SchemaTooCostly)
    assert "over the limit of 1,000" in str(error)
