"""A rank under `nvrx launch --async-ckpt`: its checkpoint writer must already run when user code starts.

usage: launch_train.py ROOT  (writes ROOT/rank<R>.json)
"""

from __future__ import annotations

import json
import os
import sys

from nvrx.ckpt.async_ckpt import writer_process

bootstrap_writer = writer_process._default  # started by the bootstrap before this script ran
early_pid = bootstrap_writer.pid if bootstrap_writer is not None else None

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nvrx import ckpt  # noqa: E402


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"shared": torch.arange(100.0), f"only_rank{rank}": torch.full((10,), float(rank)), "step": 3}
    ckpt.async_save(state, f"{root}/step_3")
    ckpt.wait()
    used_pid = writer_process.default_writer().pid
    ckpt.finalize_before_exit()
    with open(f"{root}/rank{rank}.json", "w") as f:
        json.dump({"early_pid": early_pid, "used_pid": used_pid,
                   "rank_pid": os.getpid()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
