#!/usr/bin/env bash
# Issue 5's GPU checks in one call on the lent machine: the GPU tests, then the decode/TTFT
# benchmark, everything written under $OUT (docs/performance.md quotes the results).
#   source .gpu/bootstrap.sh && bash benchmarks/gpu_session.sh
# Optional: K='pytest -k expression', BENCH_ARGS='--layers 4', SKIP_TESTS=1, SKIP_BENCH=1.
set -uo pipefail
out=${OUT:-gpu-out}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -f "$here/.gpu/fi-jit-extra.tgz" ]; then  # modules an earlier call compiled
  tar xzf "$here/.gpu/fi-jit-extra.tgz" -C ~/.cache
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$out/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  ORBIT_GPU_REPORT="$out/gpu-tests.jsonl" timeout "${TEST_TIMEOUT:-330}" \
    python3 -m pytest tests/gpu -q -s -p no:cacheprovider -k "${K:-}" 2>&1 | tee "$out/gpu-tests.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-240}" python3 -m benchmarks.decode --out "$out" ${BENCH_ARGS:-} \
    2>&1 | tee "$out/bench.log"
fi
# FlashInfer modules compiled here that the carried cache lacks (head_dim 64 for SmolLM2):
# brought back so later calls can carry them instead of compiling again.
new=$(cd ~/.cache && ls -d flashinfer/*/*/*/*head_dim_qk_64* 2>/dev/null)
if [ -n "$new" ] && [ ! -f "$here/.gpu/fi-jit-extra.tgz" ]; then
  (cd ~/.cache && tar czf "$out/fi-jit-extra.tgz" $new)
fi
