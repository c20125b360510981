"""The fault matrix's training script: a few steps of real gloo training that checkpoint and keep a ledger.

Run by `nvrx launch` as ``train.py OUT STEPS FAULT``. Every step all-reduces a tensor over gloo (a real
collective: a hung or lost rank stalls the others), beats the rank monitor when one is configured, and
rank 0 saves the step atomically to ``OUT/ckpt.json``. The ledger ``OUT/ledger.jsonl`` records, in order,
each save once it is durable ("saved") and each start's resume point ("resumed"): the matrix checks that no
start resumes from before a step reported saved. FAULT says what goes wrong, once, in the first attempt:

  none | crash | crash_always | hang_heartbeat | hang_section | hang_outside | hang_first | stuck_c | graceful
  (the rank that misbehaves is the last one; "graceful" asks should_stop() every step instead)

FAULT_STEP_TIME sets the seconds per step; FAULT_GATE / FAULT_END_GATE name a file the ranks wait for before
their first step / before they exit.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def ledger(out: Path, **entry) -> None:
    """Append one line and make it durable: a line in the ledger is a promise the test holds us to."""
    fd = os.open(out / "ledger.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def save(out: Path, step: int) -> None:
    tmp = out / f".ckpt.{os.getpid()}"
    tmp.write_text(json.dumps({"step": step}))
    with open(tmp) as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, out / "ckpt.json")
    ledger(out, ev="saved", step=step)


def resume_point(out: Path) -> int:
    try:
        return int(json.loads((out / "ckpt.json").read_text())["step"])
    except FileNotFoundError:
        return 0


def misbehave(fault: str, client) -> None:
    """Do FAULT now (this is the last rank, first attempt)."""
    if fault in ("crash", "crash_always"):
        raise SystemExit(3)
    if fault == "hang_heartbeat":
        time.sleep(3600)  # no heartbeats
    if fault == "hang_section":
        client.start_section("step")
        time.sleep(3600)
    if fault == "hang_outside":
        time.sleep(3600)  # out of any section for too long (heartbeat timeout set long by the test)
    if fault == "stuck_c":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a C library that blocks SIGTERM...
        ctypes.CDLL(None).sleep(3600)  # ...and sleeps in C: only SIGKILL ends it


def wait_for_file(path: str | None, bound: float = 300.0) -> None:
    deadline = time.monotonic() + bound
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    out, steps, fault = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    step_time = float(os.environ.get("FAULT_STEP_TIME", "0.05"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    culprit = rank == world - 1 and (attempt == 0 or fault == "crash_always")
    client = None
    if os.environ.get("NVRX_MONITOR_SOCKET"):
        from nvrx.monitors import RankMonitorClient

        client = RankMonitorClient()
        if fault == "hang_first" and culprit:
            client.init_workload_monitoring()
            time.sleep(3600)  # never a first heartbeat
        client.init_workload_monitoring()
    if fault == "graceful":
        from nvrx.launcher.rank import job_control

        job_control.install()
    start = resume_point(out)
    if rank == 0:
        ledger(out, ev="resumed", step=start, attempt=attempt)
    (out / f"running.{rank}.{attempt}").write_text(str(os.getpid()))
    wait_for_file(os.environ.get("FAULT_GATE"))  # train only once the test has seen what it waits for
    for step in range(start + 1, steps + 1):
        if client is not None:
            client.send_heartbeat()
            client.start_section("step")
        time.sleep(step_time)
        dist.all_reduce(torch.ones(4))
        if client is not None:
            client.end_section("step")
        if culprit and step == start + 2 and fault not in ("none", "graceful"):
            misbehave(fault, client)
        if rank == 0:
            save(out, step)
        if fault == "graceful" and job_control.should_stop(step):
            dist.barrier()
            return
    if client is not None:
        client.shutdown_workload_monitoring()
    dist.barrier()
    if rank == 0:
        ledger(out, ev="finished", step=steps)
    wait_for_file(os.environ.get("FAULT_END_GATE"))  # exit only once the test has seen what it waits for


if __name__ == "__main__":
    main()
