#!/usr/bin/env bash
# Fresh machine -> the whole test suite. Extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/install_slurm.sh  # real Slurm for tests/slurm (they skip, with the reason, if it cannot be installed)
exec "${PYTHON:-python3}" -m pytest -q "$@"
