#!/usr/bin/env bash
# Device calls of benchmarks/NOTES-gpu.md, one per argument, run from the repository root on
# the lent machine; results under $OUT (the device tool's folder). The copy-heavy SmolLM2 run
# needs the GGUF, whose three parts (benchmarks/gpu_kit.sh) fit only one to a call beside the
# kit, so three calls go back to back on one warm machine, each leaving its part in /tmp/gg:
#   carry [".gpu", ".gputok", ".gga", ".whl"]:  bash benchmarks/gpu_calls.sh serve
#   carry [".ggb"]:                              bash benchmarks/gpu_calls.sh part
#   carry [".ggc"]:                              bash benchmarks/gpu_calls.sh copy K [K ...]
# or, with device time for one call only, carry [".gpu", ".gputok", ".whl"]: gpu_calls.sh one
# (serve's tests alone).
# servecuda (carry the kit as for one): tests/gpu/test_serve_cuda.py, the exact test first.
# With little device time for the copy-heavy run: carry [".gpu", ".gputok", ".gga", ".whl"]:
# stage; carry [".ggb"]: stage; carry [".gpu", ".gputok", ".ggc", ".whl"]: copycap.
# prefix (carry the kit as for one): issue 18's cached-turn attention, FlashInfer against
# Orbit's split-context kernel, and its GPU test; short (the same): both new kernels where
# they decide and FP8 batch 64 with the fused graphs, in one call of about five minutes.
# tiles, profile, fp8profile, fp8 (carry the kit as for one): SmolLM2's few-rows tiles for the
# exact graphs (issue 19), the 8B's decode profile (issue 18), the kernels of the 8B's batch-64
# step with FP8 weights and with bf16, the FP8 tiles on this card (issue 20).
# httpab (carry .abold too: `git archive REV` of the code to compare), httpfp8, http16 (issues 16
# and 20 through HTTP: docs/performance.md, 2026-12-06), buckets dense|pow2 (issue 16: the
# prompt steps' graph padding, default token buckets against denser ones), chain (carry .spy,
# the py-spy wheel: where the host's time between two 256-row steps goes; NOTES-gpu.md).
# serve: the exact graphs bit for bit (SmolLM2's architecture, the head_dim-128 Llama) and
# `orbit serve --exact-verification` against the plain server, tracebacks in $OUT/tests.txt;
# part: the 8B's verification timed with the exact graphs; copy: the copy-heavy prompts with
# --exact-verification at each --spec-tokens K, SmolLM2's verification timed with the exact
# graphs, and the default ranks' copy-heavy run (the baseline without the flag).
set -uo pipefail
source .gpu/bootstrap.sh >/dev/null 2>&1
pip install -q --no-index --no-deps --target /tmp/site-whl .whl/*.whl >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site-whl:${PYTHONPATH:-} ORBIT_TEST_TOKENIZER=$PWD/.gputok
export PYTHONUNBUFFERED=1 ORBIT_GPU_REPORT=$OUT/report.jsonl
mkdir -p /tmp/gg
nvidia-smi --query-gpu=name --format=csv,noheader
# What orbit serve's processes import beyond the image: one missing (httptools, 2026-12-06)
# made every API server exit at start and cost two calls before anything said why.
python3 -c "
import importlib.util as u
names = 'flashinfer zmq fastapi uvicorn httptools uvloop asyncssh xgrammar gguf'.split()
for m in [m for m in names if u.find_spec(m) is None]:
    print(f'kit: no module {m} (benchmarks/gpu_kit.sh)')
"

# The last GGUF part (.ggc) joined to the two earlier calls left in /tmp/gg, checked, and
# prepared as SmolLM2's bf16 package in /tmp/smol.
smol_package() {
  cp .ggc/part.ac /tmp/gg/
  cat /tmp/gg/part.a? >/tmp/gg/model.gguf
  (cd /tmp/gg && sha256sum -c "$OLDPWD/.ggc/sha256") || exit 1
  python3 -m orbit prepare /tmp/gg/model.gguf --tp 1 --dtype bfloat16 --out /tmp/smol \
    --force >/dev/null
}

# Whether this card is an H200 (the card the issues name).
on_h200() {
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200
}

# serve's exact-verification end-to-end test, stopped by SIGINT after $1 s (pytest then still
# says what failed and why), into $OUT/tests-exact.txt.
exact_test() {
  pkill -f " -m ranks " || true
  timeout -s INT "$1" python3 -m pytest -v --tb=short -p no:cacheprovider \
    tests/gpu/test_serve_cuda.py -k exact_verification >"$OUT/tests-exact.txt" 2>&1
  pkill -f " -m ranks " || true
}

# The lines of gpu_serving.sh's output worth bringing back: the sweep's table, TTFT, errors.
sweep_lines() {
  grep -E "│|TTFT ms|rror|Trace|exited${1:-}" | tail -"${2:-12}"
}

# The random 8B with FP8 weights and KV pages at $1 unless it is there; prepare flags after it.
fp8kv_package() {
  local pkg=$1; shift
  [ -f "$pkg/manifest.pb" ] || timeout 300 python3 -m benchmarks.random_package --out "$pkg" \
    --max-batch 256 --quantize fp8 --kv-dtype fp8 "$@" --tokenizer "$ORBIT_TEST_TOKENIZER" 2>&1 \
    | tail -1
}

# The last level of a sweep report: its tokens/s, step figures, TTFT means and client share.
level_figures() {
  python3 -c "
import json, sys; l = json.load(open(sys.argv[1]))['levels'][-1]
print({k: v for k, v in l.items() if 'step' in k or 'ttft_mean' in k or k in ('output_tokens_per_s', 'client_busy_frac')})" "$1"
}

# The cached turn's step (64 new tokens after 2,048 cached) and TTFT(2,048), profiled, with the
# split-context graphs up to $1 tokens (0: off; none given: the runner's default), in $2 s.
cached_turn() {
  local name=decode-prefix${1:-default}
  date -u +"%T decode profile, split-context graphs up to ${1:-default} tokens (${SECONDS} s)"
  timeout "${2:-100}" python3 -m benchmarks.decode --out "$OUT/$name" --batches 1 \
    --prompts 2048 --hf-tokens 0 --profile ${1:+--prefix-attention-max-tokens $1} 2>&1 \
    | grep -E -A1 "rror|TTFT ms" | tail -4
  grep -h "cached:\|alone:" "$OUT/$name/profile.txt"
}

case "${1:?servecuda, stage, copycap, serve, part, copy, one, httpab, httpfp8, http16, trimab, coreab, http256, next, fused, onepass, prefixon, fusedrule, fusedcheck, fp8attn, prefix, short, rest, kv8, buckets, chain, tiles, profile, fp8profile or fp8}" in
one)  # with too little device time for three calls: serve's tests
  timeout -s INT 330 python3 -m pytest -v --tb=short -p no:cacheprovider \
    tests/gpu/test_cuda_runner.py tests/gpu/test_smollm2_arch.py tests/gpu/test_serve_cuda.py \
    -k "bit_for_bit or exact_verification" >"$OUT/tests.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|^E " "$OUT/tests.txt" | head -30
  ;;
servecuda)  # the exact end-to-end test alone (its cause prints now), then the rest of the file
  exact_test 230
  timeout -s INT 330 python3 -m pytest -v --tb=short -p no:cacheprovider \
    tests/gpu/test_serve_cuda.py -k "not exact_verification" >"$OUT/tests-rest.txt" 2>&1
  grep -hE "PASSED|FAILED|ERROR|^E " "$OUT"/tests-*.txt | head -40
  ;;
serve)
  cp .gga/part.aa /tmp/gg/
  # SIGINT, not SIGTERM, at the limit: pytest then still prints what failed and why
  timeout -s INT 500 python3 -m pytest -v --tb=short -p no:cacheprovider \
    tests/gpu/test_cuda_runner.py tests/gpu/test_smollm2_arch.py tests/gpu/test_serve_cuda.py \
    -k "bit_for_bit or exact_verification" >"$OUT/tests.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|^E " "$OUT/tests.txt" | head -30
  ;;
part)
  cp .ggb/part.ab /tmp/gg/
  python3 -m benchmarks.speculation verify --exact-verify-max-bucket 32 \
    --out "$OUT/verify-8b-exact" 2>&1 | tail -2
  ;;
copy)
  shift
  smol_package
  for k in "$@"; do
    python3 -m benchmarks.speculation copy --package /tmp/smol --device cuda --spec-tokens "$k" \
      --ngram-min 3 --rounds 3 --exact-verification --out "$OUT/copy-exact-k$k" 2>&1 | tail -1
  done
  python3 -m benchmarks.speculation verify --shape smollm2 --exact-verify-max-bucket 32 \
    --out "$OUT/verify-smollm2-exact" 2>&1 | tail -2
  # the default ranks on this machine, the baseline the exact ranks' speedup is also reported
  # against (their one-token steps keep the GEMV)
  timeout 150 python3 -m benchmarks.speculation copy --package /tmp/smol --device cuda \
    --spec-tokens 16 --ngram-min 3 --rounds 2 --out "$OUT/copy-default-k16" 2>&1 | tail -1
  ;;
stage)  # the GGUF's parts this call carries, into /tmp/gg for a later copycap on this machine
  cp .gg?/part.a? /tmp/gg/ 2>/dev/null
  ls /tmp/gg
  ;;
copycap)  # issue 19: the copy-heavy prompts, the exact ranks (their four-at-once steps now
  # capped to the exact graphs' 32 rows) against the default ranks, k = 16, two rounds each
  pkill -f " -m ranks " || true
  smol_package
  timeout 300 python3 -m benchmarks.speculation copy --package /tmp/smol --device cuda \
    --spec-tokens 16 --ngram-min 3 --rounds 2 --exact-verification --out "$OUT/copy-exact-k16" \
    2>&1 | tail -2
  pkill -f " -m ranks " || true
  timeout 200 python3 -m benchmarks.speculation copy --package /tmp/smol --device cuda \
    --spec-tokens 16 --ngram-min 3 --rounds 2 --out "$OUT/copy-default-k16" 2>&1 | tail -2
  ;;
httpab)  # issue 16 through HTTP: this tree (steps of >= 48 decode rows beside prompt chunks
  # replay FA2 prefill graphs) against the tree in .abold (`git archive 1dab0c9`: every mixed
  # step through FA3), then this tree again while the call has time; carry .abold as well
  pkill -f " -m ranks " || true
  export PART=http LEVELS=64,256 SWEEP_TIMEOUT=200
  for run in new old new2; do
    [ "$run" = new2 ] && [ "$SECONDS" -gt 400 ] && break
    date -u +"%T $run (${SECONDS} s)"
    dir=.; [ "$run" = old ] && dir=.abold
    (cd "$dir" && OUT=$OUT/$run bash benchmarks/gpu_serving.sh 2>&1 | sweep_lines)
    pkill -f " -m ranks " || true
  done
  ;;
httpfp8)  # issues 16 and 20 through HTTP: the 8B with FP8 weights (bf16 KV pages, then FP8),
  # then the bf16 package on this machine while the call has time
  pkill -f " -m ranks " || true
  export PART=http LEVELS=64,256 SWEEP_TIMEOUT=200
  date -u +"%T fp8 package (${SECONDS} s)"
  timeout 300 python3 -m benchmarks.random_package --out /tmp/orbit-8b-256-fp8 --max-batch 256 \
    --quantize fp8 --tokenizer "$ORBIT_TEST_TOKENIZER" 2>&1 | tail -1
  for run in fp8 fp8kv bf16; do
    [ "$run" = bf16 ] && [ "$SECONDS" -gt 330 ] && break
    date -u +"%T $run (${SECONDS} s)"
    pkg=/tmp/orbit-8b-256-fp8; args=""
    [ "$run" = fp8kv ] && args="--kv-dtype fp8"
    [ "$run" = bf16 ] && pkg=/tmp/orbit-8b-256
    PKG=$pkg SERVE_ARGS=$args OUT=$OUT/$run bash benchmarks/gpu_serving.sh 2>&1 \
      | sweep_lines
    pkill -f " -m ranks " || true
  done
  ;;
http16)  # issue 16 on this card: the 8B with FP8 weights and FP8 KV pages (the package's
  # choice) through HTTP, then its in-process and ranks-only figures (gpu_serving.sh's all),
  # then the bf16 package through HTTP while the call has time
  pkill -f " -m ranks " || true
  date -u +"%T fp8kv package (${SECONDS} s)"
  timeout 300 python3 -m benchmarks.random_package --out /tmp/orbit-8b-256-fp8kv --max-batch 256 \
    --quantize fp8 --kv-dtype fp8 --tokenizer "$ORBIT_TEST_TOKENIZER" 2>&1 | tail -1
  PKG=/tmp/orbit-8b-256-fp8kv PART=all LEVELS=64,256 REF_LEVELS=64,256 SWEEP_TIMEOUT=200 \
    CORE_TIMEOUT=150 STEP_TIMEOUT=150 OUT=$OUT/fp8kv bash benchmarks/gpu_serving.sh 2>&1 \
    | sweep_lines "|in-process|tok/s|tokens/s" 16
  pkill -f " -m ranks " || true
  if [ "$SECONDS" -lt 380 ]; then
    date -u +"%T bf16 (${SECONDS} s)"
    PART=http LEVELS=64,256 SWEEP_TIMEOUT=200 OUT=$OUT/bf16 bash benchmarks/gpu_serving.sh 2>&1 \
      | sweep_lines
  fi
  ;;
buckets)  # issue 16: what the prompt steps' graph padding costs. The 8B with FP8 weights and
  # KV pages prepared with the default token buckets (pow2: powers of two) or denser ones
  # (dense: `orbit prepare --prefill-buckets`, four a doubling from 512), through HTTP and in
  # process at 256 streams; one kind a call (`buckets dense`, then `buckets pow2` on the same
  # machine). Compare prompt_step_padding_frac, gpu_ms_per_prompt_step and the tokens/s.
  kind=${2:?buckets dense or buckets pow2}
  pkill -f " -m ranks " || true
  pkg=/tmp/orbit-8b-256-fp8kv; extra=()
  if [ "$kind" = dense ]; then
    pkg=$pkg-dense
    extra=(--prefill-buckets 16,32,64,128,256,384,512,640,768,896,1024,1280,1536,1792)
  fi
  date -u +"%T $kind package (${SECONDS} s)"
  fp8kv_package $pkg "${extra[@]}"
  PKG=$pkg PART=http LEVELS=256 SWEEP_TIMEOUT=200 OUT=$OUT/$kind bash benchmarks/gpu_serving.sh \
    2>&1 | sweep_lines
  level_figures "$OUT/$kind/sweep.json"
  pkill -f " -m ranks " || true
  PKG=$pkg PART=core LEVELS=256 CORE_TIMEOUT=150 OUT=$OUT/$kind bash benchmarks/gpu_serving.sh \
    2>&1 | grep -E "in-process|rror"
  ;;
trimab)  # issue 16: prompt chunks cut to a token bucket (this tree) against the tree in .abold
  # (`git archive 9b69f11~1`, steps padded to their bucket as before; carry .abold too), the 8B
  # with FP8 weights and KV through HTTP at 256 streams (and 64 for this tree first), then this
  # tree in process at 256 while the call has time (TRIM_LEVELS=256 and TRIM_CORE_BEFORE=0 for
  # a short call: the A/B at 256 alone)
  pkill -f " -m ranks " || true
  pkg=/tmp/orbit-8b-256-fp8kv
  date -u +"%T fp8kv package (${SECONDS} s)"
  fp8kv_package $pkg
  for run in new old; do
    date -u +"%T $run (${SECONDS} s)"
    dir=.; levels=${TRIM_LEVELS:-64,256}
    [ "$run" = old ] && dir=.abold && levels=256
    (cd "$dir" && PKG=$pkg PART=http LEVELS=$levels SWEEP_TIMEOUT=200 OUT=$OUT/$run \
      bash benchmarks/gpu_serving.sh 2>&1 | sweep_lines)
    level_figures "$OUT/$run/sweep.json"
    pkill -f " -m ranks " || true
  done
  if [ "$SECONDS" -lt "${TRIM_CORE_BEFORE:-470}" ]; then
    PKG=$pkg PART=core LEVELS=256 CORE_TIMEOUT=120 OUT=$OUT/new bash benchmarks/gpu_serving.sh \
      2>&1 | grep -E "in-process|rror"
  fi
  ;;
next)  # with little device time: on an H200, issue 16's target level (the FP8 8B through HTTP
  # at 256 streams, then in process); on an H100, coreab
  if on_h200; then
    pkg=/tmp/orbit-8b-256-fp8kv
    fp8kv_package $pkg
    PKG=$pkg PART=http LEVELS=256 SWEEP_TIMEOUT=200 OUT=$OUT/h200 bash benchmarks/gpu_serving.sh \
      2>&1 | sweep_lines
    level_figures "$OUT/h200/sweep.json"
    pkill -f " -m ranks " || true
    PKG=$pkg PART=core LEVELS=256 CORE_TIMEOUT=120 OUT=$OUT/h200 bash benchmarks/gpu_serving.sh \
      2>&1 | grep -E "in-process|rror"
  else
    bash "$0" coreab
  fi
  ;;
fused)  # issues 16 and 20: Orbit's one-kernel decode attention against FlashInfer's path at 8
  # to 64 rows and 512 to 4,096 tokens, over bf16 and FP8 pages: where the fused graphs should
  # stop (CudaRunnerOptions.fused_decode_max_bucket, fused_decode_max_context); each line's
  # tiles also hold the variants of benchmarks.kernels' PAGES_AHEAD_CONFIGS and ONE_PASS_CONFIGS
  timeout 400 python3 -m benchmarks.kernels --out "$OUT/kernels" --part decode --decode-kv \
    bf16,fp8 --decode-cases 8x512,16x512,32x512,64x512,8x2048,16x2048,64x2048,64x4096 2>&1 \
    | grep -E "^decode|rror"
  ;;
fusedrule)  # issues 16 and 20 (2026-12-07): the fused graphs for every decode bucket, and over
  # FP8 pages while a step's rows hold at most 65,536 tokens (CudaRunnerOptions): the kernels
  # where that rule decides, the GPU tests of the runner and of FP8 pages (both switches), then
  # bf16, FP8 weights and FP8 pages at batch 64 and 256 with every bucket fused against up to
  # 8 rows (the earlier default)
  date -u +"%T kernels (${SECONDS} s)"
  timeout 200 python3 -m benchmarks.kernels --out "$OUT/kernels" --part decode --decode-kv \
    bf16,fp8 --decode-cases 16x2048,32x1024,32x2048,64x1024,64x1536,128x512,128x1024,256x256,256x1024 \
    2>&1 | grep -E "^decode|rror"
  date -u +"%T tests (${SECONDS} s)"
  timeout -s INT 200 python3 -m pytest -q --tb=short -p no:cacheprovider \
    tests/gpu/test_cuda_runner.py tests/gpu/test_kv_fp8.py >"$OUT/tests.txt" 2>&1
  grep -E "passed|failed|^E |FAILED" "$OUT/tests.txt" | head -12
  for bucket in 256 8; do
    [ "$SECONDS" -gt "${FUSED_UNTIL:-420}" ] && break
    date -u +"%T batch 64 and 256, fused decode up to $bucket rows (${SECONDS} s)"
    timeout 170 python3 -m benchmarks.fp8 --out "$OUT/fp8-fused$bucket" --batches 64,256 \
      --prompts 128 --kv8 --kv-fraction 0.5 --fused-decode-max-bucket $bucket 2>&1 \
      | grep -E "speedup|\"(tokens_per_s|graph_replay_ms)|rror" | tail -40
  done
  ;;
onepass)  # after fused and prefix (2026-12-07 15:12 UTC): the one-pass merge on in both
  # kernels, the page list read ahead over FP8 pages, 512-token splits in the split-context
  # graphs: the kernels' GPU tests, the cached turn's step with the split-context graphs up to
  # 64 tokens against FA3, then fusedcheck's tests, then FP8 weights and pages at batch 64
  pkill -f " -m ranks " || true
  date -u +"%T kernel tests (${SECONDS} s)"
  timeout -s INT 120 python3 -m pytest -q --tb=short -p no:cacheprovider \
    tests/gpu/test_decode_attention.py tests/gpu/test_prefix_attention.py >"$OUT/kernels.txt" 2>&1
  grep -E "passed|failed|^E |FAILED" "$OUT/kernels.txt" | head -12
  cached_turn 0
  cached_turn 64
  FUSEDCHECK_UNTIL=0 bash "$0" fusedcheck
  if [ "$SECONDS" -lt "${ONEPASS_UNTIL:-380}" ]; then
    date -u +"%T fp8 batch 64 (${SECONDS} s)"
    timeout 150 python3 -m benchmarks.fp8 --out "$OUT/fp8" --batches 64 --prompts 128 --kv8 \
      2>&1 | grep -E "speedup|\"(tokens_per_s|graph_replay_ms)|rror" | tail -20
  fi
  ;;
h200one)  # one call with little device time (2026-12-07 18:30): on an H200, issue 16's target
  # level (next: the FP8 8B through HTTP at 256 streams, then in process), then issue 19's
  # batch 64 with speculation on against off and issue 18's whole benchmark while the call has
  # time; on an H100, the test that prefixon's limit cut
  if ! on_h200; then
    exact_test 200
    grep -hE "PASSED|FAILED|ERROR|^E " "$OUT/tests-exact.txt" | head -20
    exit 0
  fi
  bash "$0" next
  pkill -f " -m ranks " || true
  [ "$SECONDS" -lt 280 ] || exit 0
  date -u +"%T speculation batch 64 (${SECONDS} s)"
  bash "$0" rest64
  [ "$SECONDS" -lt 400 ] || exit 0
  date -u +"%T prefix cache (${SECONDS} s)"
  timeout 150 python3 -m benchmarks.prefix_cache --package /tmp/orbit-8b-256 --device cuda \
    --out "$OUT/prefix" 2>&1 | tail -8
  ;;
h200a)  # first of three calls on one machine (2026-12-07 17:50): carry [".gpu", ".gputok",
  # ".gga", ".whl"]; the GGUF's first part staged, serve's exact test (the one prefixon's 300 s
  # cut at 17:41), and on an H200 issue 19's verification step of the 8B
  cp .gga/part.aa /tmp/gg/
  exact_test 200
  grep -hE "PASSED|FAILED|ERROR|^E " "$OUT/tests-exact.txt" | head -20
  if on_h200; then
    timeout 200 python3 -m benchmarks.speculation verify --exact-verify-max-bucket 32 \
      --out "$OUT/verify-8b-exact" 2>&1 | tail -2
  fi
  ;;
h200b)  # second: carry [".ggb"]; the second part staged, issue 19's batch 64 with speculation
  # on against off
  cp .ggb/part.ab /tmp/gg/
  bash "$0" rest64
  ;;
rest64)  # rest's first part alone
  pkill -f " -m ranks " || true
  pkg=/tmp/orbit-8b-256
  [ -f $pkg/manifest.pb ] || timeout 200 python3 -m benchmarks.random_package --out $pkg \
    --max-batch 256 --tokenizer "$ORBIT_TEST_TOKENIZER" 2>&1 | tail -1
  timeout 200 python3 -m benchmarks.speculation batch --package $pkg --device cuda --users 64 \
    --out "$OUT/spec-batch64" 2>&1 | tail -3
  pkill -f " -m ranks " || true
  ;;
prefixon)  # after onepass (2026-12-07): the split-context graphs on by default (buckets up to
  # 64 tokens, one sequence, FA3's cards): the runner's and serve's GPU tests, then the cached
  # turn's step as the default runner takes it
  pkill -f " -m ranks " || true
  date -u +"%T tests (${SECONDS} s)"
  timeout -s INT 420 python3 -m pytest -v --tb=short -p no:cacheprovider \
    tests/gpu/test_cuda_runner.py tests/gpu/test_serve_cuda.py -k "not smollm2 and not draft" \
    >"$OUT/tests.txt" 2>&1
  grep -E "FAILED|ERROR|^E |passed|failed" "$OUT/tests.txt" | head -20
  pkill -f " -m ranks " || true
  cached_turn
  ;;
fusedcheck)  # after fusedrule (2026-12-07): the runner's and FP8 pages' GPU tests and the exact
  # graphs through orbit serve (the fused and exact graphs now share one workspace; over FP8
  # pages the fused graph also stops at 768 tokens), then issue 16's bf16 8B through HTTP, in
  # process and ranks-only at 64 and 256 streams with the fused graphs for every bucket
  # (170 s cut the last serve test on 2026-12-07: the three serve tests take about 150 s)
  date -u +"%T tests (${SECONDS} s)"
  timeout -s INT 320 python3 -m pytest -v --tb=short -p no:cacheprovider \
    tests/gpu/test_cuda_runner.py tests/gpu/test_kv_fp8.py tests/gpu/test_serve_cuda.py \
    -k "not smollm2 and not draft" >"$OUT/tests.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|^E |passed|failed" "$OUT/tests.txt" | head -40
  pkill -f " -m ranks " || true
  [ "$SECONDS" -gt "${FUSEDCHECK_UNTIL:-330}" ] && exit 0
  date -u +"%T bf16 through HTTP, in process, ranks-only (${SECONDS} s)"
  PART=all LEVELS=64,256 REF_LEVELS=64,256 SWEEP_TIMEOUT=170 CORE_TIMEOUT=120 STEP_TIMEOUT=100 \
    OUT=$OUT/bf16 bash benchmarks/gpu_serving.sh 2>&1 | sweep_lines "|in-process|tok/s|tokens/s" 16
  ;;
http256)  # issue 16 with little device time (about 200 s): 256 streams alone through HTTP, then
  # the same requests in process, in one call (the bf16 8B unless PKG names another)
  PART=http LEVELS=256 SWEEP_TIMEOUT=150 OUT=$OUT/http256 bash benchmarks/gpu_serving.sh 2>&1 \
    | sweep_lines
  pkill -f " -m ranks " || true
  PART=core LEVELS=256 CORE_TIMEOUT=100 OUT=$OUT/http256 bash benchmarks/gpu_serving.sh 2>&1 \
    | grep -E "in-process|rror"
  ;;
coreab)  # issue 16: the same requests in process at 256 streams, the tree in .abold (carry it)
  # and then this one, the 8B with FP8 weights and KV: did the cut to a token bucket change
  # what HTTP is compared with?
  pkill -f " -m ranks " || true
  pkg=/tmp/orbit-8b-256-fp8kv
  fp8kv_package $pkg
  for run in old new; do
    date -u +"%T $run (${SECONDS} s)"
    dir=.; [ "$run" = old ] && dir=.abold
    (cd "$dir" && PKG=$pkg PART=core LEVELS=${CORE_LEVELS:-256} CORE_TIMEOUT=120 OUT=$OUT/$run \
      bash benchmarks/gpu_serving.sh 2>&1 | grep -E "in-process|rror")
    pkill -f " -m ranks " || true
  done
  ;;
rest)  # issue 19's batch 64 with speculation on against off (the bf16 package, built here
  # unless http16 left it), issue 20's FP8 against bf16 (batch 1 and 64, TTFT(2,048); FP8
  # weights over FP8 pages too), then
  # the dense token buckets through HTTP at 256 streams (against http16's fp8kv level) while
  # the call has time
  pkill -f " -m ranks " || true
  pkg=/tmp/orbit-8b-256
  date -u +"%T speculation batch 64 (${SECONDS} s)"
  [ -f $pkg/manifest.pb ] || timeout 200 python3 -m benchmarks.random_package --out $pkg \
    --max-batch 256 --tokenizer "$ORBIT_TEST_TOKENIZER" 2>&1 | tail -1
  timeout 200 python3 -m benchmarks.speculation batch --package $pkg --device cuda --users 64 \
    --out "$OUT/spec-batch64" 2>&1 | tail -3
  pkill -f " -m ranks " || true
  date -u +"%T fp8 (${SECONDS} s)"
  timeout 240 python3 -m benchmarks.fp8 --out "$OUT/fp8" --batches 1,64 --prompts 2048 --kv8 2>&1 \
    | tail -25
  pkill -f " -m ranks " || true
  [ "$SECONDS" -lt 300 ] && bash "$0" buckets dense
  ;;
fp8attn)  # issue 20: Orbit's fused decode attention over FP8 pages with float16 products (new,
  # 2026-12-07; before, bf16 products: +12% on the FP8-pages batch-64 step) against FlashInfer's
  # path, the GPU tests of FP8 pages, then FP8 weights and pages against bf16 with the fused
  # graphs up to 64 rows and up to 8 (the default), each while the call has time
  date -u +"%T kernels (${SECONDS} s)"
  timeout 150 python3 -m benchmarks.kernels --out "$OUT/kernels" --part decode --decode-kv \
    fp8,bf16 --decode-cases 64x512,64x2048,64x4096,16x512,8x512,256x512 2>&1 | grep -E "^decode|rror"
  date -u +"%T tests (${SECONDS} s)"
  timeout -s INT 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kv_fp8.py \
    >"$OUT/tests.txt" 2>&1
  grep -E "passed|failed|^E |FAILED" "$OUT/tests.txt" | head -12
  for bucket in 64 8; do
    [ "$SECONDS" -gt "${FP8_UNTIL:-300}" ] && break
    date -u +"%T fp8, fused decode up to $bucket rows (${SECONDS} s)"
    timeout 170 python3 -m benchmarks.fp8 --out "$OUT/fp8-fused$bucket" --batches 1,64 \
      --prompts 2048 --kv8 --fused-decode-max-bucket $bucket 2>&1 \
      | grep -E "speedup|\"(tokens_per_s|graph_replay_ms|ttft_ms)|rror" | tail -40
  done
  ;;
short)  # with one short call: the two new kernels against FlashInfer where they decide (Orbit's
  # decode attention over FP8 pages at 64 x 512, issue 20; the cached turn's split-context
  # attention, issue 18), then FP8 weights and pages against bf16 at batch 64 with the fused
  # graphs up to 64 rows
  date -u +"%T kernels (${SECONDS} s)"
  timeout 100 python3 -m benchmarks.kernels --out "$OUT/kernels-decode" --part decode \
    --decode-kv fp8,bf16 --decode-cases 64x512,8x512 2>&1 | grep -E "^decode|rror"
  timeout 100 python3 -m benchmarks.kernels --out "$OUT/kernels-prefix" --part prefix \
    --prefix-cases 1x64x2112,4x64x2112,1x64x576 2>&1 | grep -E "^prefix|rror"
  date -u +"%T fp8, fused decode up to 64 rows (${SECONDS} s)"
  timeout 200 python3 -m benchmarks.fp8 --out "$OUT/fp8-fused64" --batches 64 --kv8 \
    --fused-decode-max-bucket 64 2>&1 | grep -E "speedup|\"(tokens_per_s|graph_replay_ms)|rror" \
    | tail -30
  ;;
prefix)  # issue 18: the cached turn's attention (64 new tokens over 2,112: FA3 took 35 µs a
  # layer on an H100, 2026-12-06, one CTA walking each head's context), FlashInfer's prefill
  # against Orbit's split-context kernel (new, 2026-12-07), over bf16 and FP8 pages, then its
  # GPU test against FlashInfer
  date -u +"%T prefix kernels (${SECONDS} s)"
  timeout 240 python3 -m benchmarks.kernels --out "$OUT/kernels" --part prefix --prefix-kv \
    bf16,fp8 2>&1 | grep -E "^prefix|rror"
  date -u +"%T tests (${SECONDS} s)"
  timeout -s INT 120 python3 -m pytest -q --tb=short -p no:cacheprovider \
    tests/gpu/test_prefix_attention.py >"$OUT/tests.txt" 2>&1
  grep -E "passed|failed|^E |FAILED" "$OUT/tests.txt" | head -12
  # the cached turn's whole step (and TTFT(2,048)) with the split-context graphs up to 256
  # tokens against the default (FA3), profiled; then the runner's GPU tests with them
  for max_tokens in 0 256; do
    [ "$SECONDS" -gt "${PREFIX_UNTIL:-330}" ] && break
    cached_turn $max_tokens 150
  done
  if [ "$SECONDS" -lt 450 ]; then
    timeout -s INT 140 python3 -m pytest -q --tb=short -p no:cacheprovider \
      tests/gpu/test_cuda_runner.py -k "split_context or prefill_graphs" >"$OUT/runner.txt" 2>&1
    grep -E "passed|failed|^E |FAILED" "$OUT/runner.txt" | head -12
  fi
  ;;
kv8)  # issue 20: decode attention over FP8 pages, FlashInfer's CUDA-core kernel against its
  # tensor-core one (bf16 pages beside them), then the FP8 weights over FP8 pages with each
  # against bf16 (benchmarks.fp8 --kv8)
  date -u +"%T attention (${SECONDS} s)"
  timeout 240 python3 -m benchmarks.kernels --out "$OUT/kernels" --part attention \
    --batches 64,256 --attention-contexts 512,4096 --attention-kv bf16,fp8 \
    --variants tc-fa2,fa2-cudacore 2>&1 | grep -E "^attention|rror"
  date -u +"%T fp8 (${SECONDS} s)"
  timeout 300 python3 -m benchmarks.fp8 --out "$OUT/fp8" --batches 1,64 --prompts 2048 --kv8 \
    2>&1 | grep -E "^(bf16|fp8)|speedup|\"(tokens_per_s|graph_replay_ms|ttft_ms)|rror" | tail -60
  ;;
chain)  # issue 16: where the host's per-step chain goes at 256 decode rows (FP8 weights and KV
  # pages; on an H100 the GPU step was the 12.6 ms interval, the chain 1.6 ms, 2026-12-06 15:48):
  # py-spy (carry .spy, its wheel) on rank 0, busy and idle, and on the engine's process
  pkill -f " -m ranks " || true
  pip install -q --no-index --no-deps --target /tmp/spy .spy/*.whl >/dev/null 2>&1
  spy=/tmp/spy/bin/py-spy; pkg=/tmp/orbit-8b-256-fp8kv; mkdir -p "$OUT/chain"
  fp8kv_package $pkg
  python3 -m benchmarks.step_overhead --package $pkg --device cuda --prompt-tokens 512 \
    --new-tokens 1024 --batch 256 --out "$OUT/chain" >"$OUT/chain/so.log" 2>&1 &
  bench=$!
  for _ in $(seq 120); do rank=$(pgrep -f " -m ranks " | head -1); [ -n "$rank" ] && break; sleep 0.5; done
  # Sample the steps, not the start-up: a 45 s window from the rank's start held only its load
  # and capture (2026-12-06). Wait for the GPU to be busy (the decode of 1,024 tokens at 256
  # rows lasts about 16 s on an H100).
  for _ in $(seq 360); do
    busy=$(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits | head -1)
    [ "${busy:-0}" -ge 50 ] && break; sleep 0.5
  done
  date -u +"%T rank $rank, engine $bench, GPU ${busy}% busy"
  $spy record -p "$rank" --rate 250 --format raw --nonblocking -o "$OUT/chain/rank.raw" -d 10 >/dev/null 2>&1 &
  $spy record -p "$rank" --rate 250 --format raw --nonblocking --idle -o "$OUT/chain/rank-idle.raw" -d 10 >/dev/null 2>&1 &
  $spy record -p "$bench" --rate 250 --format raw --nonblocking -o "$OUT/chain/core.raw" -d 10 >/dev/null 2>&1 &
  wait "$bench"; wait
  tail -2 "$OUT/chain/so.log"
  python3 -m benchmarks.host_step --rows 256  # the same parts without a model, on this host's CPU
  # the same decode with at most two steps in flight, as before 2026-12-06's third
  timeout 200 python3 -m benchmarks.step_overhead --package $pkg --device cuda --prompt-tokens 512 \
    --new-tokens 512 --batch 256 --two-ahead 2>&1 | tail -1
  timeout 200 python3 -m benchmarks.step_overhead --package $pkg --device cuda --prompt-tokens 512 \
    --new-tokens 512 --batch 256 2>&1 | tail -1
  for f in rank rank-idle core; do
    python3 -m benchmarks.spy_summary "$OUT/chain/$f.raw" --within Engine._loop --top 30 2>&1 | head -32
    python3 -m benchmarks.spy_summary "$OUT/chain/$f.raw" --within Rank.serve --top 40 2>&1 | head -42
  done | grep -v "samples within" | cut -c1-140
  ;;
tiles)  # SmolLM2's few-rows tiles swept, then its exact steps with the rule's and the best
  pkill -f " -m ranks " || true  # a cut run's ranks would hold the GPU's memory
  timeout 240 python3 -m benchmarks.kernels --part fewsmall --out "$OUT/fewsmall" 2>&1 \
    | grep -v "^  "
  for tiles in "" "$OUT/fewsmall/few_small_tiles.json"; do
    timeout 120 python3 -m benchmarks.speculation verify --shape smollm2 \
      --exact-verify-max-bucket 32 ${tiles:+--few-tiles "$tiles"} 2>&1 | tail -2
  done
  ;;
profile)  # issue 18: where the cached turn's 64-token step spends its time
  pkill -f " -m ranks " || true
  timeout 200 python3 -m benchmarks.decode --out "$OUT/decode-profile" --batches 1,64 \
    --prompts 2048 --hf-tokens 0 --profile 2>&1 | tail -4
  # FA2's prefill splits the cached context over CTAs where FA3's gives it 1/132 of the GPU
  timeout 200 python3 -m benchmarks.decode --out "$OUT/decode-profile-fa2" --batches 1 \
    --prompts 2048 --hf-tokens 0 --profile --prefill-backend fa2 2>&1 | tail -4
  grep -h "cached:\|alone:" "$OUT"/decode-profile*/profile.txt
  ;;
fp8profile)  # issue 20: where batch 64's step goes with FP8 weights against bf16 (1.19x)
  pkill -f " -m ranks " || true
  timeout 400 python3 -m benchmarks.fp8 --out "$OUT/fp8-profile" --batches 64 --profile 2>&1 \
    | grep -E "speedup|tokens_per_s" | head -8
  ;;
fp8)  # issue 20: the FP8 tiles on this card
  pkill -f " -m ranks " || true
  timeout 200 python3 -m benchmarks.fp8_gemv tiles --out "$OUT/fp8-tiles" 2>&1 | tail -4
  ;;
*)
  echo "unknown call $1: servecuda, stage, copycap, serve, part, copy, one, httpab, httpfp8, http16, trimab, coreab, http256, next, fused, onepass, prefixon, fusedrule, fusedcheck, fp8attn, prefix, short, rest, kv8, buckets, chain, tiles, profile, fp8profile or fp8" >&2
  exit 2
  ;;
esac
