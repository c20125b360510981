#!/usr/bin/env bash
# Fresh machine -> the whole test suite. Extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Real Slurm for tests/slurm. When it is installed (and usable: root), a test Slurm that does not come up
# fails the Slurm tests instead of skipping them (NVRX_REQUIRE_SLURM=1; export NVRX_REQUIRE_SLURM=0 to
# skip anyway). When it cannot be installed they skip, with the reason.
if INSTALL_SLURM_STRICT=1 scripts/install_slurm.sh; then
    export NVRX_REQUIRE_SLURM="${NVRX_REQUIRE_SLURM:-1}"
fi
exec "${PYTHON:-python3}" -m pytest -q "$@"
