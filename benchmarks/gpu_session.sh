#!/usr/bin/env bash
# Issue 5's GPU checks on the lent machine, everything written under $OUT (docs/performance.md
# quotes the results): the GPU tests, the decode/TTFT benchmark of one rank, and the per-step
# host overhead through the frontend (engine + ZeroMQ + rank) on the same 8B-architecture model.
#   source .gpu/bootstrap.sh && bash benchmarks/gpu_session.sh
# Optional: K='pytest -k expression', BENCH_ARGS='--layers 4', SKIP_TESTS=1, SKIP_BENCH=1,
# SKIP_STEP=1. The tests read ORBIT_TEST_TOKENIZER / ORBIT_TEST_SMOLLM2_GGUF when set.
set -uo pipefail
out=${OUT:-gpu-out}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -f "$here/.gpu/fi-jit-extra.tgz" ]; then  # modules earlier calls compiled
  tar xzf "$here/.gpu/fi-jit-extra.tgz" -C ~/.cache
fi
modules() { (cd ~/.cache && find flashinfer -mindepth 4 -maxdepth 4 -type d | sort); }
modules >/tmp/fi-modules-before
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
if [ -z "${SKIP_STEP:-}" ]; then
  pkg=/tmp/orbit-8b-package
  [ -d "$pkg" ] || timeout 300 python3 -m benchmarks.random_package --out "$pkg" \
    --tokenizer "${ORBIT_TEST_TOKENIZER:?the package needs a saved tokenizer}" 2>&1 | tail -3
  timeout "${STEP_TIMEOUT:-300}" python3 -m benchmarks.step_overhead --package "$pkg" \
    --device cuda --prompt-tokens 512 --new-tokens 256 --batch "${STEP_BATCHES:-1,64}" --out "$out" 2>&1 | tee "$out/step.log"
fi
# FlashInfer modules compiled here that the carried cache lacks: brought back so later calls
# can carry them instead of compiling again.
modules | comm -13 /tmp/fi-modules-before - >/tmp/fi-modules-new
if [ -s /tmp/fi-modules-new ]; then
  (cd ~/.cache && tar czf "$out/fi-jit-new.tgz" $(cat /tmp/fi-modules-new))
fi
