"""Incremental detokenization for streaming, with stop strings, and per-token text for logprobs.

How `TextStream` works. Decoding the whole output after every token is quadratic, so it decodes a
short window of ids: `ids[prefix:read]` is context whose text was already taken, `ids[prefix:]` the
context plus new tokens. The text beyond the context is new. A window whose text ends in U+FFFD
ends inside a multi-byte character: the complete characters before it are taken and the window
grows until the character completes. Only then does the window slide forward (read -> prefix), so
the context never starts mid-character and keeps any leading-space handling of the decoder stable.

Stop strings are then searched in the text not yet handed out. Text is held back only while its end
could still be the start of a stop string; on a match the text before it is released and the stream
stops. The concatenation of everything released equals
`tokenizer.decode(ids, skip_special_tokens=True)` cut just before the leftmost stop-string
occurrence in the text of the tokens consumed when the first stop string completed.
"""

import re
from collections.abc import Sequence

_PARTIAL = "\ufffd"  # what decode() yields for bytes of a character that is not complete yet


class TextStream:
    """Feeds token ids one at a time; returns the text that is safe to send to the client."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self._stop_starts = frozenset(s[0] for s in self._stop)
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully reflected in _text
        self._read = 0  # ids[_prefix:_read] are the window's context
        self._window_chars = 0  # chars beyond the context already appended to _text
        self._text = ""  # every complete character decoded so far
        self._released = 0  # how many chars of _text were handed out
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; feed() and finish() return "" after that."""
        return self._stopped

    @property
    def decoded_chars(self) -> int:
        """Complete characters decoded so far, held-back ones included (a token's text offset)."""
        return len(self._text)

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._released]

    def feed(self, token_id: int) -> str:
        """Add one generated token; returns newly releasable text (often "")."""
        if self._stopped:
            return ""
        self._ids.append(token_id)
        self._text += self._decode_new()
        return self._release(final=False)

    def finish(self) -> str:
        """The sequence ended: returns all held-back text, unless a stop string ended it."""
        if self._stopped:
            return ""
        self._text += self._decode_window()[self._taken_chars() :]
        self._prefix = self._read = len(self._ids)
        self._window_chars = 0
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_window(self) -> str:
        return self._decode(self._ids[self._prefix :])

    def _taken_chars(self) -> int:
        return len(self._decode(self._ids[self._prefix : self._read])) + self._window_chars

    def _decode_new(self) -> str:
        taken = self._taken_chars()
        window = self._decode_window()
        new = window.rstrip(_PARTIAL)[taken:]
        if len(window) > taken - self._window_chars and not window.endswith(_PARTIAL):
            self._prefix, self._read, self._window_chars = self._read, len(self._ids), 0
        else:
            self._window_chars += len(new)
        return new

    def _release(self, final: bool) -> str:
        end = self._first_stop()
        if end >= 0:
            self._stopped = True
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_chars()
        out = self._text[self._released : end]
        self._released = end
        return out

    def _first_stop(self) -> int:
        """Start of the leftmost stop-string occurrence in the unreleased text, or -1."""
        hits = [i for s in self._stop if (i := self._text.find(s, self._released)) >= 0]
        return min(hits, default=-1)

    def _held_chars(self) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of a stop string."""
        end = len(self._text)
        start = max(self._released, end - self._max_stop_chars + 1)
        for pos in range(start, end):  # leftmost first: the longest suffix wins
            if self._text[pos] in self._stop_starts:
                tail = self._text[pos:]
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
