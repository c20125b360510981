"""A rank of bench_inprocess.py: the same script under every launcher.

Attempt 0: init the gloo group, then all_reduce every ~10 ms; rank 1 raises ValueError at step
--fault-step (recording the time just before). Attempt 1 (the restart: a new iteration of the
in-process Wrapper, or TORCHELASTIC_RESTART_COUNT=1 after a process restart): init the group again,
one all_reduce, record when each phase finished, exit 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

t_start = time.time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

inprocess = None
if os.environ.get("NVRX_INPROCESS") == "1":
    from nvrx.launcher.rank import inprocess  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault-step", type=int, default=20)
    args = parser.parse_args()
    out = Path(args.out)
    call_wrapper = inprocess.current() if inprocess is not None else None
    attempt = call_wrapper.iteration if call_wrapper else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t_enter = time.time()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t_pg = time.time()
    rank = dist.get_rank()
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    record = {"attempt": attempt, "rank": rank, "world": dist.get_world_size(), "pid": os.getpid(), "t_start": t_start,
              "t_enter": t_enter, "t_pg": t_pg, "t_ready": time.time(),
              "timings": dict(call_wrapper.restart_timings) if call_wrapper else {}}
    (out / f"ready-a{attempt}-r{rank}-{os.getpid()}.json").write_text(json.dumps(record))
    if attempt > 0:
        dist.destroy_process_group()
        return 0
    for step in range(100_000):
        if rank == 1 and step == args.fault_step:
            (out / "fault.json").write_text(json.dumps({"t": time.time(), "pid": os.getpid()}))
            raise ValueError("bench: injected fault on rank 1")
        dist.all_reduce(tensor)
        time.sleep(0.01)
    return 1


if __name__ == "__main__":
    sys.exit(main())
