#!/usr/bin/env bash
# Flake hunt: run one tier of the suite (default e2e) RUNS times in a row, in parallel like CI, while a CPU hog
# keeps one core busy, then list every test that failed in any run with its failure count.
#
#   scripts/flake_hunt.sh [-r RUNS] [-m MARKEXPR] [-o OUTDIR] [PYTEST ARGS...]
#
#   -r RUNS      how many runs (default 5)
#   -m MARKEXPR  which tests (default e2e; e.g. "integration or e2e", or a -k/-path in PYTEST ARGS)
#   -o OUTDIR    where the runs' JUnit files, logs and summary.json go (default /tmp/nvrx-flake-hunt-<time>)
#
# Runs against this checkout (PYTHONPATH), like `scripts/test.sh --unit`: races are in the code, not the install.
# NVRX_TEST_WORKERS sets the parallel workers (default: the number of CPUs). Exit status: 0 when no run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
RUNS=5
MARK=e2e
OUT=/tmp/nvrx-flake-hunt-$(date +%Y%m%d-%H%M%S)
while getopts "r:m:o:" opt; do
    case $opt in
        r) RUNS=$OPTARG ;;
        m) MARK=$OPTARG ;;
        o) OUT=$OPTARG ;;
        *) echo "usage: scripts/flake_hunt.sh [-r RUNS] [-m MARKEXPR] [-o OUTDIR] [PYTEST ARGS...]" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
WORKERS=${NVRX_TEST_WORKERS:-$(nproc)}
PAR=()
if [ "$WORKERS" -gt 1 ]; then PAR=(-n "$WORKERS" --dist loadgroup); fi

# The hog: one busy process pinned to CPU 0, at normal priority, for the whole hunt; ended by its pid.
taskset -c 0 "$PYTHON" -c 'while True: pass' &
HOG=$!
trap 'kill "$HOG" 2>/dev/null || true' EXIT
echo "flake hunt: $RUNS runs of -m '$MARK' with $WORKERS workers, CPU hog pid $HOG on CPU 0; output in $OUT"

for i in $(seq 1 "$RUNS"); do
    t0=$(date +%s)
    set +e
    "$PYTHON" -m pytest -q -p no:cacheprovider -m "$MARK" "${PAR[@]}" --junitxml="$OUT/run-$i.xml" "$@" \
        >"$OUT/run-$i.log" 2>&1
    rc=$?
    set -e
    echo "run $i: exit $rc in $(( $(date +%s) - t0 )) s: $(tail -n 1 "$OUT/run-$i.log")"
done

"$PYTHON" - "$OUT" <<'EOF'
"""Per test: in how many runs it ran and failed (JUnit failure or error), with the first line of each failure."""
import json, sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

out = Path(sys.argv[1])
ran, failed, why = defaultdict(int), defaultdict(int), defaultdict(list)
files = sorted(out.glob("run-*.xml"))
for f in files:
    for case in ET.parse(f).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            continue
        ran[name] += 1
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failed[name] += 1
            why[name].append(f"{f.stem}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
summary = {"runs": len(files), "tests": len(ran), "failures": {n: {"failed": failed[n], "ran": ran[n], "why": why[n]}
                                                              for n in sorted(failed)}}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"{len(files)} runs, {len(ran)} tests, {sum(failed.values())} failures in {len(failed)} tests")
for n in sorted(failed, key=lambda n: -failed[n]):
    print(f"  {failed[n]}/{ran[n]}  {n}")
    for w in why[n]:
        print(f"         {w}")
sys.exit(1 if failed else 0)
EOF
