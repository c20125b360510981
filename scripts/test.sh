#!/usr/bin/env bash
# Fresh machine -> the whole test suite. Extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
