"""A 2-rank gloo training loop under the re-run state machine, for tests/rerun (run under `nvrx launch`).

usage: train_rerun.py WORKDIR INJECT [STEPS]
INJECT: none | node (rank 0's loss is NaN once at step 1: a transient fault; then NaN at step 3 on rank 1
whenever it runs on the emulated node nvrx-n1) | deterministic (the same, but the NaN at step 3 wherever
rank 1 runs).

Each step draws its batch (a function of rank and step, so a resumed job can start at any step) and a
dropout mask from the global RNG. The state (model, step, machine) is saved with `nvrx.ckpt` only when the
machine asks for it. Writes WORKDIR/weights.json (rank 0: the final weights as float.hex) and
WORKDIR/loss-<node>-<n>.json (rank 1: the clean loss of step 3 each time it is computed, as float.hex).
With RERUN_GATE=PATH the ranks wait before step 3 until PATH exists.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nvrx import ckpt
from nvrx.launcher.rank.rerun import RerunDataIterator, RerunStateMachine, is_nan_or_inf

BAD_STEP = 3
GLITCH_STEP = 1


def batches(rank: int, start: int):
    """Step k's batch: the same on every run, so a resumed loader starts at any step."""
    k = start
    while True:
        yield torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * rank + k))
        k += 1


def main() -> None:
    work, inject = Path(sys.argv[1]), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)  # the same initial model on every rank
    model = torch.nn.Linear(8, 1)
    torch.manual_seed(100 + rank)  # the ranks' dropout masks differ
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rsm = RerunStateMachine(mode=os.environ.get("RERUN_MODE", "validate_results"))
    state = {"model": model, "meta": {"step": 0}, "rerun": rsm}
    ckpt.resume(work / "ckpts", state)
    start = state["meta"]["step"]
    data = RerunDataIterator(batches(rank, start))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # as the re-run machine names it
    glitched = []
    gate = os.environ.get("RERUN_GATE")
    for step in range(start, steps):
        state["meta"]["step"] = step
        while gate and step == BAD_STEP and not os.path.exists(gate):
            time.sleep(0.05)                     # the test starts the standby agent before the bad step
        while rsm.should_run_forward_backward(data):
            opt.zero_grad()
            x = next(data)
            loss = (model(F.dropout(x, 0.3)) ** 2).mean()
            if inject != "none" and rank == 0 and step == GLITCH_STEP and not glitched:
                glitched.append(step)            # once per process: the in-place re-run does not see it
                loss = loss * float("nan")
            if rank == 1 and step == BAD_STEP:
                n = len(list(work.glob(f"loss-{node}-*.json")))
                (work / f"loss-{node}-{n}.json").write_text(json.dumps(loss.item().hex()))
                if (inject == "node" and node == "nvrx-n1") or inject == "deterministic":
                    loss = loss * float("nan")
            rsm.validate_result(loss, is_nan_or_inf, "loss is NaN or Inf", fatal=True)
            loss.backward()
        rsm.maybe_checkpoint_and_exit(state, work / "ckpts" / f"step_{step:04d}")
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    if rank == 0:
        flat = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        (work / "weights.json").write_text(json.dumps({"weights": [v.hex() for v in flat],
                                                        "transient_errors": rsm.transient_errors,
                                                        "verdicts": [v["diagnosis"] for v in rsm.verdicts]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
