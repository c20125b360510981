"""A rank that checkpoints with nvrx.ckpt and can stop in the middle of publishing one checkpoint (fence tests).

Run as ``fence_train.py OUT STEPS``. Real gloo training: one parameter that every step adds 1 to (the all-reduced
world size divided by the world size, SGD with lr 1 and a constant momentum buffer), so it holds exactly the steps
done whenever every resume loaded a checkpoint whose steps match its state. Checkpoints: ``OUT/ckpts`` through
``PeriodicCheckpointer`` every 5 steps while the world has 2 ranks, every 3 with 1 (so a save the job left behind
is never saved again under its name by the ranks that went on: a name taken twice would make the late publish fail
for another reason than the fence), ``save_on_failure=True`` (a just-in-time checkpoint under ``nvrx launch
--jit-ckpt``).

Records in OUT: ``ledger.jsonl`` (tests/faults/conftest.py ``Ledger``: "resumed" at each start by rank 0,
"saved" by the coordinator once a checkpoint of its round is published (with its pid), "finished"; each with its
round);
``ckpt.json`` at the end (the steps of the newest checkpoint ``find_latest_checkpoint`` gives then);
``start-<round>-<rank>.json`` (the newest checkpoint each start saw, the steps it resumed at, its host);
``running.<rank>.<attempt>`` (its pid while it trains); ``progress.<host>.<round>`` (the steps done by that host's
rank in that round); ``final.json`` (the parameter after the last step).

FENCE_STALL=before:<name> | after:<name>: the process publishing checkpoint <name> (the coordinator of a periodic
save, or the rank saving just in time) stops in the middle of publishing it, once in the whole test: when every
rank's files are written, before the manifest (its publication time) and the fence check (before), or just after
that check, before the rename (after). It writes ``OUT/stalled.json`` (pid, host,
round, steps done) and waits for the file ``OUT/go``; it then finishes the publish and writes
``OUT/attempt.json`` (``published``, or ``refused`` and the error). Every rank waits for each periodic save it
started (``saver.wait()``), so saves fall exactly every 5 (3) steps, whatever the machine's speed, and a rank
whose publish stalls waits in that call, outside every collective (a thaw cannot end it by a broken connection
before the publish is tried); then it goes on as a rank of a round the job left would.
FENCE_CRASH=<host>:<steps>: in attempt 0 the rank on <host> SIGKILLs itself once it has done <steps> steps (no
periodic save is in flight then), so that its peer saves just in time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx import ckpt
from nvrx.ckpt import fence
from nvrx.ckpt.async_ckpt import filesystem_async

OUT = Path(sys.argv[1])
HOST = socket.gethostname()
ROUND = int(os.environ.get("NVRX_ROUND", "-1"))
STALL_POINT, _, STALL_NAME = os.environ.get("FENCE_STALL", "").partition(":")
_stalled_here = threading.local()


def record(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def ledger(**entry) -> None:
    fd = os.open(OUT / "ledger.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _stall(name: str) -> None:
    """Stop here (the publisher of NAME) until the test creates OUT/go; once in the whole test."""
    marker = OUT / "stalled.json"
    if marker.exists():
        return
    _stalled_here.active = True
    record(marker, {"pid": os.getpid(), "host": HOST, "round": ROUND, "name": name, "done": _PROGRESS["done"]})
    while not (OUT / "go").exists():
        time.sleep(0.01)


_real_check = fence.check_publish


def check_publish(root: Path, name: str) -> None:
    _real_check(root, name)
    if name == STALL_NAME and STALL_POINT == "after":
        _stall(name)


_real_finish = filesystem_async.FileSystemWriterAsync.finish_from_ranks


def finish_from_ranks(self, metadata, per_rank) -> None:
    _stalled_here.active = False
    if self.path.name == STALL_NAME and STALL_POINT == "before":
        _stall(self.path.name)
    try:
        _real_finish(self, metadata, per_rank)
    except BaseException as exc:
        if _stalled_here.active:
            record(OUT / "attempt.json", {"outcome": "refused", "error": f"{type(exc).__name__}: {exc}"})
        raise
    if _stalled_here.active:
        record(OUT / "attempt.json", {"outcome": "published"})
    else:
        digits = self.path.name.rsplit("_", 1)[-1]
        ledger(ev="saved", step=int(digits), round=ROUND, name=self.path.name, host=HOST, pid=os.getpid())


fence.check_publish = check_publish  # (filesystem_async calls fence.check_publish: this wrapper)
filesystem_async.FileSystemWriterAsync.finish_from_ranks = finish_from_ranks
_PROGRESS = {"done": 0}


def main() -> None:
    steps = int(sys.argv[2])
    step_time = float(os.environ.get("FAULT_STEP_TIME", "0.05"))
    crash_host, _, crash_at = os.environ.get("FENCE_CRASH", "").partition(":")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash = int(crash_at) if crash_host == HOST and attempt == 0 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    # a momentum buffer that stays the gradient (momentum 1, dampening 1): the optimizer has state to save just in
    # time (plain SGD has none), and each step still adds exactly 1
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=1.0, dampening=1.0)
    saver = ckpt.PeriodicCheckpointer(OUT / "ckpts", model=model, optimizer=opt, every_steps=5 if world == 2 else 3,
                                      save_on_failure=True)
    newest = ckpt.find_latest_checkpoint(OUT / "ckpts")
    start = saver.resume()
    _PROGRESS["done"] = start
    if rank == 0:
        ledger(ev="resumed", step=start, round=ROUND, host=HOST)
    record(OUT / f"start-{ROUND}-{rank}.json", {"start": start, "newest": newest.path.name if newest else None,
                                                "w": model.w.detach().tolist(), "world": world, "host": HOST})
    (OUT / f"running.{rank}.{attempt}").write_text(str(os.getpid()))
    for step in range(start, steps):
        time.sleep(step_time)
        grad = torch.ones(4)
        dist.all_reduce(grad)
        model.w.grad = -grad / world
        opt.step()
        _PROGRESS["done"] = step + 1
        record(OUT / f"progress.{HOST}.{ROUND}", {"done": step + 1})
        if saver.step(step):
            saver.wait()  # (see FENCE_STALL above)
        if crash is not None and step + 1 == crash:
            os.kill(os.getpid(), signal.SIGKILL)  # its peer waits in the next all-reduce, then saves just in time
    saver.close()
    dist.barrier()
    if rank == 0:
        newest = ckpt.find_latest_checkpoint(OUT / "ckpts")
        record(OUT / "ckpt.json", {"step": int(newest.path.name.rsplit("_", 1)[-1]) if newest else 0,
                                   "name": newest.path.name if newest else None})
        record(OUT / "final.json", {"w": model.w.detach().tolist(), "world": world, "steps": steps})
        ledger(ev="finished", step=steps, round=ROUND)


if __name__ == "__main__":
    main()
