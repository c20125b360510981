"""A small DDP training job on CPU/gloo, written as for torchrun, checkpointed the nvrx way.

It trains a tiny regression model and saves an asynchronous checkpoint every 5 steps with one call per
step (``nvrx.ckpt.PeriodicCheckpointer``: the save copies the state and returns; writing and publishing happen
in the background; on start it resumes from the newest complete checkpoint). For the demo it gives the
launcher two faults to recover from: rank 1 crashes in the first attempt, and rank 0 hangs (a call that
blocks the interpreter) in the second, which the rank monitor's automatic heartbeat catches. Run it with:

    nvrx launch --nproc-per-node 2 --max-restarts 3 --async-ckpt --ft-param-auto-heartbeat true \
        --ft-param-rank-heartbeat-timeout 3 scripts/demo_train.py --steps 60
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nvrx import ckpt


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--crash-at", type=int, default=25, help="step at which rank 1 crashes in attempt 0 (-1: never)")
    p.add_argument("--hang-at", type=int, default=45, help="step at which rank 0 hangs in attempt 1 (-1: never)")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds of extra (busy) compute per step")
    p.add_argument("--ckpt", default=os.path.join(os.environ.get("NVRX_RUN_LOG_DIR", "."), "demo_ckpts"))
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    saver = ckpt.PeriodicCheckpointer(args.ckpt, model=model, optimizer=opt, every_steps=5)
    start = saver.resume()  # steps already done by the newest complete checkpoint (0 on a fresh start)
    if rank == 0:
        print(f"attempt {attempt}: world size {world}, starting at step {start}", flush=True)

    g = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.arange(8, dtype=torch.float32).unsqueeze(1) / 8
    for step in range(start, args.steps):
        busy_until = time.monotonic() + args.step_time
        while time.monotonic() < busy_until:  # stands in for a real model's compute
            pass
        x = torch.randn(32, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if attempt == 0 and rank == 1 and step == args.crash_at:
            print(f"rank 1: simulated crash at step {step}", file=sys.stderr, flush=True)
            os._exit(13)
        if attempt == 1 and rank == 0 and step == args.hang_at:
            print(f"rank 0: simulated hang at step {step}", file=sys.stderr, flush=True)
            time.sleep(3600)  # blocks the interpreter: no automatic heartbeat, the monitor kills this rank
        if saver.step(step) and rank == 0:  # every 5 steps: copies the state, the rest in the background
            print(f"step {step}: loss {loss.item():.4f} (checkpoint {saver.last_saved} started)", flush=True)
    saver.close()  # the last save published, the writer stopped
    if rank == 0:
        print(f"done: final loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
