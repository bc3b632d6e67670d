#!/usr/bin/env bash
# Issue 16's CPU item: the frontend processes' CPU time per streamed token at 32 concurrent
# streams of a tiny model (--device cpu), this tree against an older one, on the same machine
# and package. Run from the repository root:
#   BASE=/path/to/older/checkout bash benchmarks/frontend_cpu.sh
# BASE may also be a `git archive` tarball. API_SERVERS=N serves this tree with --api-servers N
# (default: its own default); EXTRA adds `orbit serve` arguments for this tree only (such as
# "--stream-interval 16", which the old single process lacks); LEVELS=32,32,32 measures each
# server over three levels of 32 streams (one by default). Results under $OUT (default
# cpu-out): sweep-new.json, sweep-base.json, the two summaries and summary.txt (each level's
# µs per token and the medians' ratio). Give it a machine with cores to spare (the ranks, the
# clients and the frontend each want their own): on two cores they contend and the figure
# measures the contention.
set -euo pipefail
out=${OUT:-cpu-out}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
base=${BASE:?BASE: an older checkout (directory or tarball)}
if [ -f "$base" ]; then
  mkdir "$work/base" && tar -xzf "$base" -C "$work/base" && base="$work/base"
fi
# the openai client and what it needs, where the machine lacks them (the kit's wheels are the
# GPU image's Python's: installed over a working client of another Python they break it)
if [ -d .whl ] && ! python3 -c "import openai, httptools" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$work/site" .whl/*.whl && export PYTHONPATH=$work/site:${PYTHONPATH:-}
fi
tokenizer=${TOKENIZER:-}
python3 - "$work" "$tokenizer" <<'EOF'
import sys
from pathlib import Path
from tests.models import make_tiny_checkpoint, save_tokenizer
work, tokenizer = Path(sys.argv[1]), sys.argv[2]
if not tokenizer:
    tokenizer = work / "tokenizer"
    save_tokenizer(tokenizer)
make_tiny_checkpoint("llama", work / "llama", Path(tokenizer))
EOF
python3 -m orbit prepare "$work/llama" --tp 1 --out "$work/pkg" >/dev/null
load=(--concurrency "${LEVELS:-32}" --prompt-tokens 16 --new-tokens 128 --client-procs 2
  --vocab-size 4000 --gpu-busy off)
serve_args="--device cpu --kv-pages 4096 --threads ${THREADS:-2}"
new_args="$serve_args${API_SERVERS:+ --api-servers $API_SERVERS}${EXTRA:+ $EXTRA}"
python3 -m benchmarks.serving_sweep --serve "$work/pkg" --serve-args "$new_args" "${load[@]}" \
  --out "$out/sweep-new.json" 2>&1 | tail -12 | tee "$out/new.txt"
port=$((20000 + RANDOM % 20000))
(cd "$base" && exec setsid python3 -m orbit serve "$work/pkg" --port $port $serve_args) \
  >"$out/base-serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.5
done
python3 -m benchmarks.serving_sweep --url "http://127.0.0.1:$port" --server-pid $pid "${load[@]}" \
  --out "$out/sweep-base.json" 2>&1 | tail -12 | tee "$out/base.txt"
kill -TERM $pid
wait $pid || true
# Each level's CPU µs per streamed token, and the medians' ratio: the issue's figure.
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, statistics, sys
levels = {}
for name in ("new", "base"):
    sweep = json.load(open(f"{sys.argv[1]}/sweep-{name}.json"))
    levels[name] = [lv["frontend_cpu"]["us_per_token"] for lv in sweep["levels"]]
    print(f"{name}: " + ", ".join(f"{v:.1f}" for v in levels[name]) + " µs/token")
new, base = (statistics.median(levels[n]) for n in ("new", "base"))
print(f"this tree / base, medians: {new:.1f} / {base:.1f} = {new / base:.1%}")
PY
