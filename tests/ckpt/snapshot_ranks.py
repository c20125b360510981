"""One rank of the snapshot test: PeriodicCheckpointer saves while training goes straight on.

usage: python snapshot_ranks.py RANK PORT WORKDIR

Every 3 steps a save starts; the copy of the parameters and Adam's state is left to the publishing thread,
which is made slow on purpose (it copies only once the next optimizer step has begun), and the optimizer steps right after the save
call. For each save the rank records the state's values at the call; the test compares them with what the
checkpoint holds. It also records how often a tensor was copied a second time (the writer must take the
snapshot's bytes where they lie) and how long optimizer steps waited for a copy.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from nvrx import ckpt
from nvrx.ckpt.async_ckpt.staging import StagingBuffer
from nvrx.ckpt.snapshot import Snapshot

SECOND_COPIES = []
_copy_tensor = StagingBuffer.copy_tensor
_finish_copy = Snapshot.finish_copy


def _counting_copy(self, offset, tensor):  # noqa: ANN001, ANN202
    SECOND_COPIES.append(tuple(tensor.shape))
    _copy_tensor(self, offset, tensor)


STEP_ATTEMPTED = threading.Event()  # set by the first optimizer step pre-hook (registered before the saver's)


def _slow_finish(self):  # noqa: ANN001, ANN202
    STEP_ATTEMPTED.clear()
    STEP_ATTEMPTED.wait(5)  # (bounded: close() takes a last save with no step after it) the next optimizer step has begun: the saver's hook must now hold it
    time.sleep(0.2)
    _finish_copy(self)


StagingBuffer.copy_tensor = _counting_copy
Snapshot.finish_copy = _slow_finish


def flat(sd: dict, prefix: str = "") -> dict[str, list]:
    out: dict[str, list] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = [list(v.shape), v.detach().flatten().tolist()]
    return out


def values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list]:
    model_sd, optim_sd = get_state_dict(model, opt)
    return flat({"model": model_sd, "optim": optim_sd})


def main() -> None:
    rank, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *_: STEP_ATTEMPTED.set())  # runs before the saver's own hook
    saver = ckpt.PeriodicCheckpointer(f"{work}/ckpts", model=model, optimizer=opt, every_steps=3, keep_last=None)
    saved: dict[str, dict] = {}
    for step in range(9):
        loss = model(torch.randn(4, 8)).pow(2).mean()  # the same data on both ranks: replicated values agree
        opt.zero_grad()
        loss.backward()
        opt.step()
        if saver.step(step):
            saved[f"step_{step + 1:09d}"] = values(model, opt)
        time.sleep(0.2)  # the rest of a step (the publisher catches up between saves)
    if saver._due:  # a save fell due while the last one was published: close() takes it, of the final state
        saved[f"step_{saver._done:09d}"] = values(model, opt)
    saver.close()
    with open(f"{work}/rank{rank}.json", "w") as fh:
        json.dump({"saved": saved, "second_copies": len(SECOND_COPIES), "copy_wait": saver.copy_wait_seconds}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
