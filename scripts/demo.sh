#!/usr/bin/env bash
# Fresh machine -> a real 2-rank CPU/gloo job under `nvrx launch`, where rank 1 crashes once
# and the job restarts in place, resumes from its checkpoint and finishes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
logdir=$(mktemp -d /tmp/nvrx-demo.XXXXXX)
echo "event logs and checkpoint in $logdir"
exec nvrx launch --nproc-per-node 2 --max-restarts 3 --log-dir "$logdir" --rdzv-id demo \
  scripts/demo_train.py --steps 60 --crash-at 25
