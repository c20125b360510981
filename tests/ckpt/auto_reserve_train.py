"""A rank under `nvrx launch --async-ckpt` that uses only the plain API (no prepare, no resume, no state given).

Its parameters are DTensors sharded over the ranks, trained by Adam. Records what the staging pool held before the
first optimizer step, after it, and after the first save.

usage: auto_reserve_train.py ROOT  (writes ROOT/rank<R>.json)
"""

from __future__ import annotations

import json
import logging
import sys

from nvrx.ckpt import auto_reserve

before_torch = auto_reserve.status()  # armed by the bootstrap before this script ran

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

from nvrx import ckpt  # noqa: E402
from nvrx.ckpt.api import staging_bytes  # noqa: E402
from nvrx.ckpt.async_ckpt.staging import default_pool  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    params = {f"w{i}": torch.nn.Parameter(distribute_tensor(torch.randn(512, 1024), mesh, [Shard(0)]))
              for i in range(4)}
    opt = torch.optim.Adam(params.values(), lr=1e-3)
    pool = default_pool()
    out: dict = {"before_torch": before_torch, "after_import": auto_reserve.status(),
                 "before_step": {"created": pool.created, "buffers": [b.id for b in pool.buffers]}}

    def step() -> None:
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()

    step()
    out["after_first_step"] = auto_reserve.status()
    pool.wait_reserved()
    out["reserved_pool"] = {"created": pool.created, "buffers": [[b.id, b.capacity] for b in pool.buffers]}
    step()
    step()
    state = {**{f"model.{k}": p for k, p in params.items()},
             **{f"optim.{k}.{s}": opt.state[p][s] for k, p in params.items() for s in ("exp_avg", "exp_avg_sq", "step")},
             "iteration": 3}
    out["save_needs"] = staging_bytes(state)
    out["local_param_bytes"] = sum(p.to_local().numel() * 4 for p in params.values())
    out["full_param_bytes"] = sum(p.numel() * 4 for p in params.values())
    ckpt.async_save(state, f"{root}/step_3")
    ckpt.wait()
    out["after_save"] = {"created": pool.created, "buffers": [[b.id, b.capacity] for b in pool.buffers]}
    out["after_save_status"] = auto_reserve.status()
    ckpt.finalize_before_exit()
    with open(f"{root}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
