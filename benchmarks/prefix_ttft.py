"""Issue 18's cached-prefix TTFT through HTTP, with the server's own split of each first token.

Starts `orbit serve PACKAGE --log-level info`, then sends streamed /v1/completions of token ids
one at a time through plain HTTP (a bare HTTP/1.1 request: serving_sweep.first_data_s), 2 new
tokens each:
- uncached: --probes prompts of --prefix-tokens + --turn-tokens ids, no two sharing a prefix;
- cached: one request of a prefix and a turn (caches the prefix), then --probes requests of the
  same prefix and a fresh turn each;
- short: --probes prompts of --turn-tokens ids alone (the path's cost with little GPU work).
--warm-up requests of each shape go first, unmeasured. Reports the client's TTFT per group and,
from the access lines, the median of each part the server splits it into (api, to_core, queue,
prefill, ranks, gpu, back; docs/operations.md).

    python3 -m benchmarks.prefix_ttft --serve PKG --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.serving_sweep import first_data_s, prompt_ids, served, served_model

_SPLIT = re.compile(r"tokens_in=(\d+) .*ttft=([\d.]+)ms\(([^)]*)\)")


async def _ttft_s(url: str, model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": 2, "stream": True, "ignore_eos": True}
    return await first_data_s(url, "unused", body, 600)


async def _groups(url: str, model: str, args) -> dict[str, list[float]]:
    prefix_n, turn_n, vocab = args.prefix_tokens, args.turn_tokens, args.vocab_size
    salt = iter(range(10**6, 10**7))
    out: dict[str, list[float]] = {"uncached": [], "cached": [], "short": []}
    for i in range(args.warm_up + args.probes):
        ids = prompt_ids(prefix_n + turn_n, next(salt), vocab)
        out["uncached"].append(await _ttft_s(url, model, ids))
    prefix = prompt_ids(prefix_n, next(salt), vocab)
    await _ttft_s(url, model, prefix + prompt_ids(turn_n, next(salt), vocab))
    for i in range(args.warm_up + args.probes):
        ids = prefix + prompt_ids(turn_n, next(salt), vocab)
        out["cached"].append(await _ttft_s(url, model, ids))
    for i in range(args.warm_up + args.probes):
        ids = prompt_ids(turn_n, next(salt), vocab)
        out["short"].append(await _ttft_s(url, model, ids))
    return {k: v[args.warm_up :] for k, v in out.items()}


def _splits(log_path: Path) -> list[dict[str, float]]:
    """Each generation's access line, in order: its ttft and parts in ms."""
    rows = []
    for line in log_path.read_text(errors="replace").splitlines():
        m = _SPLIT.search(line)
        if m:
            parts = dict(kv.split("=") for kv in m.group(3).split())
            rows.append({"tokens_in": int(m.group(1)), "ttft": float(m.group(2))}
                        | {k: float(v) for k, v in parts.items()})  # fmt: skip
    return rows


def _median_parts(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in rows[0] if k != "tokens_in"]
    return {k: round(statistics.median(r[k] for r in rows), 2) for k in keys}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--serve", type=Path, required=True, metavar="PACKAGE")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--serve-args", default="", help="more `orbit serve` arguments")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--probes", type=int, default=7)
    p.add_argument("--warm-up", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are below it")
    p.add_argument("--out", type=Path, required=True, help="a directory: report and server log")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "prefix_ttft_serve.log"
    serve = SimpleNamespace(
        serve=args.serve, device=args.device, ready_timeout=900.0, serve_log=log_path,
        serve_args=f"--log-level info --api-servers 1 {args.serve_args}",
    )  # fmt: skip
    with served(serve) as (url, _pid):
        groups = asyncio.run(_groups(url, served_model(url, "unused"), args))
        time.sleep(0.5)  # the last access line is written after its stream's end
    rows = _splits(log_path)
    per_group = args.warm_up + args.probes
    # The log's order is the sending order: uncached, the caching request, cached, short.
    measured = {
        "uncached": rows[args.warm_up : per_group],
        "cached": rows[per_group + 1 + args.warm_up : 2 * per_group + 1],
        "short": rows[2 * per_group + 1 + args.warm_up : 3 * per_group + 1],
    }
    report = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name, ttfts in groups.items():
        report[name] = {
            "client_ttft_ms": [round(t * 1e3, 2) for t in ttfts],
            "client_ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 2),
            "server_split_p50_ms": _median_parts(measured[name]) if measured[name] else None,
        }
    report["cached_over_uncached"] = round(
        report["cached"]["client_ttft_p50_ms"] / report["uncached"]["client_ttft_p50_ms"], 4
    )
    (args.out / "prefix_ttft.json").write_text(json.dumps(report, indent=2) + "\n")
    for name in groups:
        print(name, report[name]["client_ttft_p50_ms"], "ms;", report[name]["server_split_p50_ms"])
    print("cached / uncached:", report["cached_over_uncached"])
    return report


if __name__ == "__main__":
    main()
