"""Incremental detokenization for streaming, with stop strings, and per-token text for logprobs.

How `TextStream` works. Decoding the whole output after every token is quadratic, so `_Detokenizer`
decodes a short window: `context` ids whose text was already taken, then `pending` ids. The text
beyond the context's is new. A window whose text ends in U+FFFD ends inside a multi-byte character:
the complete characters before it are taken and the window grows until the character completes.
Only then does the window slide forward (pending -> context), so the context never starts
mid-character and keeps any leading-space handling of the decoder stable.

Two ways to decode the window, one per tokenizer:
- The `tokenizers` library's `DecodeStream` (Rust), where it yields what `tokenizer.decode()` does
  (`decode_stream_matches`): one Rust call per token keeps the window, or one per feed_many() of
  a stream that neither has stop strings nor reports offsets, where the library takes a list of
  ids (tokenizers 0.22 on): 0.44 against 1.15 µs a token for 13 at once. It returns None while the
  window ends inside a character; a Rust decode of our mirror of its window then takes the complete
  characters before it. DecodeStream raises when a token rewrites text it already produced (a run
  of byte-fallback tokens that stops being valid UTF-8, so `decode()` itself changes its mind);
  that stream then goes on with the next way.
- `tokenizer.decode()` (transformers) of the window, for every token: for tokenizers whose decode
  cleans up tokenization spaces, which DecodeStream does not reproduce.

Stop strings are then searched in the text not yet handed out. Text is held back only while its end
could still be the start of a stop string; on a match the text before it is released and the stream
stops. The concatenation of everything released equals
`tokenizer.decode(ids, skip_special_tokens=True)` cut just before the leftmost stop-string
occurrence in the text of the tokens consumed when the first stop string completed. That holds
wherever decode() is stable: the complete characters of `decode(ids[:k])` are a prefix of those of
`decode(ids[:k + 1])` for every k. No stream can take back text, so where it is not (the
byte-fallback run above, cleanup that joins across tokens), the output follows decode() only
approximately, the same way on both paths.
"""

import re
import weakref
from collections.abc import Sequence
from functools import partial

from tokenizers.decoders import DecodeStream

_PARTIAL = "\ufffd"  # what decode() yields for bytes of a character that is not complete yet

# Text that transformers' clean_up_tokenization would change, and that spans the usual pieces.
_PROBE_TEXT = "Hi , there . It ' s n't I 'm we 've you 're ? ! a  b\n\t日本語 🚀 é <x>"

_matches_cache: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()
_takes_lists: bool | None = None  # whether DecodeStream.step takes a list of ids


def _decode_stream_takes_lists(backend) -> bool:
    global _takes_lists
    if _takes_lists is None:
        try:
            DecodeStream(skip_special_tokens=True).step(backend, [])
            _takes_lists = True
        except Exception:  # noqa: BLE001 - a tokenizers release before lists (TypeError there)
            _takes_lists = False
    return _takes_lists


def decode_stream_matches(tokenizer) -> bool:
    """Whether DecodeStream over `tokenizer.backend_tokenizer` yields `tokenizer.decode()`'s text.

    Not where transformers' decode() cleans up tokenization spaces after the Rust decoder has run
    (" ' s" -> "'s" across tokens, after the "'" was streamed). Whether it does is probed rather
    than read off `clean_up_tokenization_spaces`: transformers ignores that flag for BPE models
    (Llama 3 sets it). The Rust decoders' own cleanup (WordPiece) works token by token, which a
    stream reproduces. Cached per tokenizer object.
    """
    if tokenizer not in _matches_cache:
        _matches_cache[tokenizer] = _probe_decode_stream(tokenizer)
    return _matches_cache[tokenizer]


def _probe_decode_stream(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer
        return False
    ids = tokenizer.encode(_PROBE_TEXT) + list(getattr(tokenizer, "all_special_ids", []))
    return tokenizer.decode(ids, skip_special_tokens=True) == backend.decode(ids, True)


class _Detokenizer:
    """Token ids in, newly decoded complete characters out (see the module docstring)."""

    def __init__(self, tokenizer, use_decode_stream: bool):
        self._stream = None
        self._takes_lists = False
        if use_decode_stream and decode_stream_matches(tokenizer):
            self._backend = tokenizer.backend_tokenizer
            self._stream = DecodeStream(skip_special_tokens=True)
            self._decode = partial(self._backend.decode, skip_special_tokens=True)
            self._takes_lists = _decode_stream_takes_lists(self._backend)
        else:
            self._decode = partial(tokenizer.decode, skip_special_tokens=True)
        self._context: list[int] = []  # ids whose text was already taken; DecodeStream's too
        self._context_chars: int | None = 0  # len(decode(context)), None until needed
        self._pending: list[int] = []  # ids after the context
        self._taken_chars = 0  # chars of the pending ids' text already returned

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    def step(self, token_id: int) -> str:
        """Adds one token; returns the complete characters it added (often "", never U+FFFD)."""
        self._pending.append(token_id)
        return self._take(token_id)

    def step_many(self, token_ids: Sequence[int]) -> str:
        """Adds tokens in order; returns the complete characters they added, in one DecodeStream
        call where it takes lists. Where decode() is stable (the module docstring) that is the
        text step() gives token by token, joined."""
        if self._stream is None or not self._takes_lists:
            return "".join([self.step(t) for t in token_ids])
        token_ids = list(token_ids)
        self._pending += token_ids
        return self._take(token_ids)

    def _take(self, new: int | list[int]) -> str:
        """The new complete characters after the ids `new` joined the pending ones."""
        if self._stream is None:
            return self._decode_window(slide=True)
        try:
            text = self._stream.step(self._backend, new)
        except Exception:  # noqa: BLE001 - DecodeStream's only error: decode() rewrote its text
            self._stream = None
            return self._decode_window(slide=True)
        if text is None:  # no new text, or the window ends inside a character
            return self._decode_window(slide=False)
        new = text[self._taken_chars :] if self._taken_chars else text
        self._slide()
        return new

    def flush(self) -> str:
        """The text not returned yet, an incomplete character at the end included as decode()
        gives it. The sequence ended: step() must not be called after this."""
        if not self._pending:
            return ""
        window = self._decode(self._context + self._pending)
        return window[self._context_text_chars() + self._taken_chars :]

    def _decode_window(self, slide: bool) -> str:
        context_chars = self._context_text_chars()
        window = self._decode(self._context + self._pending)
        new = window.rstrip(_PARTIAL)[context_chars + self._taken_chars :]
        if slide and len(window) > context_chars and not window.endswith(_PARTIAL):
            self._slide()
        else:
            self._taken_chars += len(new)
        return new

    def _context_text_chars(self) -> int:
        if self._context_chars is None:
            self._context_chars = len(self._decode(self._context))
        return self._context_chars

    def _slide(self) -> None:
        self._context, self._pending = self._pending, []
        self._context_chars, self._taken_chars = None, 0


class TextStream:
    """Feeds token ids; returns the text that is safe to send to the client.

    `decoded_chars` before a token is fed is that token's text offset (logprobs). feed_many()
    feeds several at once; `fed_count` then says how many it consumed, and `fed_offsets` (kept
    unless offsets=False) the offset of each.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        *,
        use_decode_stream: bool = True,
        offsets: bool = True,
    ):
        """use_decode_stream=False decodes with transformers even where DecodeStream would match
        (for tests and benchmarks that compare the two); offsets=False: no `fed_offsets`, and
        without stop strings feed_many() decodes its tokens together."""
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._detokenizer = _Detokenizer(tokenizer, use_decode_stream)
        self._offsets = offsets
        self._fed_count = 0
        self._stop = tuple(stop)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self._stop_starts = frozenset(s[0] for s in self._stop)
        self._unreleased = ""  # decoded text not handed out yet (cut at a stop string)
        self._released: list[str] = []  # the pieces handed out
        self._decoded_chars = 0
        self._fed_offsets: list[int] = []
        self._stopped = False
        self._ended = False  # a stop string matched or finish() was called

    @property
    def stopped(self) -> bool:
        """True once a stop string was found."""
        return self._stopped

    @property
    def decoded_chars(self) -> int:
        """Complete characters decoded so far, held-back ones included (a token's text offset)."""
        return self._decoded_chars

    @property
    def fed_offsets(self) -> list[int]:
        """The text offset (`decoded_chars` before it) of each token the last feed() or
        feed_many() consumed: fewer than it was given when a stop string ended the stream."""
        if not self._offsets:
            raise ValueError("this stream keeps no offsets (offsets=False)")
        return self._fed_offsets

    @property
    def fed_count(self) -> int:
        """The tokens the last feed() or feed_many() consumed: fewer than it was given when a
        stop string ended the stream."""
        return self._fed_count

    @property
    def text(self) -> str:
        """Everything released so far."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def uses_decode_stream(self) -> bool:
        """Whether this stream decodes with DecodeStream (Rust) rather than transformers."""
        return self._detokenizer.uses_decode_stream

    def feed(self, token_id: int) -> str:
        """Add one generated token; returns newly releasable text (often ""). After a stop string
        or finish() it returns "" and consumes nothing."""
        if self._ended:
            self._fed_offsets, self._fed_count = [], 0
            return ""
        self._fed_offsets, self._fed_count = [self._decoded_chars], 1
        self._append(self._detokenizer.step(token_id))
        return self._release(final=False)

    def feed_many(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens in order, up to the one that completes a stop string; returns the
        newly releasable text. `fed_offsets` then has one offset per token consumed."""
        if not self._offsets and not self._stop:  # nothing needs the tokens one at a time
            if self._ended:
                self._fed_count = 0
                return ""
            self._fed_count = len(token_ids)
            self._append(self._detokenizer.step_many(token_ids))
            return self._release(final=False)
        offsets = []
        for token_id in token_ids:
            if self._ended:
                break
            offsets.append(self._decoded_chars)
            self._append(self._detokenizer.step(token_id))
        self._fed_offsets, self._fed_count = offsets, len(offsets)
        return self._release(final=False)

    def finish(self) -> str:
        """The sequence ended: returns all held-back text (and an incomplete character at the end,
        as decode() writes it), unless a stop string ended it. Later calls return ""."""
        if self._ended:
            return ""
        self._append(self._detokenizer.flush())
        self._ended = True
        return self._release(final=True)

    def _append(self, new: str) -> None:
        """Adds decoded text; on the first stop string, cuts it there and ends the stream."""
        if not new:
            return
        self._decoded_chars += len(new)
        if not self._stop:
            self._unreleased += new
            return
        # The text before had no stop string, so a match ends in the new text.
        search_from = max(0, len(self._unreleased) - self._max_stop_chars + 1)
        self._unreleased += new
        end = self._first_stop(search_from)
        if end >= 0:
            self._unreleased = self._unreleased[:end]
            self._stopped = self._ended = True

    def _release(self, final: bool) -> str:
        held = 0 if final or self._stopped or not self._stop else self._held_chars()
        end = len(self._unreleased) - held
        out, self._unreleased = self._unreleased[:end], self._unreleased[end:]
        if out:
            self._released.append(out)
        return out

    def _first_stop(self, start: int) -> int:
        """Start of the leftmost stop-string occurrence in the unreleased text, or -1."""
        first = -1
        for s in self._stop:
            i = self._unreleased.find(s, start)
            if i >= 0 and (first < 0 or i < first):
                first = i
        return first

    def _held_chars(self) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of a stop string."""
        text = self._unreleased
        end = len(text)
        for pos in range(max(0, end - self._max_stop_chars + 1), end):  # longest suffix first
            if text[pos] in self._stop_starts:
                tail = text[pos:]
                if any(s.startswith(tail) for s in self._stop):
                    return end - pos
        return 0


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable char standing for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """The text and raw bytes of single tokens, for logprobs; cached per token id.

    A token can hold part of a multi-byte character. Its text is then written like OpenAI's
    "bytes:\\xe6\\x97" so that distinct partial tokens do not collapse into one U+FFFD key.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._added = {
            i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_alphabet = (
            _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        )
        self._cache: dict[int, tuple[str, bytes]] = {}

    def text_of(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self._lookup(token_id)[1])

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        if token_id not in self._cache:
            raw = self._raw_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._cache[token_id] = (text, raw)
        return self._cache[token_id]

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""  # an id outside the vocabulary
        if self._byte_alphabet is not None and all(c in self._byte_alphabet for c in piece):
            return bytes(self._byte_alphabet[c] for c in piece)
        if _BYTE_FALLBACK.fullmatch(piece):  # sentencepiece's byte tokens, "<0xE6>"
            return bytes([int(piece[3:5], 16)])
        return self._tokenizer.decode([token_id]).encode("utf-8")
