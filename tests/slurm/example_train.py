"""The small training script the Slurm tests put into the templates (NVRX_EXAMPLE_SCRIPT).

Every rank joins a gloo process group, all-reduces its rank and writes a report naming its
node. With EXAMPLE_CRASH_RANK set, that rank exits with code 3 the first time (the marker file
EXAMPLE_CRASH_MARKER records that it did), so only an in-job restart can finish the job.
The auto-resume example (checkpoint, graceful stop, finished flag) is resumable_train.py.
"""

import json
import os
import sys
from pathlib import Path

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
    }
    out = Path(os.environ.get("EXAMPLE_REPORT_DIR", ".")) / f"rank-{rank}.json"
    out.write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
