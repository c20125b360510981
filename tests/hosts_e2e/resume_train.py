"""A rank of a job that `nvrx resume` continues: real gloo training that checkpoints with nvrx.ckpt.

Run as ``resume_train.py OUT STEPS``. The "model" is one parameter that every step adds the all-reduced
world size to (SGD, lr 1), so after STEPS steps it holds STEPS * world everywhere, however often the job was
stopped and resumed, exactly when each resume loaded a checkpoint whose steps match its state. Checkpoints:
``OUT/ckpts`` every 5 steps (``PeriodicCheckpointer``). Each start writes ``OUT/start-<launch>-<rank>.json``
(the newest complete checkpoint it saw, the step it resumed at); ``OUT/running.<rank>.<launch>`` holds the pid
while it trains; at the end rank 0 writes ``OUT/final.json`` and marks the run finished (``nvrx resume``'s flag).
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

from nvrx import ckpt
from nvrx.launcher.rank import job_control


def record(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    step_time = float(os.environ.get("FAULT_STEP_TIME", "0.05"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    launch = os.environ.get("NVRX_LAUNCH", "none")
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    saver = ckpt.PeriodicCheckpointer(out / "ckpts", model=model, optimizer=opt, every_steps=5)
    newest = ckpt.find_latest_checkpoint(out / "ckpts")
    start = saver.resume()
    record(out / f"start-{launch}-{rank}.json", {"start": start, "newest": newest.path.name if newest else None,
                                                 "w": model.w.detach().tolist(), "world": world,
                                                 "host": socket.gethostname(), "rank": rank})
    (out / f"running.{rank}.{launch}").write_text(str(os.getpid()))
    for step in range(start, steps):
        time.sleep(step_time)
        grad = torch.ones(4)
        dist.all_reduce(grad)
        model.w.grad = -grad
        opt.step()
        saver.step(step)
    saver.close()
    dist.barrier()
    if rank == 0:
        record(out / "final.json", {"w": model.w.detach().tolist(), "world": world, "steps": steps})
        job_control.mark_finished()


if __name__ == "__main__":
    main()
