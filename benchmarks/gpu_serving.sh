#!/usr/bin/env bash
# Issue 16's measurements on the lent GPU machine, everything written under $OUT (docs/performance.md
# quotes the results). PART=all (the default) runs http, then engine at REF_LEVELS, each bounded
# so that one device call stays under its 10-minute limit; or one part:
#   PART=engine  the random 8B-architecture package (built if missing, --max-batch 256), then the
#                ranks-only decode figures (benchmarks.step_overhead) and the same requests
#                submitted in-process to the engine core (step_overhead.in_process_levels)
#   PART=core    the in-process part of engine alone
#   PART=http    orbit serve --device cuda with its API servers, driven through HTTP by the
#                official openai client (benchmarks.serving_sweep): 1, 8, 64, 256 streams of
#                512-token prompts and 256 new tokens, the GPU's busy share and the frontend's
#                CPU time per token; then TTFT of a 2,048-token prompt alone
#   PART=structured  issue 17's structured-output overhead (benchmarks.structured): 256-token
#                json_schema answers against 256-token free text, at 1 and 64 streams, through
#                orbit serve --device cuda; writes structured.json (not part of "all")
#   PART=prefix  issue 18's prefix caching, cache off against on over one set of ranks
#                (benchmarks.prefix_cache); writes prefix_cache.json (not part of "all")
# Run from the repository root with the kit carried: source .gpu/bootstrap.sh first.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
pkg=${PKG:-/tmp/orbit-8b-256}
levels=${LEVELS:-1,8,64,256}
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # the openai client and what it needs beyond the image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-whl .whl/*.whl && export PYTHONPATH=/tmp/site-whl:$PYTHONPATH
fi
if [ ! -f "$pkg/manifest.pb" ]; then
  date -u +"%T package" >&2
  timeout 400 python3 -m benchmarks.random_package --out "$pkg" --max-batch 256 \
    --tokenizer "${ORBIT_TEST_TOKENIZER:?the package needs a saved tokenizer}" 2>&1 | tail -3
fi
engine_part() {
  core_part
  timeout "${STEP_TIMEOUT:-240}" python3 -m benchmarks.step_overhead --package "$pkg" \
    --device cuda --prompt-tokens 512 --new-tokens 256 --batch "$levels" --out "$out" \
    2>&1 | tee "$out/step.log"
}
core_part() {
  date -u +"%T engine" >&2
  timeout "${CORE_TIMEOUT:-240}" python3 -c "
import asyncio, json, sys
from benchmarks.step_overhead import in_process_levels
levels = [int(c) for c in '$levels'.split(',')]
r = asyncio.run(in_process_levels('$pkg', 'cuda', 1, 512, 256, levels))
json.dump(r, open('$out/in_process.json', 'w'))
" 2>&1 | tee "$out/in_process.log"
}
http_part() {
  date -u +"%T http" >&2
  timeout "${SWEEP_TIMEOUT:-420}" python3 -m benchmarks.serving_sweep --serve "$pkg" \
    --serve-args "--device cuda ${SERVE_ARGS:-}" --concurrency "$levels" --prompt-tokens 512 \
    --new-tokens 256 --ttft-prompt-tokens 2048 --out "$out/sweep.json" 2>&1 | tee "$out/sweep.log"
}
structured_part() {
  date -u +"%T structured" >&2
  timeout "${STRUCTURED_TIMEOUT:-540}" python3 -m benchmarks.structured --serve "$pkg" \
    --serve-args "--device cuda ${SERVE_ARGS:-}" --concurrency "${STRUCTURED_LEVELS:-1,64}" \
    --new-tokens 256 --prompt-tokens 512 --out "$out/structured.json" 2>&1 \
    | tee "$out/structured.log"
}
prefix_part() {
  date -u +"%T prefix" >&2
  timeout "${PREFIX_TIMEOUT:-400}" python3 -m benchmarks.prefix_cache --package "$pkg" \
    --device cuda --out "$out" 2>&1 | tee "$out/prefix.log"
}
case "${PART:-all}" in
engine) engine_part ;;
core) core_part ;;
http) http_part ;;
structured) structured_part ;;
prefix) prefix_part ;;
all) http_part; levels=${REF_LEVELS:-64,256} engine_part ;;
esac
