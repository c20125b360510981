#!/usr/bin/env bash
# Fresh machine -> a real 2-rank CPU/gloo job under `nvrx launch` with two faults: rank 1 crashes in
# the first attempt, rank 0 hangs in the second (caught by its rank monitor's automatic heartbeat).
# The job restarts in place each time, resumes from its newest checkpoint (ckpt.PeriodicCheckpointer,
# every 5 steps) and finishes; `nvrx inspect` then tells what happened.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
logdir=$(mktemp -d /tmp/nvrx-demo.XXXXXX)
echo "event logs and checkpoint in $logdir"
nvrx launch --nproc-per-node 2 --max-restarts 3 --log-dir "$logdir" --rdzv-id demo --async-ckpt \
  --ft-param-auto-heartbeat true --ft-param-rank-heartbeat-timeout 3 \
  scripts/demo_train.py --steps 60 --crash-at 25 --hang-at 45
echo
exec nvrx inspect "$logdir/demo"
