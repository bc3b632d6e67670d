#!/usr/bin/env bash
# Build, on a fresh checkout, what the device tool carries to the lent GPU machine, which has no
# network (../shared/gpu/README.md). Run from the repository root after deploy/install.sh:
#   bash benchmarks/gpu_kit.sh
# It writes (all git-ignored through .git/info/exclude):
#   .gpu/             the shared kit: FlashInfer, pyzmq, FastAPI, asyncssh, FlashInfer's JIT cache
#   .whl/             the official openai client, gguf and httptools (the API servers' HTTP
#                     parser: without it every API server exits at import), with what they
#                     need beyond the image and .gpu, and xgrammar (Python 3.12 wheels)
#   .gputok/          the SmolLM2 tokenizer, for packages built there (benchmarks.random_package)
#   .gga/ .ggb/ .ggc/ the SmolLM2-135M-Instruct GGUF in three parts (a call carries 64 MiB at
#                     most, the tree included), .ggc/sha256 the whole file's digest
# On the machine (benchmarks/NOTES-gpu.md has the calls): carry [".gpu", ".gputok", ".gga"],
# then [".ggb"], then [".ggc", ".whl"], each call copying its part.* to /tmp/gg; in the last,
#   cat /tmp/gg/part.a? > /tmp/gg/model.gguf && (cd /tmp/gg && sha256sum -c $OLDPWD/.ggc/sha256)
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in .gpu .whl .gputok .gga .ggb .ggc; do
  grep -qxF "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >>"$exclude"
done

rm -rf .gpu .whl .gputok .gga .ggb .ggc
mkdir -p .gpu .gga .ggb .ggc
cp ../shared/gpu/* .gpu/

# With their dependencies, less what the image or .gpu already has (numpy, pydantic, tqdm,
# pyyaml): a second copy of those ahead on the path would shadow the ones the image's torch and
# transformers were built with.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --implementation cp \
  -d .whl openai gguf httptools
rm -f .whl/numpy-* .whl/pydantic-* .whl/pydantic_core-* .whl/annotated_types-* \
  .whl/typing_inspection-* .whl/tqdm-* .whl/pyyaml-*
# The ranks build the grammar compiler at start-up and the image has no xgrammar; its other
# needs (torch, transformers, triton, apache-tvm-ffi, pydantic) are in the image or .gpu.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --implementation cp -d .whl xgrammar==0.2.9

gguf=$(python3 -c 'from orbit.default_model import default_gguf; print(default_gguf())')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m orbit prepare "$gguf" --tp 1 --dtype bfloat16 --out "$work/pkg" >/dev/null
cp -r "$work/pkg/tokenizer" .gputok

# Parts sized so that each call stays under 64 MiB with what it carries beside them.
dd if="$gguf" of=.gga/part.aa bs=1M count=19 status=none
dd if="$gguf" of=.ggb/part.ab bs=1M skip=19 count=60 status=none
dd if="$gguf" of=.ggc/part.ac bs=1M skip=79 status=none
cat .gga/part.aa .ggb/part.ab .ggc/part.ac | cmp - "$gguf"
echo "$(sha256sum <"$gguf" | cut -d' ' -f1)  model.gguf" >.ggc/sha256
du -sh .gpu .whl .gputok .gga .ggb .ggc
