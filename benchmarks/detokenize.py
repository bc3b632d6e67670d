"""Per-token cost of incremental detokenization (orbit/http/textstream.py): transformers' decode() of a
window per token (the fallback path, what every tokenizer used before) against DecodeStream, token
by token and (last column) as a choice without logprobs feeds it: a stream without offsets gives
each feed_many() to DecodeStream in one call when it has no stop strings.

    python -m benchmarks.detokenize [--tokenizer DIR] [--streams 256] [--tokens 256]

The tokenizer defaults to SmolLM2's (from the embedded default model's GGUF). The ids are real
text re-encoded: the repository's docs (English prose, tables, code) and, as a second workload,
the same interleaved with CJK, accents and emoji, whose characters split across byte-level tokens.
Each stream gets a slice at a random offset. Streams are fed round-robin, one token (or one
--many chunk) each per step, as the frontend does for a batch; the time includes creating the
streams and finish(); the fastest of --repeat runs counts. Both paths must release the same
text, or the run fails.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from orbit.http.textstream import TextStream

DOCS = Path(__file__).resolve().parent.parent / "docs"
MIXED = "日本語のテキスト、naïve café façade — Привет, мир 🚀👩‍👩‍👧 数学: ∑ᵢ xᵢ² ≤ ∞. "
STOP = ("\n\n\n\n", "<|endoftext|>", "Observation:")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, help="a saved Hugging Face tokenizer directory")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--many", type=int, default=8, help="tokens per feed_many() call")
    p.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_tokenizer(path: Path | None):
    from transformers import AutoTokenizer

    if path is not None:
        return AutoTokenizer.from_pretrained(str(path))
    from orbit.default_model import default_gguf

    gguf = default_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def workloads(tokenizer, args) -> dict[str, list[list[int]]]:
    english = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    paragraphs = english.split("\n\n")
    mixed = "\n\n".join(p + " " + MIXED for p in paragraphs)
    rng = random.Random(args.seed)
    out = {}
    for name, text in (("english", english), ("mixed", mixed)):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        starts = [rng.randrange(len(ids) - args.tokens) for _ in range(args.streams)]
        out[name] = [ids[s : s + args.tokens] for s in starts]
    return out


def run(
    tokenizer, streams_ids, use_decode_stream: bool, many: int, stop, offsets: bool = True
) -> tuple[float, list]:
    """Seconds to stream every sequence, and the text each released."""
    began = time.perf_counter()
    streams = [
        TextStream(tokenizer, stop, use_decode_stream=use_decode_stream, offsets=offsets)
        for _ in streams_ids
    ]
    texts = [[] for _ in streams_ids]
    for step in range(0, len(streams_ids[0]), many):
        for stream, ids, text in zip(streams, streams_ids, texts):
            if many == 1:
                text.append(stream.feed(ids[step]))
            else:
                text.append(stream.feed_many(ids[step : step + many]))
    for stream, text in zip(streams, texts):
        text.append(stream.finish())
    return time.perf_counter() - began, ["".join(t) for t in texts]


def fastest(repeat: int, *run_args) -> tuple[float, list]:
    runs = [run(*run_args) for _ in range(repeat)]
    return min(s for s, _ in runs), runs[0][1]


def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    assert TextStream(tokenizer).uses_decode_stream, "DecodeStream does not match this tokenizer"
    num_tokens = args.streams * args.tokens
    print(f"{args.streams} streams x {args.tokens} tokens; microseconds per token")
    print(
        f"{'workload':<9} {'stop strings':<13} {'feed':<14} {'window':>8} {'DecodeStream':>13} "
        f"{'no offsets':>11}"
    )
    for name, streams_ids in workloads(tokenizer, args).items():
        for stop in ((), STOP):
            for many in (1, args.many):
                window_s, window_text = fastest(
                    args.repeat, tokenizer, streams_ids, False, many, stop
                )
                rust_s, rust_text = fastest(args.repeat, tokenizer, streams_ids, True, many, stop)
                lists_s, lists_text = fastest(
                    args.repeat, tokenizer, streams_ids, True, many, stop, False
                )
                assert window_text == rust_text == lists_text, f"the paths differ ({name})"
                feed = "feed()" if many == 1 else f"feed_many({many})"
                print(
                    f"{name:<9} {len(stop):<13} {feed:<14} {window_s / num_tokens * 1e6:>8.2f} "
                    f"{rust_s / num_tokens * 1e6:>13.2f} {lists_s / num_tokens * 1e6:>11.2f}"
                )


if __name__ == "__main__":
    main()
