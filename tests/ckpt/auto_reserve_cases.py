"""One fresh process per case of the first-step staging reservation (it is once per process, so each case needs its
own). Prints one JSON line with what it observed.

usage: auto_reserve_cases.py CASE DIR
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

CASE, WORK = sys.argv[1], Path(sys.argv[2])
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")

from nvrx.ckpt import auto_reserve  # noqa: E402  (no torch yet)

if CASE == "import_watch":
    auto_reserve.arm()  # as the bootstrap does in a spawned rank: torch is not imported yet
    watching = auto_reserve.status()

import torch  # noqa: E402

from nvrx import ckpt  # noqa: E402
from nvrx.ckpt.api import staging_bytes  # noqa: E402  (the API loaded: still nothing armed)
from nvrx.ckpt.async_ckpt.staging import align, default_pool  # noqa: E402


def ours_registered() -> int:
    hooks = sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks
    return sum(isinstance(h, auto_reserve._Reserver) for h in hooks.values())


def adam_bytes(model: torch.nn.Module) -> int:
    """What Adam holds after a step, counted by hand: each parameter, its two moments, a scalar step (aligned)."""
    return sum(3 * align(p.numel() * p.element_size()) + align(4) for p in model.parameters())


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(2, model.in_features)).sum().backward()
    opt.step()
    opt.zero_grad()


def main() -> dict[str, Any]:
    pool = default_pool()
    model = torch.nn.Linear(512, 1024)
    if CASE == "no_checkpointer":  # ckpt imported, its API loaded, but no checkpointer: nothing may be reserved
        opt = torch.optim.Adam(model.parameters())
        step(model, opt)
        step(model, opt)
        return {"status": auto_reserve.status(), "buffers": len(pool.buffers), "hooks": ours_registered()}
    if CASE == "opt_out":  # armed (as the bootstrap does for --async-ckpt), then a checkpointer that reserves itself
        auto_reserve.arm()
        ckpt.AsyncCheckpointer(reserve_after_first_step=False)
        opt = torch.optim.Adam(model.parameters())
        step(model, opt)
        return {"status": auto_reserve.status(), "buffers": len(pool.buffers), "hooks": ours_registered()}
    if CASE == "import_watch":
        mod = sys.modules["torch.optim.optimizer"]
        out = {"watching": watching, "after_import": auto_reserve.status(), "hooks": ours_registered(),
               "loader": type(mod.__loader__).__name__, "spec_loader": type(mod.__spec__.loader).__name__,
               "in_meta_path": any(isinstance(f, auto_reserve._OptimizerImportWatch) for f in sys.meta_path)}
        opt = torch.optim.Adam(model.parameters())
        step(model, opt)
        pool.wait_reserved()
        out["created"] = pool.created
        out["counted"], out["expected"] = auto_reserve.status()["counted"], adam_bytes(model)
        return out
    # "checkpointer": two optimizers, a warm first save, the hook removed, then a save larger than the reservation
    cp = ckpt.AsyncCheckpointer()
    other = torch.nn.Linear(256, 256)
    opt_a = torch.optim.Adam(model.parameters())
    opt_b = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"hooks_armed": ours_registered()}
    step(model, opt_a)
    out["after_a"] = auto_reserve.status()
    step(other, opt_b)
    out["after_b"] = auto_reserve.status()
    out["expected_a"] = adam_bytes(model)
    out["expected_b"] = sum(2 * align(p.numel() * p.element_size()) for p in other.parameters())
    pool.wait_reserved()
    step(model, opt_a)  # a second step: every optimizer has stepped once
    step(other, opt_b)
    out["done"] = auto_reserve.status()["done"]
    out["reserved"] = {"created": pool.created, "ids": sorted(b.id for b in pool.buffers),
                       "capacity": max(b.capacity for b in pool.buffers)}
    state = {"model": model.state_dict(), "other": other.state_dict(), "opt_a": opt_a.state_dict(),
             "opt_b": opt_b.state_dict()}
    out["save_needs"] = staging_bytes(state)
    cp.async_save(state, WORK / "first")
    cp.wait()
    out["after_first_save"] = {"created": pool.created, "ids": sorted(b.id for b in pool.buffers)}
    out["hooks_after_save"] = ours_registered()
    state["extra"] = torch.ones(8 << 20)  # 32 MiB more than was reserved
    cp.async_save(state, WORK / "bigger")
    cp.wait()
    out["after_bigger_save"] = {"created": pool.created}
    loaded = {"extra": torch.zeros(8 << 20)}
    import torch.distributed.checkpoint as dcp

    dcp.load(loaded, checkpoint_id=str(WORK / "bigger"))
    out["bigger_loaded_ok"] = bool(torch.equal(loaded["extra"], state["extra"]))
    cp.finalize_before_exit()
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
