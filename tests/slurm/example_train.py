"""The small training script the Slurm tests put into the templates (NVRX_EXAMPLE_SCRIPT).

Every rank joins a gloo process group, all-reduces its rank and writes a report naming its
node. With EXAMPLE_CRASH_RANK set, that rank exits with code 3 the first time (the marker file
EXAMPLE_CRASH_MARKER records that it did), so only an in-job restart can finish the job.
The report also says where the rank ran and whom it talked to (its host name, MASTER_ADDR as it resolves
there, the remote addresses of its TCP connections); with EXAMPLE_HOLD_FILE set, every rank waits after its
report until that file exists (at most 120 s), so a test can look at the running job.
The auto-resume example (checkpoint, graceful stop, finished flag) is resumable_train.py.
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    marker = Path(os.environ.get("EXAMPLE_CRASH_MARKER", "crashed.marker"))
    if os.environ.get("EXAMPLE_CRASH_RANK") == str(rank) and not marker.exists():
        marker.write_text(os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"))
        print(f"rank {rank}: crashing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    report = {
        "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]), "node": os.environ.get("SLURMD_NODENAME"),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "sum": total.item(),
        "job": os.environ.get("SLURM_JOB_ID"), "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "pid": os.getpid(), "hostname": socket.gethostname(), "master_addr": os.environ["MASTER_ADDR"],
        "master_ip": socket.gethostbyname(os.environ["MASTER_ADDR"]), "master_port": int(os.environ["MASTER_PORT"]),
        "peers": sorted({c.raddr.ip.removeprefix("::ffff:") for c in psutil.Process().net_connections("tcp")
                         if c.raddr and c.status == psutil.CONN_ESTABLISHED}),
    }
    out = Path(os.environ.get("EXAMPLE_REPORT_DIR", ".")) / f"rank-{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(out)  # a test polling for reports never reads half of one
    hold = os.environ.get("EXAMPLE_HOLD_FILE")
    deadline = time.monotonic() + 120
    while hold and not os.path.exists(hold):
        if time.monotonic() > deadline:
            print(f"rank {rank}: {hold} did not appear within 120 s", file=sys.stderr, flush=True)
            return 4
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
