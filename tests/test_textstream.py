"""Property tests of TextStream and TokenTexts against the real SmolLM2 tokenizer (byte-level BPE,
so multi-byte characters really do split across tokens)."""

import random

import pytest
from transformers import AutoTokenizer

from orbit.textstream import TextStream, TokenTexts

PARTIAL = "\ufffd"
TEXTS = [
    "héllo wörld 日本語 🚀",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # double\n\n\nprint(f(21))",
    "  leading and trailing spaces  \t tabs\t\n",
    "🚀🚀🚀 日本語日本語 naïve café façade",
    "Emoji families 👩‍👩‍👧 and flags 🇯🇵 and combining e\u0301 marks",
    "مرحبا بالعالم — Привет, мир — γειά σου κόσμε",
    "aaaaaaaaab aab aaab abab ababab",
    "END END. The END. <END> [END]",
    "数学: ∑ᵢ xᵢ² ≤ ∞; math ≠ easy ≈ fun",
]
# Pieces of random texts: repeats make near-miss stop strings likely.
PIECES = ["the", " ", "é", "日本", "語", "🚀", "\n", "ab", "a", "ö", "👩‍👧", ".", "END", "  "]


def random_texts(rng: random.Random, count: int) -> list[str]:
    return ["".join(rng.choices(PIECES, k=rng.randint(3, 25))) for _ in range(count)]


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_stream(tokenizer, ids: list[int], stop=()) -> tuple[list[str], int | None, str]:
    """Feed ids until the stream stops. Returns the pieces, how many ids were consumed when a
    stop string matched (None if none did) and the text flushed by finish()."""
    stream = TextStream(tokenizer, stop)
    pieces = []
    for k, token_id in enumerate(ids, start=1):
        pieces.append(stream.feed(token_id))
        if stream.stopped:
            return pieces, k, stream.finish()
    return pieces, None, stream.finish()


def expected_output(tokenizer, ids: list[int], stop) -> tuple[str, int | None]:
    """Brute force: the first token count whose text holds a stop string, and that text cut
    before its leftmost stop-string occurrence."""
    for k in range(1, len(ids) + 1):
        text = decode(tokenizer, ids[:k])
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], k
    return decode(tokenizer, ids), None


def longest_stop_prefix_suffix(text: str, stop) -> int:
    return max(
        (n for n in range(len(text) + 1) if any(s.startswith(text[len(text) - n :]) for s in stop)),
        default=0,
    )


def random_stops(rng: random.Random, text: str) -> list[str]:
    """Stop strings that occur (substrings), that almost occur, and that do not occur at all."""
    stops = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.6 and len(text) > 1:
            start = rng.randrange(len(text) - 1)
            stops.append(text[start : start + rng.randint(1, 8)])
        elif kind < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 4)] + "\x00never")
        else:
            stops.append(rng.choice(["zzz", "日本人", "🚀🚀🚀🚀", "\n\n\n\n"]))
    return [s for s in stops if s]


@pytest.mark.parametrize("text", TEXTS)
def test_without_stop_strings_output_equals_decode_and_never_holds_whole_chars(tokenizer, text):
    ids = encode(tokenizer, text)
    stream = TextStream(tokenizer)
    released = ""
    for k, token_id in enumerate(ids, start=1):
        piece = stream.feed(token_id)
        assert PARTIAL not in piece
        released += piece
        # Only the bytes of a character that is not complete yet may be held back.
        assert released == decode(tokenizer, ids[:k]).rstrip(PARTIAL)
    released += stream.finish()
    assert released == decode(tokenizer, ids) == text


def test_multibyte_characters_really_split_across_tokens(tokenizer):
    # Guards the premise of the tests above: some token here decodes to a partial character.
    ids = encode(tokenizer, "日本語 🚀")
    assert any(decode(tokenizer, [i]) == PARTIAL for i in ids)


@pytest.mark.parametrize("seed", range(12))
def test_random_stop_strings_match_brute_force(tokenizer, seed):
    rng = random.Random(seed)
    for text in TEXTS + random_texts(rng, 20):
        ids = encode(tokenizer, text)
        stop = random_stops(rng, text)
        pieces, consumed, flushed = run_stream(tokenizer, ids, stop)
        want_text, want_consumed = expected_output(tokenizer, ids, stop)
        assert "".join(pieces) + flushed == want_text, (text, stop)
        assert consumed == want_consumed, (text, stop)


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_split_across_tokens(tokenizer, text):
    """Every window spanning two or three token boundaries, used as the stop string."""
    ids = encode(tokenizer, text)
    cuts = [len(decode(tokenizer, ids[:k])) for k in range(1, len(ids))]
    spanning = [
        text[a - 1 : b + 1]
        for a, b in zip(cuts, cuts[2:])
        if PARTIAL not in text[a - 1 : b + 1] and 0 < a <= b < len(text)
    ]
    assert spanning
    for stop in spanning:
        pieces, consumed, flushed = run_stream(tokenizer, ids, [stop])
        want_text, want_consumed = expected_output(tokenizer, ids, [stop])
        assert "".join(pieces) == want_text == text[: text.find(stop)]
        assert consumed == want_consumed and flushed == ""


@pytest.mark.parametrize("seed", range(6))
def test_holds_back_only_a_possible_stop_string_start(tokenizer, seed):
    rng = random.Random(1000 + seed)
    for text in TEXTS + random_texts(rng, 20):
        ids = encode(tokenizer, text)
        stop = random_stops(rng, text)
        stream = TextStream(tokenizer, stop)
        released = ""
        for k, token_id in enumerate(ids, start=1):
            released += stream.feed(token_id)
            if stream.stopped:
                break
            decoded = decode(tokenizer, ids[:k]).rstrip(PARTIAL)
            held = longest_stop_prefix_suffix(decoded, stop)
            assert released == decoded[: len(decoded) - held], (text, stop, k)
            assert stream.text == released


def test_finish_flushes_held_text_when_no_stop_matched(tokenizer):
    ids = encode(tokenizer, "hello wor")
    pieces, consumed, flushed = run_stream(tokenizer, ids, ["world"])
    assert consumed is None
    assert "".join(pieces) == "hello "
    assert flushed == "wor"


def test_stop_string_is_never_released_and_stops_the_stream(tokenizer):
    ids = encode(tokenizer, "one two three four")
    stream = TextStream(tokenizer, ["three"])
    out = ""
    for token_id in ids:
        out += stream.feed(token_id)
    assert out == "one two " and stream.stopped
    assert stream.feed(ids[0]) == "" and stream.finish() == ""


def test_leftmost_occurrence_wins_among_stop_strings(tokenizer):
    ids = encode(tokenizer, "alpha beta gamma")
    pieces, _, _ = run_stream(tokenizer, ids, ["gamma", "beta", "ta ga"])
    assert "".join(pieces) == "alpha "


def test_stop_at_the_very_start_releases_nothing(tokenizer):
    ids = encode(tokenizer, "Stop here")
    pieces, consumed, _ = run_stream(tokenizer, ids, ["Stop"])
    assert pieces == [""] and consumed == 1


def test_multibyte_stop_string(tokenizer):
    text = "héllo wörld 日本語 🚀 done"
    ids = encode(tokenizer, text)
    for stop in ["本", "語 🚀", "🚀", "ö"]:
        pieces, consumed, _ = run_stream(tokenizer, ids, [stop])
        assert "".join(pieces) == text[: text.find(stop)]
        assert consumed is not None


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "before") + [eos] + encode(tokenizer, " after 日本")
    pieces, _, flushed = run_stream(tokenizer, ids)
    assert "".join(pieces) + flushed == "before after 日本" == decode(tokenizer, ids)


def test_incomplete_character_at_the_end_is_flushed_as_decode_does(tokenizer):
    ids = encode(tokenizer, "ok 日本語")[:-1]  # drop the token that completes the last character
    pieces, _, flushed = run_stream(tokenizer, ids)
    assert PARTIAL not in "".join(pieces)
    assert "".join(pieces) + flushed == decode(tokenizer, ids)
    assert flushed.endswith(PARTIAL)


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError):
        TextStream(tokenizer, ["x", ""])


def test_token_bytes_reassemble_the_text(tokenizer):
    texts = TokenTexts(tokenizer)
    for text in TEXTS:
        ids = encode(tokenizer, text)
        assert b"".join(bytes(texts.bytes_of(i)) for i in ids) == text.encode("utf-8")


def test_token_text_marks_partial_characters_as_bytes(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = encode(tokenizer, "日本語")
    partial = [i for i in ids if decode(tokenizer, [i]) == PARTIAL]
    assert partial
    for token_id in partial:
        raw = bytes(texts.bytes_of(token_id))
        assert texts.text_of(token_id) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    assert texts.text_of(encode(tokenizer, "hello")[0]) == "hello"
    assert texts.text_of(tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
