"""Property tests of TextStream and TokenTexts against real tokenizers: SmolLM2's (byte-level BPE,
so multi-byte characters really do split across tokens) and tiny ones trained here for the other
decoder families (SentencePiece-style byte fallback, Metaspace, WordPiece), on both decoding
paths: DecodeStream (Rust) and transformers' decode() of a window."""

import json
import random
from itertools import accumulate, pairwise

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from orbit.http import textstream
from orbit.http.textstream import TextStream, TokenTexts, decode_stream_matches

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


# Training text for the tiny tokenizers: ASCII only, so that other characters fall back to bytes
# (or <unk>), as rare characters do in real vocabularies.
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # double\n\nprint(f(21))",
    "It's a test; don't worry. We've seen you're fine, I'm sure!",
    "naive cafe facade aaab abab END END. The END. the the",
] * 4
SPECIALS = ["<unk>", "<s>", "</s>"]
SPECIAL_NAMES = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}


def sentencepiece_byte_fallback() -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral style: BPE over "▁"-marked words, <0x..> byte tokens for the rest, and a
    decoder that strips the first leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_NAMES)


def unigram_metaspace() -> PreTrainedTokenizerFast:
    """T5 style: Unigram with a Metaspace decoder, which drops the first token's leading space."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=SPECIALS, unk_token="<unk>")
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_NAMES)


def wordpiece(cleanup_by: str) -> PreTrainedTokenizerFast:
    """BERT style. cleanup_by="rust": the Rust decoder removes spaces before punctuation token by
    token; "transformers": transformers' decode() does, on the whole text after the decoder."""
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=cleanup_by == "rust")
    tok.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=150, special_tokens=SPECIALS)
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=cleanup_by == "transformers",
        **SPECIAL_NAMES,
    )


# Each test tokenizer, and whether its streams decode with DecodeStream.
DECODE_STREAM_USED = {
    "smollm2": True,
    "smollm2-cleanup-flag": True,  # transformers ignores the flag for BPE: decode() is Rust's
    "sentencepiece-byte-fallback": True,
    "unigram-metaspace": True,
    "wordpiece": True,
    "wordpiece-cleanup": False,  # transformers' decode() cleans up after the Rust decoder
}


@pytest.fixture(scope="session")
def tokenizers_by_name(tokenizer, tokenizer_dir):
    return {
        "smollm2": tokenizer,
        "smollm2-cleanup-flag": AutoTokenizer.from_pretrained(
            str(tokenizer_dir), clean_up_tokenization_spaces=True
        ),
        "sentencepiece-byte-fallback": sentencepiece_byte_fallback(),
        "unigram-metaspace": unigram_metaspace(),
        "wordpiece": wordpiece(cleanup_by="rust"),
        "wordpiece-cleanup": wordpiece(cleanup_by="transformers"),
    }


@pytest.fixture(params=[True, False], ids=["decode_stream", "window"])
def use_decode_stream(request) -> bool:
    return request.param


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_stream(
    tokenizer, ids: list[int], stop=(), use_decode_stream=True
) -> tuple[list[str], int | None, str]:
    """Feed ids until the stream stops. Returns the pieces, how many ids were consumed when a
    stop string matched (None if none did) and the text flushed by finish()."""
    stream = TextStream(tokenizer, stop, use_decode_stream=use_decode_stream)
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
def test_without_stop_strings_output_equals_decode_and_never_holds_whole_chars(
    tokenizer, text, use_decode_stream
):
    ids = encode(tokenizer, text)
    stream = TextStream(tokenizer, use_decode_stream=use_decode_stream)
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
def test_random_stop_strings_match_brute_force(tokenizer, seed, use_decode_stream):
    rng = random.Random(seed)
    for text in TEXTS + random_texts(rng, 20):
        ids = encode(tokenizer, text)
        stop = random_stops(rng, text)
        pieces, consumed, flushed = run_stream(tokenizer, ids, stop, use_decode_stream)
        want_text, want_consumed = expected_output(tokenizer, ids, stop)
        assert "".join(pieces) + flushed == want_text, (text, stop)
        assert consumed == want_consumed, (text, stop)


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_split_across_tokens(tokenizer, text, use_decode_stream):
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
        pieces, consumed, flushed = run_stream(tokenizer, ids, [stop], use_decode_stream)
        want_text, want_consumed = expected_output(tokenizer, ids, [stop])
        assert "".join(pieces) == want_text == text[: text.find(stop)]
        assert consumed == want_consumed and flushed == ""


@pytest.mark.parametrize("seed", range(6))
def test_holds_back_only_a_possible_stop_string_start(tokenizer, seed, use_decode_stream):
    rng = random.Random(1000 + seed)
    for text in TEXTS + random_texts(rng, 20):
        ids = encode(tokenizer, text)
        stop = random_stops(rng, text)
        stream = TextStream(tokenizer, stop, use_decode_stream=use_decode_stream)
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


def test_special_tokens_are_skipped(tokenizer, use_decode_stream):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "before") + [eos] + encode(tokenizer, " after 日本")
    pieces, _, flushed = run_stream(tokenizer, ids, (), use_decode_stream)
    assert "".join(pieces) + flushed == "before after 日本" == decode(tokenizer, ids)


def test_incomplete_character_at_the_end_is_flushed_as_decode_does(tokenizer, use_decode_stream):
    ids = encode(tokenizer, "ok 日本語")[:-1]  # drop the token that completes the last character
    pieces, _, flushed = run_stream(tokenizer, ids, (), use_decode_stream)
    assert PARTIAL not in "".join(pieces)
    assert "".join(pieces) + flushed == decode(tokenizer, ids)
    assert flushed.endswith(PARTIAL)


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError):
        TextStream(tokenizer, ["x", ""])


def complete_texts(tokenizer, ids: list[int]) -> list[str]:
    """The complete characters of decode(ids[:k]) for k = 0..len(ids)."""
    return [decode(tokenizer, ids[:k]).rstrip(PARTIAL) for k in range(len(ids) + 1)]


def decode_is_stable(tokenizer, ids: list[int]) -> bool:
    """Whether the complete characters of decode(ids[:k]) only ever grow with k. A stream cannot
    take back text it released, so this is where its contract can hold token by token."""
    return all(b.startswith(a) for a, b in pairwise(complete_texts(tokenizer, ids)))


def decode_ends_stable(tokenizer, ids: list[int]) -> bool:
    """Whether the complete characters of every decode(ids[:k]) begin decode(ids). Weaker: byte
    fallback decodes "日" then "U+FFFD x4" when the next character's first byte comes, then "日本"."""
    full = decode(tokenizer, ids)
    return all(full.startswith(c) for c in complete_texts(tokenizer, ids))


def random_id_sequences(tokenizer, rng: random.Random, count: int) -> list[list[int]]:
    """Half re-encoded random text with special tokens spliced in; half uniform random ids
    (special and byte tokens included, characters cut anywhere, and a few ids past the vocabulary,
    as a model with a padded embedding can sample)."""
    sequences = []
    for text in random_texts(rng, count // 2):
        ids = encode(tokenizer, text)
        for _ in range(rng.randint(0, 2)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(tokenizer.all_special_ids))
        sequences.append(ids)
    for _ in range(count - count // 2):
        sequences.append([rng.randrange(len(tokenizer) + 8) for _ in range(rng.randint(1, 40))])
    return sequences


def stream_pieces(tokenizer, ids, use_decode_stream) -> tuple[list[str], list[int]]:
    """Each feed()'s text then finish()'s, and each token's text offset."""
    stream = TextStream(tokenizer, use_decode_stream=use_decode_stream)
    pieces, offsets = [], []
    for token_id in ids:
        offsets.append(stream.decoded_chars)
        pieces.append(stream.feed(token_id))
    pieces.append(stream.finish())
    return pieces, offsets


def some_stops(rng: random.Random, text: str) -> list[str]:
    # Without U+FFFD: decode(ids[:k]) ends in one for a character the stream has not seen yet.
    return [s for s in random_stops(rng, text) if PARTIAL not in s] if text else []


@pytest.mark.parametrize(("name", "used"), DECODE_STREAM_USED.items())
def test_decode_stream_is_used_where_it_matches_decode(tokenizers_by_name, name, used):
    tok = tokenizers_by_name[name]
    assert decode_stream_matches(tok) is used
    assert TextStream(tok).uses_decode_stream is used
    assert not TextStream(tok, use_decode_stream=False).uses_decode_stream


def test_cleanup_flag_that_transformers_ignores_keeps_decode_stream(tokenizers_by_name):
    tok = tokenizers_by_name["smollm2-cleanup-flag"]
    ids = encode(tok, "Hello , world . It ' s")
    text = decode(tok, ids)
    assert tok.clean_up_tokenization_spaces
    assert tok.clean_up_tokenization(text) != text == tok.backend_tokenizer.decode(ids)


def test_window_path_follows_decode_that_cleans_up_spaces(tokenizers_by_name):
    """Why wordpiece-cleanup does not use DecodeStream: its decode() drops the space before
    punctuation, the Rust decoder (all DecodeStream sees) does not."""
    tok = tokenizers_by_name["wordpiece-cleanup"]
    ids = encode(tok, "hello , world ! the end .")
    assert decode_is_stable(tok, ids)
    stream = DecodeStream(skip_special_tokens=True)
    streamed = "".join(stream.step(tok.backend_tokenizer, i) or "" for i in ids)
    assert streamed != decode(tok, ids)
    pieces, _ = stream_pieces(tok, ids, use_decode_stream=True)
    assert "".join(pieces) == decode(tok, ids)


def test_decode_stream_gives_way_to_the_window_where_decode_rewrites_its_text(
    tokenizers_by_name,
):
    tok = tokenizers_by_name["sentencepiece-byte-fallback"]
    ids = encode(tok, "x 日") + [tok.convert_tokens_to_ids("<0xE6>")] + encode(tok, "a")
    # 日's byte tokens plus a lone byte are not UTF-8: decode() turns 日 into U+FFFDs.
    assert not decode_is_stable(tok, ids)
    stream = TextStream(tok)
    pieces = [stream.feed(i) for i in ids] + [stream.finish()]
    assert not stream.uses_decode_stream
    assert pieces == stream_pieces(tok, ids, use_decode_stream=False)[0]


@pytest.mark.parametrize("name", DECODE_STREAM_USED)
def test_random_ids_stream_as_decode_on_both_paths(tokenizers_by_name, name):
    tok = tokenizers_by_name[name]
    rng = random.Random(name)
    stable = ends_stable = 0
    for ids in random_id_sequences(tok, rng, 200):
        pieces, offsets = stream_pieces(tok, ids, use_decode_stream=True)
        # The paths agree token by token, even where decode() rewrites its own text.
        assert (pieces, offsets) == stream_pieces(tok, ids, use_decode_stream=False)
        if decode_ends_stable(tok, ids):
            ends_stable += 1
            assert "".join(pieces) == decode(tok, ids)
        if decode_is_stable(tok, ids):
            stable += 1
            complete = complete_texts(tok, ids)
            assert list(accumulate(pieces[:-1])) == complete[1:]
            assert offsets == [len(c) for c in complete[:-1]]
    assert ends_stable >= 100 and stable >= 25


@pytest.mark.parametrize("name", DECODE_STREAM_USED)
def test_random_stop_strings_match_brute_force_for_each_tokenizer(
    tokenizers_by_name, name, use_decode_stream
):
    tok = tokenizers_by_name[name]
    rng = random.Random(f"stop-{name}")
    checked = 0
    for ids in random_id_sequences(tok, rng, 100):
        stop = some_stops(rng, decode(tok, ids))
        if not stop or not decode_ends_stable(tok, ids):
            continue
        checked += 1
        pieces, consumed, flushed = run_stream(tok, ids, stop, use_decode_stream)
        want_text, want_consumed = expected_output(tok, ids, stop)
        assert "".join(pieces) + flushed == want_text, (ids, stop)
        assert consumed == want_consumed, (ids, stop)
    assert checked >= 50


@pytest.mark.parametrize("name", DECODE_STREAM_USED)
def test_feed_many_releases_what_feed_does_with_each_tokens_offset(tokenizers_by_name, name):
    tok = tokenizers_by_name[name]
    rng = random.Random(f"many-{name}")
    for ids in random_id_sequences(tok, rng, 40):
        stop = some_stops(rng, decode(tok, ids))
        one = TextStream(tok, stop)
        released = [""]  # what `one` released after each token
        offsets = []
        for token_id in ids:
            if one.stopped:
                break
            offsets.append(one.decoded_chars)
            one.feed(token_id)
            assert one.fed_offsets == offsets[-1:]
            released.append(one.text)
        many = TextStream(tok, stop)
        many_offsets = []
        start = 0
        while start < len(ids):
            chunk = ids[start : start + rng.randint(1, 5)]
            before = many.text
            out = many.feed_many(chunk)
            many_offsets += many.fed_offsets
            assert many.text == before + out == released[len(many_offsets)]
            start += len(chunk)
        assert many_offsets == offsets
        assert many.stopped == one.stopped
        assert many.finish() == one.finish() and many.text == one.text


@pytest.mark.parametrize("name", sorted(DECODE_STREAM_USED))
def test_feed_many_without_offsets_or_stops_releases_what_feed_does(tokenizers_by_name, name):
    """Such a stream decodes each feed_many() in one DecodeStream call where the library takes
    lists: the same text as token by token, wherever decode() is stable."""
    tok = tokenizers_by_name[name]
    rng = random.Random(f"lists-{name}")
    checked = 0
    for ids in random_id_sequences(tok, rng, 40):
        if not decode_ends_stable(tok, ids):
            continue
        one = TextStream(tok)
        for token_id in ids:
            one.feed(token_id)
        many = TextStream(tok, offsets=False)
        start, counts = 0, []
        while start < len(ids):
            chunk = ids[start : start + rng.randint(1, 20)]
            before = many.text
            out = many.feed_many(chunk)
            assert many.text == before + out
            counts.append(many.fed_count)
            start += len(chunk)
        assert sum(counts) == len(ids)
        assert many.finish() == one.finish() and many.text == one.text, ids
        with pytest.raises(ValueError, match="offsets=False"):
            _ = many.fed_offsets
        checked += 1
    assert checked >= 20


def test_feed_many_without_offsets_steps_token_by_token_where_lists_are_not_taken(
    tokenizer, monkeypatch
):
    """With a tokenizers release whose DecodeStream takes one id at a time (before 0.22)."""
    monkeypatch.setattr(textstream, "_takes_lists", False)
    rng = random.Random("no-lists")
    for ids in random_id_sequences(tokenizer, rng, 10):
        one, many = TextStream(tokenizer), TextStream(tokenizer, offsets=False)
        for token_id in ids:
            one.feed(token_id)
        for start in range(0, len(ids), 7):
            many.feed_many(ids[start : start + 7])
        assert many.finish() == one.finish() and many.text == one.text, ids


def test_feed_many_stops_mid_call_and_reports_the_tokens_consumed(tokenizer):
    ids = encode(tokenizer, "one two three four five")
    stream = TextStream(tokenizer, ["three"])
    out = stream.feed_many(ids)
    _, consumed, _ = run_stream(tokenizer, ids, ["three"])
    assert out == "one two " and stream.stopped
    assert len(stream.fed_offsets) == stream.fed_count == consumed < len(ids)
    assert stream.feed_many(ids) == "" and stream.fed_offsets == [] and stream.fed_count == 0


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
