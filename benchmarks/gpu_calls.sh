#!/usr/bin/env bash
# Device calls of benchmarks/NOTES-gpu.md, one per argument, run from the repository root on
# the lent machine; results under $OUT (the device tool's folder). The copy-heavy SmolLM2 run
# needs the GGUF, whose three parts (benchmarks/gpu_kit.sh) fit only one to a call beside the
# kit, so three calls go back to back on one warm machine, each leaving its part in /tmp/gg:
#   carry [".gpu", ".gputok", ".gga", ".whl"]:  bash benchmarks/gpu_calls.sh serve
#   carry [".ggb"]:                              bash benchmarks/gpu_calls.sh part
#   carry [".ggc"]:                              bash benchmarks/gpu_calls.sh copy K [K ...]
# serve: `orbit serve --exact-verification` against the plain server (tests/gpu); copy: the
# copy-heavy prompts with --exact-verification at each --spec-tokens K.
set -uo pipefail
source .gpu/bootstrap.sh >/dev/null 2>&1
pip install -q --no-index --no-deps --target /tmp/site-whl .whl/*.whl >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site-whl:${PYTHONPATH:-} ORBIT_TEST_TOKENIZER=$PWD/.gputok
export PYTHONUNBUFFERED=1 ORBIT_GPU_REPORT=$OUT/report.jsonl
mkdir -p /tmp/gg
nvidia-smi --query-gpu=name --format=csv,noheader

case "${1:?serve, part or copy}" in
serve)
  cp .gga/part.aa /tmp/gg/
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_serve_cuda.py \
    -k exact_verification 2>&1 | tail -3
  ;;
part)
  cp .ggb/part.ab /tmp/gg/
  ;;
copy)
  cp .ggc/part.ac /tmp/gg/
  cat /tmp/gg/part.a? >/tmp/gg/model.gguf
  (cd /tmp/gg && sha256sum -c "$OLDPWD/.ggc/sha256") || exit 1
  python3 -m orbit prepare /tmp/gg/model.gguf --tp 1 --dtype bfloat16 --out /tmp/smol \
    --force >/dev/null
  for k in "${@:2}"; do
    python3 -m benchmarks.speculation copy --package /tmp/smol --device cuda --spec-tokens "$k" \
      --ngram-min 3 --rounds 3 --exact-verification --out "$OUT/copy-exact-k$k" 2>&1 | tail -1
  done
  ;;
*)
  echo "unknown call $1: serve, part or copy" >&2
  exit 2
  ;;
esac
