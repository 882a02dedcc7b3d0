#!/usr/bin/env bash
# Installs everything the test suite needs (Debian packages included) and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
bash scripts/install.sh test
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
