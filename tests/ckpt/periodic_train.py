"""A rank under `nvrx launch --async-ckpt` training with ``nvrx.ckpt.PeriodicCheckpointer`` (every 5 steps).

usage: periodic_train.py OUT STEPS CRASH_AT [EVERY_SECONDS]   (CRASH_AT < 0: no crash; EVERY_SECONDS: save by
time instead of every 5 steps)

Attempt 0, at step CRASH_AT: the pending saves are published (``wait``), one more save is started and left
unpublished (on the checkpointer directly: no publishing thread), both ranks meet at a barrier (no publish can be in progress after it), rank 1 records the newest
complete checkpoint and kills itself with SIGKILL. Every attempt records the step it resumed at;
rank 0 writes the final parameters so a crashed run can be compared with a fault-free one.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_state_dict

from nvrx import ckpt
from nvrx.ckpt.periodic import STEP_KEY

ZERO_STEPS = []  # optimizers torch had to initialise with a zero step (the resume should spare it that)
_init_optim_state = dcp_state_dict._init_optim_state


def _counting_init(optim: torch.optim.Optimizer) -> None:
    if not optim.state:
        ZERO_STEPS.append(1)
    _init_optim_state(optim)


dcp_state_dict._init_optim_state = _counting_init


def record(out: str, name: str, payload: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(payload, fh)
    os.replace(tmp, os.path.join(out, name))


def main() -> None:
    out, steps, crash_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    pace = {"every_seconds": float(sys.argv[4])} if len(sys.argv) > 4 else {"every_steps": 5}
    saver = ckpt.PeriodicCheckpointer(os.path.join(out, "ckpts"), model=model, optimizer=opt, **pace)
    newest = ckpt.find_latest_checkpoint(os.path.join(out, "ckpts"))  # what resume() must load
    start = saver.resume()
    record(out, f"start-a{attempt}-r{rank}.json", {"start": start, "zero_steps": len(ZERO_STEPS),
                                                   "newest": newest.path.name if newest else None})
    gen = torch.Generator()
    for step in range(start, steps):
        gen.manual_seed(step * 10 + rank)
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        saver.step(step)
        if attempt == 0 and step == crash_at:
            saver.wait()
            # A save in flight when the rank dies: started on the checkpointer itself, so no publishing thread
            # runs for it and nothing can complete it. Named one step ahead of anything the saver can have
            # written: a save that fell due while the previous one was still being published starts late, at
            # the step it could start (up to step + 1 here, when the machine is loaded).
            model_sd, optim_sd = dcp_state_dict.get_state_dict(model, opt)
            saver.checkpointer.async_save({"model": model_sd, "optim": optim_sd, STEP_KEY: step + 2},
                                          os.path.join(out, "ckpts", f"step_{step + 2:09d}"))
            dist.barrier()
            if rank == 1:
                newest = ckpt.find_latest_checkpoint(os.path.join(out, "ckpts"))
                record(out, "crash.json", {"newest": newest.path.name if newest else None})
                os.kill(os.getpid(), signal.SIGKILL)
    saver.close()
    if rank == 0:
        params = [p.detach().flatten().tolist() for p in model.parameters()]
        record(out, "final.json", {"params": params, "adam_steps": [float(s["step"]) for s in opt.state.values()]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
