#!/usr/bin/env bash
# Install nvrx and what it needs on a fresh machine (idempotent).
# The CPU build of torch is pinned and installed first: an open torch requirement
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
# The pin is repeated so that nothing in the test extras (lightning needs torch) can swap the CPU build.
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]" "torch==2.13.0"
