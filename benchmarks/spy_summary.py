"""Where a process spent its samples, from `py-spy record --format raw` (folded stacks): each
frame's inclusive and own share of the samples, largest first.

    python3 -m benchmarks.spy_summary FILE [--top 40] [--within FUNC] [--match TEXT] [--lines]

--within keeps the samples whose stack holds a frame naming FUNC (say `Rank.serve`, to leave
out the start-up); --match lists only frames whose name holds TEXT; --lines keeps each line of
a function apart (by default a function's lines count as one frame). Used on the lent GPU
machine, where the raw files are too large to bring back (benchmarks/NOTES-gpu.md).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def read_folded(path: Path, within: str = "", lines: bool = False) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not lines:  # "f (file.py:12)" -> "f (file.py)"
            frames = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") else f for f in frames]
        if within and not any(within in f for f in frames):
            continue
        stacks.append((frames, int(count)))
    return stacks


def shares(
    stacks: list[tuple[list[str], int]],
) -> tuple[int, collections.Counter, collections.Counter]:
    total, inclusive, own = 0, collections.Counter(), collections.Counter()
    for frames, n in stacks:
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return total, inclusive, own


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--within", default="", help="only samples with a frame naming this")
    p.add_argument("--match", default="", help="only frames whose name holds this")
    p.add_argument("--lines", action="store_true", help="each line of a function apart")
    args = p.parse_args(argv)
    total, inclusive, own = shares(read_folded(args.file, args.within, args.lines))
    print(f"{args.file}: {total} samples" + (f" within {args.within}" if args.within else ""))
    if not total:
        return 1
    rows = [(f, n) for f, n in inclusive.most_common() if args.match in f][: args.top]
    for f, n in rows:
        print(f"{n / total:7.1%} {own[f] / total:7.1%}  {f[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
