#!/usr/bin/env bash
# The device calls of benchmarks/NOTES-gpu.md item 1 (issue 19: exact verification rows, then
# SmolLM2-135M on copy-heavy prompts), one per argument, run from the repository root on the
# lent machine; results under $OUT (the device tool's folder). Three calls back to back, each
# carrying its part of the GGUF (benchmarks/gpu_kit.sh):
#   carry [".gpu", ".gputok", ".gga", ".whl"]:  bash benchmarks/gpu_calls.sh exact
#   carry [".ggb"]:                              bash benchmarks/gpu_calls.sh fuse
#   carry [".ggc"]:                              bash benchmarks/gpu_calls.sh copy [SWITCH ...]
# The copy run's ranks read the code's defaults, so the switches the first two calls decide
# are set in the machine's copy of the tree (no edit here between calls: the machine goes back
# 30 s after one): exact (CudaRunnerOptions.exact_verify_max_bucket = 32), unroll=N
# (cuda_ops.EXACT_ROWS_UNROLL = N), fused (cuda_ops.FUSE_FEW_ROWS = True).
set -uo pipefail
source .gpu/bootstrap.sh >/dev/null 2>&1
pip install -q --no-index --no-deps --target /tmp/site-whl .whl/*.whl >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site-whl:${PYTHONPATH:-} ORBIT_TEST_TOKENIZER=$PWD/.gputok
export PYTHONUNBUFFERED=1 ORBIT_GPU_REPORT=$OUT/report.jsonl
mkdir -p /tmp/gg
nvidia-smi --query-gpu=name --format=csv,noheader

verify() {  # benchmarks.speculation verify with these arguments, into $OUT/verify-NAME
  local name=$1
  shift
  python3 -m benchmarks.speculation verify "$@" --out "$OUT/verify-$name" 2>&1 | tail -2
}

case "${1:?exact, fuse or copy}" in
exact)
  cp .gga/part.aa /tmp/gg/
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_smollm2_arch.py \
    tests/gpu/test_cuda_runner.py -k "verification or fused" 2>&1 | tail -3
  verify smollm2-flashinfer --shape smollm2
  verify smollm2-exact --shape smollm2 --exact-verify-max-bucket 32
  verify smollm2-exact-unrolled --shape smollm2 --exact-verify-max-bucket 32 --exact-rows-unroll 17
  ;;
fuse)  # and the 8B's exact verification (its build and compiles would not fit the first call)
  cp .ggb/part.ab /tmp/gg/
  verify 8b-flashinfer
  verify 8b-exact --exact-verify-max-bucket 32
  for fuse in "" --fuse-few-rows; do
    python3 -m benchmarks.decode --shape smollm2 --batches 1,2,4,8,24 --prompts 128 \
      --hf-tokens 0 --out "$OUT/decode${fuse:+-fused}" $fuse 2>&1 | tail -4
  done
  ;;
copy)
  for switch in "${@:2}"; do
    case "$switch" in
    exact) sed -i 's/exact_verify_max_bucket: int = 0$/exact_verify_max_bucket: int = 32/' \
      runtime/cuda_runner.py ;;
    unroll=*) sed -i "s/^EXACT_ROWS_UNROLL = 1$/EXACT_ROWS_UNROLL = ${switch#unroll=}/" \
      runtime/cuda_ops.py ;;
    fused) sed -i 's/^FUSE_FEW_ROWS = False$/FUSE_FEW_ROWS = True/' runtime/cuda_ops.py ;;
    *) echo "unknown switch $switch: exact, unroll=N or fused" >&2 && exit 2 ;;
    esac
  done
  grep -n "exact_verify_max_bucket: int\|^EXACT_ROWS_UNROLL\|^FUSE_FEW_ROWS" \
    runtime/cuda_runner.py runtime/cuda_ops.py
  cp .ggc/part.ac /tmp/gg/
  cat /tmp/gg/part.a? >/tmp/gg/model.gguf
  (cd /tmp/gg && sha256sum -c "$OLDPWD/.ggc/sha256") || exit 1
  python3 -m orbit prepare /tmp/gg/model.gguf --tp 1 --dtype bfloat16 --out /tmp/smol >/dev/null
  python3 -m benchmarks.speculation copy --package /tmp/smol --device cuda --spec-tokens 16 \
    --ngram-min 3 --rounds 4 --out "$OUT/copy" 2>&1 | tail -6
  ;;
*)
  echo "unknown call $1: exact, fuse or copy" >&2
  exit 2
  ;;
esac
