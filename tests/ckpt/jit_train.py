"""A DDP + Adam rank under `nvrx launch --jit-ckpt` with ``PeriodicCheckpointer(every_steps=5, save_on_failure=True)``.

usage: jit_train.py OUT STEPS FAULT FAULT_AT

Attempt 0, at step FAULT_AT (every rank first waits until no periodic save is in flight and rank 0 records the
newest checkpoint in before.json: the previous checkpoint), right after rank 1's optimizer step, the fault FAULT
happens:

  none     no fault
  crash    rank 1 SIGKILLs itself; rank 0 blocks in the next step's all-reduce (the JIT saver)
  hang     rank 1 stops (SIGSTOP) inside monitored section 'work'; its monitor kills it at the section timeout
  stop     rank 1 stops (SIGSTOP); with heartbeats, its monitor kills it (rank 0, silent in the all-reduce, waits)
  second   rank 1 SIGKILLs itself, and rank 0 SIGKILLs itself in the middle of its JIT save (a second failure)
  other    (3 ranks) rank 1 SIGKILLs itself, and rank 0 SIGKILLs rank 2 in the middle of its JIT save (a second
           failure elsewhere: the save, which needs no other rank, goes on)
  torn     rank 1 SIGKILLs itself; rank 0's JIT write blocks past the deadline (the agent kills it mid-write)
  stuck    rank 1 SIGKILLs itself; rank 0 stays inside optimizer.step() (never a consistent point)
  full     rank 1 fills the checkpoint file system, then SIGKILLs itself (the JIT save gets ENOSPC)
  sharded  as crash, with a DTensor sharded over the ranks in the saved state (every attempt): a lost rank's shard
           has no other holder, so nothing is saved just in time
  node     rank 1 records node-fault.json and sleeps: the test SIGKILLs its whole node (agent, monitor, rank,
           writer) at once; rank 0, on another node, blocks in the next all-reduce (the JIT saver)

Every attempt records the steps it resumed at (start-a<attempt>-r<rank>.json); rank 0 records the final
parameters (final.json) to compare with a run without faults.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from nvrx import ckpt


def record(out: str, name: str, payload: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(payload, fh)
    os.replace(tmp, os.path.join(out, name))


def on_jit_write(action) -> None:
    """Run ACTION inside the JIT save's file write (on the JIT thread only), after the first file is open."""
    from nvrx.ckpt.async_ckpt import file_writer

    real = file_writer._write_one_file

    def patched(buffer, directory, spec, fsync, wait_staged=None):
        if threading.current_thread().name == "nvrx-jit-link":
            open(os.path.join(directory, spec["name"]), "wb").write(b"torn")
            action()
        return real(buffer, directory, spec, fsync, wait_staged)

    file_writer._write_one_file = patched


def fill(path: str) -> None:
    """Fill the file system holding PATH (ENOSPC for the next writer)."""
    with open(os.path.join(path, "filler"), "wb") as fh:
        block = b"\0" * (1 << 16)
        try:
            while True:
                fh.write(block)
                fh.flush()
        except OSError:
            pass


def main() -> None:
    out, steps, fault, fault_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    root = os.environ.get("JIT_TEST_CKPTS") or os.path.join(out, "ckpts")
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"shard": _sharded_tensor()} if fault == "sharded" else None
    saver = ckpt.PeriodicCheckpointer(root, model=model, optimizer=opt, state=state, every_steps=5, save_on_failure=True)
    if attempt == 1:  # the full-disk case: space again for the restarted job (both ranks try: either may win)
        try:
            os.unlink(os.path.join(root, "filler"))
        except FileNotFoundError:
            pass
    listed = [c.path.name for c in ckpt.list_checkpoints(root)] if os.path.isdir(root) else []
    start = saver.resume()
    record(out, f"start-a{attempt}-r{rank}.json", {"start": start, "listed": listed})
    faulty = attempt == 0 and fault != "none"
    if faulty and rank == 0 and fault == "stuck":
        opt.register_step_pre_hook(lambda *_: _forever() if step_no[0] == fault_at else None)
    if faulty and rank == 0 and fault == "second":
        on_jit_write(lambda: os.kill(os.getpid(), signal.SIGKILL))
    if faulty and rank == 2 and fault == "other":
        record(out, "pid-r2.json", {"pid": os.getpid()})
    if faulty and rank == 0 and fault == "other":
        on_jit_write(lambda: os.kill(json.load(open(os.path.join(out, "pid-r2.json")))["pid"], signal.SIGKILL))
    if faulty and rank == 0 and fault == "torn":
        on_jit_write(lambda: time.sleep(3600))
    gen = torch.Generator()
    step_no = [start]
    for step in range(start, steps):
        step_no[0] = step
        if faulty and step == fault_at:
            saver.wait()  # no periodic save is in flight on any rank at the fault: the previous checkpoint is known
            dist.barrier()
            if rank == 0:
                newest = ckpt.find_latest_checkpoint(root)
                record(out, "before.json", {"newest": newest.path.name if newest else None,
                                            "steps": int(newest.path.name.split("_")[-1]) if newest else 0})
            if rank == 1 and fault == "full":
                fill(root)
        gen.manual_seed(step * 10 + rank)
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if faulty and step == fault_at and rank == 1:  # after its optimizer step: steps done = FAULT_AT + 1
            if fault == "hang":  # stops inside a monitored section: its monitor kills it at the section timeout
                from nvrx.monitors.client import RankMonitorClient

                client = RankMonitorClient()
                client.init_workload_monitoring()
                client.start_section("work")
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault == "node":
                record(out, "node-fault.json", {"pid": os.getpid()})
                time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)
        saver.step(step)
    saver.close()
    if rank == 0:
        record(out, "final.json", {"params": [p.detach().flatten().tolist() for p in model.parameters()]})
    dist.destroy_process_group()


def _sharded_tensor():
    """A DTensor sharded over every rank (one row per rank): the state nobody else holds a copy of."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return distribute_tensor(torch.arange(4.0 * dist.get_world_size()).reshape(dist.get_world_size(), 4), mesh,
                             [Shard(0)])


def _forever() -> None:
    while True:  # inside optimizer.step(), in Python: heartbeats go on, the step never ends
        time.sleep(0.05)


if __name__ == "__main__":
    main()
