"""bench_partition.py's training script: one gloo all-reduce per step; every rank appends each finished step.

Run as ``partition_train.py OUT STEP_TIME STEPS`` under nvrx launch or torchrun. Each line of
``OUT/steps.jsonl``: wall time, host, rank, world size, restart count, step (O_APPEND: lines never mix).
"""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    out, step_time, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fd = os.open(os.path.join(out, "steps.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    host = socket.gethostname()
    for step in range(steps):
        time.sleep(step_time)
        dist.all_reduce(torch.ones(4))
        line = {"t": time.time(), "host": host, "rank": rank, "world": world, "restart": restart, "step": step}
        os.write(fd, (json.dumps(line) + "\n").encode())
    dist.barrier()


if __name__ == "__main__":
    main()
