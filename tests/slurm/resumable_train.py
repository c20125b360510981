"""A training loop that survives being stopped: copy its structure into your own script.

Run it with nvrx/slurm/templates/auto_resume.sbatch (the Slurm tests and bench/bench_slurm.py do):

    NVRX_EXAMPLE_SCRIPT=resumable_train.py NVRX_EXAMPLE_ARGS="--ckpt-dir $PWD/ckpt --steps 500" \\
        NVRX_STATE_DIR=$PWD/resume sbatch auto_resume.sbatch

What it shows:
  * resume: at start every rank loads the newest checkpoint (``ckpt-dir/step-N``, N = steps done) and
    continues at step N; without one it starts at step 0;
  * graceful stop: ``job_control.should_stop(step)`` after every step. When the job gets SIGTERM
    (``scancel --signal=TERM``, ``#SBATCH --signal=TERM@120``, preemption) all ranks agree on one step,
    save there and exit 0; the agent then exits 143 ("interrupted, resume me") and ``nvrx resume``
    submits the continuation job;
  * the end: ``job_control.mark_finished()`` once the last step is done, which ends the chain.

The "model" is a small tensor updated by an all-reduce each step, so the final value proves that no
step was lost or repeated across jobs: weights == steps * (1 + 2 + ... + world) on every element.
A checkpoint is one JSON file written by rank 0 to a temp name and renamed (atomic); the name
``step-N`` also tells ``nvrx resume --checkpoint-dir`` how far the run got.
``--journal DIR`` appends one JSON line per event and rank to DIR/rank-R.jsonl (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx.launcher.rank import job_control
CKPT_NAME = re.compile(r"^step-(\d+)$")


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint with the most steps done, if any."""
    found = [(int(m.group(1)), p) for p in ckpt_dir.glob("step-*") if (m := CKPT_NAME.match(p.name))]
    return max(found)[1] if found else None


def load(ckpt_dir: Path, size: int) -> tuple[int, torch.Tensor]:
    """(steps done, weights) from the newest checkpoint, or a fresh start."""
    path = latest_checkpoint(ckpt_dir)
    if path is None:
        return 0, torch.zeros(size)
    state = json.loads(path.read_text())
    return state["steps_done"], torch.tensor(state["weights"])


def save(ckpt_dir: Path, steps_done: int, weights: torch.Tensor) -> None:
    """Rank 0 publishes step-N atomically (temp file, fsync, rename) and drops older checkpoints;
    the barrier makes every rank wait until it is on disk."""
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        final = ckpt_dir / f"step-{steps_done}"
        tmp = ckpt_dir / f".step-{steps_done}.tmp"
        with tmp.open("w") as fh:
            json.dump({"steps_done": steps_done, "weights": weights.tolist()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        for old in ckpt_dir.glob("step-*"):
            if old != final and CKPT_NAME.match(old.name):
                old.unlink()
    dist.barrier()


class Journal:
    """One JSON line per event of this rank (only with --journal)."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.path = directory / f"rank-{rank}.jsonl" if directory else None
        self.base = {"rank": rank, "job": os.environ.get("SLURM_JOB_ID"), "node": os.environ.get("SLURMD_NODENAME")}

    def write(self, event: str, **fields) -> None:
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps({"event": event, "t": time.time(), **self.base, **fields}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", type=Path, required=True, help="where checkpoints go (shared by all jobs)")
    ap.add_argument("--steps", type=int, default=100, help="training steps in total")
    ap.add_argument("--step-time", type=float, default=0.1, help="seconds of pretend compute per step")
    ap.add_argument("--journal", type=Path, help="append events to DIR/rank-R.jsonl")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    journal = Journal(args.journal, rank)
    start, weights = load(args.ckpt_dir, size=4)
    journal.write("start", step=start, world=world)
    if rank == 0:
        print(f"starting at step {start} of {args.steps} (world size {world})", flush=True)

    for step in range(start, args.steps):
        time.sleep(args.step_time)  # the forward/backward pass
        update = torch.full_like(weights, float(rank + 1))
        dist.all_reduce(update)  # the gradient all-reduce
        weights += update
        journal.write("step", step=step)
        if job_control.should_stop(step):  # True on every rank at the same step
            save(args.ckpt_dir, step + 1, weights)
            why = getattr(job_control.stop_signal(), "name", "a stop request")
            journal.write("stopped", step=step, signal=why)
            if rank == 0:
                print(f"stopped after step {step} ({why}); checkpoint saved", flush=True)
            break
    else:
        save(args.ckpt_dir, args.steps, weights)
        journal.write("finished", step=args.steps - 1, weights=weights.tolist())
        if rank == 0:
            job_control.mark_finished()
            print(f"finished all {args.steps} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
