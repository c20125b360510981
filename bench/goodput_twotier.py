"""The two-tier checkpoint of bench_goodput_local.py's runs, inside a goodput_train.py rank (``--ckpt twotier``).

Local tier (``nvrx.ckpt.local``): every ``--every`` steps, each rank's shard in ``--local-dir``/node<rank> (each rank
an emulated node), replicated to the other rank (J = 1, F = 2). Global tier (DCP through ``nvrx.ckpt``): every
``--global-every`` steps in ``--ckpt-dir``/global. ``--every 0``: the global tier alone (the reference).
Model and optimizer go through torch's ``get_state_dict`` / ``set_state_dict`` (string keys, optimizer state
allocated before a restore, so both tiers load in place).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from nvrx import ckpt
from nvrx.ckpt.local import LazyCliqueReplicationStrategy, LocalCheckpointManager, TwoTierCheckpointer

log = logging.getLogger(__name__)
_NEVER = 1 << 40


class TwoTierSaver:
    """``resume`` / ``step`` / ``close`` as goodput_train.py calls them (step S done -> iteration S + 1)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt_dir: Path, local_dir: Path,
                 local_every: int, global_every: int) -> None:
        rank = dist.get_rank()
        self.model, self.opt = model, opt
        self.local = LocalCheckpointManager(local_dir / f"node{rank}", session_id="goodput",
                                            repl_strategy=LazyCliqueReplicationStrategy(replication_jump=1))
        self.local_every = local_every or _NEVER
        self.global_every = global_every
        self.tiers = TwoTierCheckpointer(self.local, ckpt_dir / "global", local_every=self.local_every,
                                         global_every=global_every)
        self.restored: dict[str, Any] = {}

    def _state(self, done: int) -> dict[str, Any]:
        model_sd, opt_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "opt": opt_sd, "step": torch.tensor(done)}

    def resume(self) -> int:
        state = self._state(0)
        result = self.tiers.resume(state)
        self.restored = {"iteration": result.iteration, "tier": result.tier, "reason": result.reason}
        if result.iteration < 0:
            return 0
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
        return int(state["step"])

    def step(self, step: int) -> None:
        done = step + 1
        if done % self.local_every == 0 or done % self.global_every == 0:
            self.tiers.step(done, self._state(done))
        else:
            ckpt.maybe_finalize()

    def close(self) -> None:
        self.tiers.close()
        self.local.close()
