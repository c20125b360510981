#!/usr/bin/env bash
# Auto-resume as a bash loop driven by `nvrx resume` exit statuses (docs/guides/slurm.md, "Auto-resume"):
#   0 finished -> stop   3 continue -> launch again (in a Slurm job: the continuation job was submitted)
#   4 give up  -> stop   other      -> usage error (2) or failed submission (1): stop
#
# usage: scripts/auto_resume.sh STATE_DIR LAUNCH_ARGS...
#   e.g. scripts/auto_resume.sh runs/gpt/resume --nproc-per-node 8 train.py --save runs/gpt/ckpt
#
# Outside Slurm it launches again until the run is finished or gives up. As a Slurm batch script
#   sbatch --signal=B:TERM@120 scripts/auto_resume.sh STATE_DIR LAUNCH_ARGS...
# each job runs one launch; unless the run finished or gave up, `nvrx resume --submit` submits this
# script again with --dependency=afterany:$SLURM_JOB_ID (plus --exclude=NODE after an exit 16).
# The TERM that Slurm sends 120 s before the time limit is passed to the launch once, so ranks can save.
#
# Environment: NVRX (the nvrx command, default "nvrx"); RESUME_ARGS (more nvrx resume flags, e.g.
# "--max-attempts 20 --max-failures 3 --checkpoint-dir runs/gpt/ckpt"); FAULT_TOL_FINISHED_FLAG_FILE
# (default STATE_DIR/finished.flag), which training marks with nvrx.launcher.rank.job_control.mark_finished().
#SBATCH --job-name=nvrx-auto-resume
#SBATCH --nodes=1
#SBATCH --open-mode=append

set -u
if [ $# -eq 0 ] && [ -n "${NVRX_AUTO_RESUME_ARGS:-}" ]; then
    eval "set -- $NVRX_AUTO_RESUME_ARGS"  # a continuation job: the arguments of the first one
fi
if [ $# -lt 2 ]; then
    echo "usage: $0 STATE_DIR LAUNCH_ARGS...  (e.g. $0 runs/x/resume --nproc-per-node 8 train.py)" >&2
    exit 2
fi
NVRX_AUTO_RESUME_ARGS="$(printf '%q ' "$@")"
export NVRX_AUTO_RESUME_ARGS  # sbatch hands this environment to the continuation job
state_dir=$1
shift
mkdir -p "$state_dir" || exit 2
export FAULT_TOL_FINISHED_FLAG_FILE="${FAULT_TOL_FINISHED_FLAG_FILE:-$state_dir/finished.flag}"
read -r -a nvrx <<< "${NVRX:-nvrx}"
read -r -a extra <<< "${RESUME_ARGS:-}"
# The launch's --log-dir (before the training script), so that after an exit 16 nvrx resume finds in the
# agents' logs which node to exclude (default: ./nvrx_logs, as nvrx launch's).
log_dir=()
prev=""
for arg in "$@"; do
    case $arg in
        *.py) break ;;
        --log-dir=*|--log_dir=*) log_dir=(--launch-log-dir "${arg#*=}") ;;
    esac
    if [ "$prev" = --log-dir ] || [ "$prev" = --log_dir ]; then
        log_dir=(--launch-log-dir "$arg")
    fi
    prev=$arg
done
submit=()
if [ -n "${SLURM_JOB_ID:-}" ]; then
    submit=(--submit --sbatch-script "$0")  # $0 is Slurm's copy of this script, readable while the job runs
fi

stopped=""
run_launch() {  # nvrx launch in the background, so that a signal to this shell can be passed on once
    "${nvrx[@]}" launch "$@" &
    local pid=$! rc
    trap 'stopped=1; kill -TERM "$pid" 2>/dev/null' TERM INT USR1 USR2
    wait "$pid"
    rc=$?
    while kill -0 "$pid" 2>/dev/null; do  # wait returned early because a trap ran
        wait "$pid"
        rc=$?
    done
    trap - TERM INT USR1 USR2
    return "$rc"
}

while true; do
    "${nvrx[@]}" resume --state-dir "$state_dir" --check "${extra[@]}"
    case $? in
        0) exit 0 ;;
        3) ;;
        4) exit 1 ;;
        *) exit 2 ;;
    esac
    run_launch "$@"
    rc=$?
    "${nvrx[@]}" resume --state-dir "$state_dir" --exit-code "$rc" "${log_dir[@]}" "${submit[@]}" "${extra[@]}"
    status=$?
    case $status in
        0) echo "auto_resume: training is finished" >&2; exit 0 ;;
        3) if [ -n "${SLURM_JOB_ID:-}" ]; then exit 0; fi  # the continuation job goes on
           if [ -n "$stopped" ]; then exit 3; fi ;;         # stopped by a signal: run again to resume
        4) echo "auto_resume: gave up (why: $state_dir/resume.jsonl)" >&2; exit 1 ;;
        *) echo "auto_resume: nvrx resume failed (exit $status)" >&2; exit "$status" ;;
    esac
done
