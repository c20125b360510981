"""Ranks of the address tests: one gloo all-reduce across hosts, then each rank writes what it was given."""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
out = {"rank": dist.get_rank(), "host": socket.gethostname(), "sum": float(t.item()),
       "MASTER_ADDR": os.environ["MASTER_ADDR"], "MASTER_PORT": os.environ["MASTER_PORT"]}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump(out, fh)
dist.barrier()
