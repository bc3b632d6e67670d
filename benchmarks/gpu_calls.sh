#!/usr/bin/env bash
# Device calls of benchmarks/NOTES-gpu.md, one per argument, run from the repository root on
# the lent machine; results under $OUT (the device tool's folder). The copy-heavy SmolLM2 run
# needs the GGUF, whose three parts (benchmarks/gpu_kit.sh) fit only one to a call beside the
# kit, so three calls go back to back on one warm machine, each leaving its part in /tmp/gg:
#   carry [".gpu", ".gputok", ".gga", ".whl"]:  bash benchmarks/gpu_calls.sh serve
#   carry [".ggb"]:                              bash benchmarks/gpu_calls.sh part
#   carry [".ggc"]:                              bash benchmarks/gpu_calls.sh copy [tiles] K [K ...]
# or, with device time for one call only, carry [".gpu", ".gputok", ".whl"]: gpu_calls.sh one.
# serve: the exact graphs bit for bit both ways (cuda_ops.EXACT_ROWS_BY gemv, tiles) on the
# head_dim-128 Llama and `orbit serve --exact-verification` against the plain server; part:
# the 8B's verification timed with the tiles; copy: the copy-heavy prompts with
# --exact-verification at each --spec-tokens K, the rows by the tiles when the first argument
# says so (set in the machine's copy of the tree: the ranks read the code's default), then
# SmolLM2's verification timed with the tiles.
set -uo pipefail
source .gpu/bootstrap.sh >/dev/null 2>&1
pip install -q --no-index --no-deps --target /tmp/site-whl .whl/*.whl >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site-whl:${PYTHONPATH:-} ORBIT_TEST_TOKENIZER=$PWD/.gputok
export PYTHONUNBUFFERED=1 ORBIT_GPU_REPORT=$OUT/report.jsonl
mkdir -p /tmp/gg
nvidia-smi --query-gpu=name --format=csv,noheader

case "${1:?serve, part, copy or one}" in
one)  # with too little device time for three calls: serve's tests and part's timing
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_runner.py \
    tests/gpu/test_serve_cuda.py -k "bit_for_bit or exact_verification" 2>&1 | tail -3
  timeout 150 python3 -m benchmarks.speculation verify --exact-verify-max-bucket 32 \
    --exact-rows-by tiles --out "$OUT/verify-8b-tiles" 2>&1 | tail -2
  ;;
serve)
  cp .gga/part.aa /tmp/gg/
  timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_runner.py \
    tests/gpu/test_serve_cuda.py -k "bit_for_bit or exact_verification" 2>&1 | tail -3
  ;;
part)
  cp .ggb/part.ab /tmp/gg/
  python3 -m benchmarks.speculation verify --exact-verify-max-bucket 32 --exact-rows-by tiles \
    --out "$OUT/verify-8b-tiles" 2>&1 | tail -2
  ;;
copy)
  shift
  if [ "${1:-}" = tiles ]; then
    sed -i 's/^EXACT_ROWS_BY = "gemv"$/EXACT_ROWS_BY = "tiles"/' runtime/cuda_ops.py
    shift
  fi
  grep -n "^EXACT_ROWS_BY" runtime/cuda_ops.py
  cp .ggc/part.ac /tmp/gg/
  cat /tmp/gg/part.a? >/tmp/gg/model.gguf
  (cd /tmp/gg && sha256sum -c "$OLDPWD/.ggc/sha256") || exit 1
  python3 -m orbit prepare /tmp/gg/model.gguf --tp 1 --dtype bfloat16 --out /tmp/smol \
    --force >/dev/null
  for k in "$@"; do
    python3 -m benchmarks.speculation copy --package /tmp/smol --device cuda --spec-tokens "$k" \
      --ngram-min 3 --rounds 3 --exact-verification --out "$OUT/copy-exact-k$k" 2>&1 | tail -1
  done
  python3 -m benchmarks.speculation verify --shape smollm2 --exact-verify-max-bucket 32 \
    --exact-rows-by tiles --out "$OUT/verify-smollm2-tiles" 2>&1 | tail -2
  ;;
*)
  echo "unknown call $1: serve, part, copy or one" >&2
  exit 2
  ;;
esac
