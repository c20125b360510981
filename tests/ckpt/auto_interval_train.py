"""A rank under `nvrx launch` with ``PeriodicCheckpointer(every_steps="auto", mtbf_s=MTBF)``: STEPS steps, then exit.

usage: auto_interval_train.py ROOT STEPS MTBF
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from nvrx import ckpt


def main() -> None:
    root, steps, mtbf = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters())
    saver = ckpt.PeriodicCheckpointer(root, model=model, optimizer=opt, every_steps="auto", mtbf_s=mtbf)
    for step in range(saver.resume(), steps):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        saver.step(step)
    saver.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
