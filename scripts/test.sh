#!/usr/bin/env bash
# Installs everything the test suite needs (Debian packages included) and runs the whole suite; its
# arguments go to pytest (`bash scripts/test.sh tests/unit`: the unit tests alone, see README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# redis-server: the Redis tier's tests start their own. g++: builds the C++ kernels (without it their
# tests skip and the engine falls back to torch, so CI would not test the paths users run).
# chromium: the live page's browser test loads /dashboard in it, headless. prometheus: its promtool
# parses every Grafana dashboard's PromQL (only promtool is used; installed without recommends).
NEED=()
command -v redis-server >/dev/null 2>&1 || NEED+=(redis-server)
command -v g++ >/dev/null 2>&1 || NEED+=(g++)
command -v chromium >/dev/null 2>&1 || NEED+=(chromium)
if [ ${#NEED[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${NEED[@]}" >/dev/null
fi
if ! command -v promtool >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  [ ${#NEED[@]} -gt 0 ] || $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
bash scripts/install.sh test
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q -p no:cacheprovider --durations=30 "$@"
