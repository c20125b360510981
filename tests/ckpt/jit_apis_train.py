"""A DDP + Adam rank under `nvrx launch --jit-ckpt` saving on failure through the other checkpointers' APIs.

usage: jit_apis_train.py OUT API STEPS FAULT FAULT_AT

API:
  module   the plain functions: ``ckpt.resume`` / ``ckpt.async_save`` every 5 steps (``step_<n>``), plus
           ``ckpt.save_on_failure(root, optimizer=..., state_fn=..., steps_done=start)``
  twotier  ``TwoTierCheckpointer(local_every=2, global_every=5, save_on_failure=True, optimizer=...)``, local tier
           in the launcher's --local-ckpt-dir

Steps (iterations) count from 1; STEPS in all. Attempt 0, at iteration FAULT_AT (every rank first waits until no
save is in flight; rank 0 records the newest checkpoints then, in before.json), right after rank 1's optimizer
step, the fault FAULT happens:

  none     no fault
  crash    rank 1 SIGKILLs itself; rank 0 blocks in the next iteration's all-reduce (the JIT saver)
  second   as crash, and rank 0 SIGKILLs itself in the middle of its JIT save (a second failure)

Every attempt records where it started (start-a<attempt>-r<rank>.json: the steps done, the tier and why);
rank 0 records the final parameters (final.json) to compare with a run without faults.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from jit_train import (  # (this directory is the script's: sys.path[0])
    on_jit_write,
    record,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from nvrx import ckpt


def main() -> None:
    out, api, steps, fault, fault_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    root = Path(out) / "ckpts"
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def state_fn() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def load(sd: dict) -> None:
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    tiers = None
    if api == "module":
        start, tier, why = 0, None, "fresh"
        if ckpt.find_latest_checkpoint(root, verify=None) is not None:
            sd = {**state_fn(), "step": -1}
            info = ckpt.resume(root, sd)
            load(sd)
            start, tier, why = int(sd["step"]), "global", info.path.name
        ckpt.save_on_failure(root, optimizer=opt, state_fn=state_fn, steps_done=start)
    else:
        from nvrx.ckpt.local import (
            LocalCheckpointManager,
            TwoTierCheckpointer,
            default_root,
        )

        local = LocalCheckpointManager(default_root())
        tiers = TwoTierCheckpointer(local, root, local_every=2, global_every=5, save_on_failure=True, optimizer=opt,
                                    state_fn=state_fn)
        sd = state_fn()
        res = tiers.resume(sd)
        if res.iteration >= 0:
            load(sd)
        start, tier, why = max(res.iteration, 0), res.tier, res.reason
    record(out, f"start-a{attempt}-r{rank}.json", {"start": start, "tier": tier, "why": why})
    faulty = attempt == 0 and fault != "none"
    if faulty and rank == 0 and fault == "second":
        on_jit_write(lambda: os.kill(os.getpid(), signal.SIGKILL))
    gen = torch.Generator()
    for it in range(start + 1, steps + 1):
        if faulty and it == fault_at:
            ckpt.wait()  # no save is in flight on any rank at the fault: the previous checkpoints are known
            if tiers is not None:
                tiers.local.wait()
            dist.barrier()
            if rank == 0:
                record(out, "before.json", {"global": sorted(p.name for p in root.iterdir() if not p.name.startswith("."))})
        gen.manual_seed(it * 10 + rank)
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if faulty and it == fault_at and rank == 1:  # after its optimizer step: iteration FAULT_AT is done
            os.kill(os.getpid(), signal.SIGKILL)
        if tiers is not None:
            tiers.step(it, state_fn())
        else:
            ckpt.maybe_finalize()
            if it % 5 == 0:
                ckpt.async_save({**state_fn(), "step": it}, root / f"step_{it:09d}")
    if tiers is not None:
        tiers.close()
    ckpt.finalize_before_exit()
    if rank == 0:
        record(out, "final.json", {"params": [p.detach().flatten().tolist() for p in model.parameters()]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
