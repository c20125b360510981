#!/usr/bin/env bash
# Fresh machine -> the whole test suite, run against nvrx as users install it; or the developer's inner loop.
#
#   scripts/test.sh [PYTEST ARGS...]             build the sdist and the wheel (the wheel from the sdist), install
#                                               the wheel with its declared test extras in a fresh venv
#                                               ($NVRX_TEST_VENV, default .venv-test/; torch pinned first), copy the
#                                               tests to a temp dir without the nvrx/ sources, run every tier there
#                                               on all cores (pytest-xdist)
#   scripts/test.sh --editable [PYTEST ARGS...]  the suite against `pip install -e .` in this Python (scripts/setup.sh)
#   scripts/test.sh --unit [PYTEST ARGS...]      inner loop: the unit tier against this checkout; no install, no Slurm
#   scripts/test.sh --quick PKG [PYTEST ARGS...] the unit + integration tests of nvrx package PKG (launcher, ckpt,
#                                               monitors, launcher.agent, ...) against this checkout; no install
#
# Tiers (unit, integration, e2e; tests/tiers.py) select with -m, e.g. `scripts/test.sh --editable -m e2e`.
# NVRX_TEST_WORKERS: parallel pytest workers (default: the number of CPUs; 1 runs serially).
# As root the full and --editable runs also install the Slurm the Slurm tests start (scripts/install_slurm.sh); a test
# Slurm that does not come up then fails those tests instead of skipping them (NVRX_REQUIRE_SLURM=0 to skip anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
TORCH_PIN="torch==2.13.0"
PIP_FLAGS=(--quiet --disable-pip-version-check)
PYTHON=${PYTHON:-python3}
quiet() {  # run "$@" showing its output only when it fails
    local log
    log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then cat "$log"; rm -f "$log"; return 1; fi
    rm -f "$log"
}

# -n N --dist loadgroup when pytest-xdist is there (a checkout's Python may predate it: then serially)
parallel_args() {
    local py=$1 workers=${NVRX_TEST_WORKERS:-$(nproc)}
    if [ "$workers" -gt 1 ] && "$py" -c 'import xdist' 2>/dev/null; then
        echo "-n $workers --dist loadgroup"
    fi
}

case "${1:-}" in
    --unit)
        shift
        export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
        # shellcheck disable=SC2046
        exec "$PYTHON" -m pytest -q -p no:cacheprovider -m unit $(parallel_args "$PYTHON") "$@"
        ;;
    --quick)
        [ $# -ge 2 ] || { echo "scripts/test.sh --quick PKG: name an nvrx package, e.g. --quick launcher" >&2; exit 2; }
        pkg=$2
        shift 2
        export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
        # shellcheck disable=SC2046
        exec "$PYTHON" -m pytest -q -p no:cacheprovider -m "unit or integration" --package "$pkg" \
            $(parallel_args "$PYTHON") "$@"
        ;;
esac

# Emulated hosts (tests/hosts.py) are network namespaces: as root make sure `ip` is there and require them,
# so that the partition tests fail here instead of skipping.
if [ "$(id -u)" = 0 ]; then
    command -v ip >/dev/null || { apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null; }
    export NVRX_REQUIRE_NETNS="${NVRX_REQUIRE_NETNS:-1}"
fi

if INSTALL_SLURM_STRICT=1 scripts/install_slurm.sh; then
    export NVRX_REQUIRE_SLURM="${NVRX_REQUIRE_SLURM:-1}"
fi
scripts/install_chromium.sh  # headless Chromium for the `nvrx inspect --html` browser test (skips with a reason if not)

if [ "${1:-}" = "--editable" ]; then
    shift
    scripts/setup.sh
    # shellcheck disable=SC2046
    exec "$PYTHON" -m pytest -q $(parallel_args "$PYTHON") "$@"
fi

VENV=${NVRX_TEST_VENV:-$REPO/.venv-test}
rm -rf "$VENV" dist
"$PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
quiet "$PY" -m pip install "${PIP_FLAGS[@]}" "$TORCH_PIN" build
quiet "$PY" -m build --outdir dist .            # sdist first, then the wheel built from the sdist
rm -rf build ./*.egg-info
WHEEL=$(ls dist/nvrx-*.whl)
# only what the wheel declares (the pin again: nothing in the extras may swap the CPU build)
quiet "$PY" -m pip install "${PIP_FLAGS[@]}" "${WHEEL}[test]" "$TORCH_PIN"

# The tests, scripts and benchmarks, without the package sources: `nvrx` can only come from the venv.
WORK=$(mktemp -d /tmp/nvrx-tests.XXXXXX)
tar --exclude=./nvrx --exclude=./.git --exclude=./dist --exclude=./.venv-test --exclude='__pycache__' -cf - . \
    | tar -xf - -C "$WORK"
cd "$WORK"
"$PY" -P -c 'import nvrx, sys; sys.exit(0 if "site-packages" in nvrx.__file__ else "nvrx is not the installed wheel: " + nvrx.__file__)'
export PATH="$VENV/bin:$PATH" NVRX_TEST_INSTALLED=1 NVRX_TEST_WHEEL="$REPO/$WHEEL"
echo "testing $WHEEL installed in $VENV, tests in $WORK"
# shellcheck disable=SC2046
exec "$PY" -m pytest -q $(parallel_args "$PY") "$@"
