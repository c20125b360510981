"""The two-tier checkpoint of bench_goodput_local.py's and bench_nodeloss.py's runs, inside a goodput_train.py rank
(``--ckpt twotier`` / ``twotier_jit``).

Local tier (``nvrx.ckpt.local``): every ``--every`` steps. With ``--local-dir`` (bench_goodput_local: one agent,
each rank an emulated node) each rank's shard goes to ``--local-dir``/node<rank>, replicated to the next rank
(J = 1, F = 2). Without it (bench_nodeloss: one agent per emulated host, ``nvrx launch --local-ckpt-dir``) the
shards go to the launcher's local root and are replicated to the same local rank of the other node (J = ranks per
node), so a lost node's shards survive on the other one. Global tier (DCP through ``nvrx.ckpt``): every
``--global-every`` steps in ``--ckpt-dir``/global. ``--every 0``: the global tier alone (the reference).
``twotier_jit``: ``save_on_failure=True`` (run with ``nvrx launch --jit-ckpt``): the survivors save the last
completed step into the global tier when a peer is lost; for that ``step`` is called once per optimizer step.
``--sharded``: the state also holds a DTensor sharded over the ranks (one holder per shard, e.g. a sharded
embedding): the just-in-time save must decline it, and a lost node's shards must come back from their replicas.
Model and optimizer go through torch's ``get_state_dict`` / ``set_state_dict`` (string keys, optimizer state
allocated before a restore, so both tiers load in place).
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from nvrx import ckpt
from nvrx.ckpt.local import LazyCliqueReplicationStrategy, LocalCheckpointManager, TwoTierCheckpointer, default_root

log = logging.getLogger(__name__)
_NEVER = 1 << 40
SHARD_ROWS = 256  # rows of the sharded table per rank


def digest(model: torch.nn.Module) -> int:
    """CRC-32 of every parameter's bytes: equal digests mean bit-identical weights (the resumed-state check)."""
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().contiguous().numpy().data, crc)
    return crc


def sharded_table() -> Any:
    """A DTensor of SHARD_ROWS x 8 per rank, sharded on dim 0 over every rank (the state only its node holds)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return distribute_tensor(torch.zeros(SHARD_ROWS * dist.get_world_size(), 8), mesh, [Shard(0)])


def shard_value(rank: int, done: int) -> float:
    """What rank RANK's shard holds after DONE steps (each step adds rank + 1): checks a restored shard exactly."""
    return float(done * (rank + 1))


class TwoTierSaver:
    """``resume`` / ``step`` / ``close`` as goodput_train.py calls them (step S done -> iteration S + 1)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt_dir: Path, local_dir: Path | None,
                 local_every: int, global_every: int, jit: bool = False, sharded: bool = False) -> None:
        self.rank = dist.get_rank()
        self.model, self.opt = model, opt
        self.local = self._manager(local_dir)
        self.local_every = local_every or _NEVER
        self.global_every = global_every
        self.table = sharded_table() if sharded else None
        self.jit = jit
        self.tiers = TwoTierCheckpointer(self.local, ckpt_dir / "global", local_every=self.local_every,
                                         global_every=global_every, save_on_failure=jit, optimizer=opt if jit else None)
        self.restored: dict[str, Any] = {}
        self._live: dict[str, Any] | None = None

    def _manager(self, local_dir: Path | None) -> LocalCheckpointManager:
        if local_dir is not None:  # one agent: each rank an emulated node of its own
            return LocalCheckpointManager(local_dir / f"node{self.rank}", session_id="goodput",
                                          repl_strategy=LazyCliqueReplicationStrategy(replication_jump=1))
        return LocalCheckpointManager(default_root(), repl_strategy=LazyCliqueReplicationStrategy(replication_jump=0))

    def _state(self, done: int) -> dict[str, Any]:
        model_sd, opt_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "opt": opt_sd, "step": torch.tensor(done)}
        if self.table is not None:
            state["table"] = self.table
        return state

    def resume(self) -> int:
        state = self._state(0)
        result = self.tiers.resume(state)
        self.restored = {"iteration": result.iteration, "tier": result.tier, "reason": result.reason,
                         "local_source": self.local.last_load_source if result.tier == "local" else None}
        if result.iteration < 0:
            return 0
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
        done = int(state["step"])
        self.restored.update(self._checks(done))
        return done

    def _checks(self, done: int) -> dict[str, Any]:
        """What the bench compares: the restored weights' digest, and whether this rank's shard is its own."""
        facts: dict[str, Any] = {"digest": digest(self.model), "steps": done}
        if self.table is not None:
            local = self.table.to_local()
            facts["shard_ok"] = bool(torch.all(local == shard_value(self.rank, done)))
        return facts

    def step(self, step: int) -> None:
        done = step + 1
        if self.table is not None:
            with torch.no_grad():
                self.table.to_local().add_(self.rank + 1)
        if self.jit:  # every step: the just-in-time save needs the iteration of each optimizer step
            self.tiers.step(done, self._live_state(done))
        elif done % self.local_every == 0 or done % self.global_every == 0:
            self.tiers.step(done, self._state(done))
        else:
            ckpt.maybe_finalize()

    def _live_state(self, done: int) -> dict[str, Any]:
        """The state dict of live tensors, built once (after resume: set_state_dict makes new optimizer tensors);
        only its step count changes in place, so a call per step costs no copy."""
        if self._live is None:
            self._live = self._state(done)
        self._live["step"].fill_(done)
        return self._live

    def close(self) -> None:
        self.tiers.close()
        self.local.close()

