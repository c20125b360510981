"""Two checkpoint tiers: local (node-local storage, replicated; every N steps) and global (DCP on shared
storage through ``nvrx.ckpt.async_save``; every M steps). On (re)start the newest iteration that can actually be
restored wins, whichever tier holds it, and the choice is logged with its reason.

A local checkpoint that cannot be used (a shard with no intact copy, a copy that fails its checks, or the user's
validation hook saying no on any rank) falls back to the global tier; with no global checkpoint either, resume
returns a fresh start and says why. It never raises for damaged checkpoints, so a bad local copy cannot put the
job into a restart loop.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import nvrx.ckpt as ckpt
from nvrx.ckpt.async_ckpt.dist_wrapper import DistWrapper
from nvrx.ckpt.errors import CheckpointError
from nvrx.ckpt.local.ckpt_managers.local_manager import LocalCheckpointManager
from nvrx.ckpt.local.codec import local_part

log = logging.getLogger(__name__)

_GLOBAL_NAME = re.compile(r"^(?:jit_)?iter_(\d+)$")  # (jit_: a just-in-time save, nvrx.ckpt.jit)
JIT_NAME = "jit_iter_{:09d}"


@dataclass(frozen=True)
class RestoreResult:
    """What resume restored: ITERATION (-1: nothing, a fresh start), from which TIER ('local', 'global' or None),
    and WHY (one line)."""

    iteration: int
    tier: str | None
    reason: str


def copy_into(dst: Any, src: Any) -> Any:
    """Copy SRC's values into DST in place where DST has tensors of the same shape (so a model's parameters keep
    their identity; for a DTensor / ShardedTensor, its local shard), else take SRC's value; returns the merged value."""
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        target = local_part(dst)  # a DTensor / ShardedTensor: the local checkpoint holds this rank's shard
        if target.shape == src.shape:
            with torch.no_grad():
                target.copy_(src)
            return dst
    if isinstance(dst, dict) and isinstance(src, dict):
        for key, value in src.items():
            dst[key] = copy_into(dst[key], value) if key in dst else value
        return dst
    if isinstance(dst, list) and isinstance(src, list) and len(dst) == len(src):
        dst[:] = [copy_into(d, s) for d, s in zip(dst, src)]
        return dst
    return src


class TwoTierCheckpointer:
    """Save locally every LOCAL_EVERY steps and globally every GLOBAL_EVERY steps; resume from the better tier.

    VALIDATE(state_dict) -> bool, if given, is asked about a restored local state before it is used (all ranks
    must agree it is good). Collective: every rank calls ``step`` and ``resume`` at the same points.

    SAVE_ON_FAILURE (with OPTIMIZER): under ``nvrx launch --jit-ckpt``, when another rank fails, the lowest
    surviving rank saves the state of the last completed optimizer step into the global tier as
    ``jit_iter_<iteration>`` (``nvrx.ckpt.jit``), which ``resume`` takes when it is newer than the local tier's.
    The iteration is the last ``step`` call's plus one if OPTIMIZER stepped since (call ``step`` once per optimizer
    step). The state saved is STATE_FN() if given, else the state dict last passed to ``step`` (its tensors as they
    are at that moment: give the live tensors, e.g. ``model.state_dict()``). It declares that state replicated on
    every rank (DDP); sharded state is detected and not saved: the restart then uses the newest local or global
    checkpoint, said in one log line.
    """

    def __init__(self, local: LocalCheckpointManager, global_root: str | os.PathLike, *, local_every: int,
                 global_every: int, validate: Callable[[dict[str, Any]], bool] | None = None,
                 local_async: bool = True, save_on_failure: bool = False, optimizer: Any = None,
                 state_fn: Callable[[], dict[str, Any]] | None = None) -> None:
        if local_every < 1 or global_every < 1:
            raise CheckpointError(f"local_every and global_every must be >= 1 (got {local_every}, {global_every})")
        if save_on_failure and optimizer is None:
            raise ValueError("save_on_failure needs optimizer= (it saves the last completed optimizer step)")
        self.local, self.global_root = local, Path(os.path.abspath(global_root))
        self.local_every, self.global_every, self.validate = local_every, global_every, validate
        self.local_async = local_async  # local files written by the checkpoint writer process, finalized later
        self._dist = DistWrapper()
        self._global_is_jit = False  # the newest global checkpoint found is a just-in-time one
        self._state_fn, self._last_state = state_fn, None
        self._marker = (-1, 0)  # (iteration of the last step() or resume, the gate's optimizer steps then)
        self._jit = self._arm_jit(optimizer) if save_on_failure else None

    # ------------------------------------------------------------------ save on failure

    def _arm_jit(self, optimizer: Any) -> Any:
        from nvrx.ckpt import jit

        if not jit.enabled():
            log.info("save_on_failure=True has no effect without `nvrx launch --jit-ckpt`")
            return None
        saver = jit.JitCheckpointer(self.global_root, optimizer, self._jit_state, self._jit_iteration,
                                    self._global_latest_or_none, step_key=None, name_format=JIT_NAME)
        jit.register(saver)
        return saver

    def _jit_state(self) -> dict[str, Any]:
        if self._state_fn is not None:
            return self._state_fn()
        if self._last_state is None:
            raise CheckpointError("no state to save: step() was not called yet")
        return self._last_state

    def _jit_iteration(self, gate_steps: int) -> int | str:
        iteration, at = self._marker
        if iteration < 0:
            return "no iteration known yet: neither resume() nor step() was called"
        if gate_steps - at in (0, 1):
            return iteration + gate_steps - at
        return (f"the optimizer stepped {gate_steps - at} times since the last TwoTierCheckpointer.step() call: "
                "cannot tell which iteration the state holds (call step() once per optimizer step)")

    def _global_latest_or_none(self) -> int | None:
        latest = self._global_latest(verify=None)  # (on the JIT thread: names only, no checksums)
        return latest if latest >= 0 else None

    def _mark(self, iteration: int) -> None:
        if self._jit is not None:
            self._marker = (iteration, self._jit.gate.steps)  # one assignment: the JIT thread reads both at once

    def step(self, step: int, state_dict: dict[str, Any]) -> str | None:
        """Checkpoint STEP if due: 'global' (DCP, asynchronous), 'local' (a copy, replicated and written in the
        background with LOCAL_ASYNC), or None. A failed local save is logged (when it is found: at the next local
        save or ``close``) and training goes on: the global tier still covers it. A local save still being written
        when the next is due makes that one skipped (logged), not waited for."""
        if self._jit is not None:
            self._last_state = state_dict
            self._mark(step)
        ckpt.maybe_finalize()
        if step % self.global_every == 0:
            ckpt.async_save(state_dict, self.global_root / f"iter_{step:09d}")
            return "global"
        if step % self.local_every == 0:
            if not self._local_ready(step):
                return None
            try:
                self.local.save(state_dict, step, is_async=self.local_async)
            except CheckpointError as exc:
                log.error("local checkpoint skipped, the global tier still covers this run: %s", exc)
                return None
            return "local"
        return None

    def _local_ready(self, step: int) -> bool:
        """Finalize the previous local save if it is written everywhere (never waits for it: under load the
        writer may lag, and training must not stall); False: skip this local save."""
        try:
            if self.local.maybe_finalize():
                return True
        except CheckpointError as exc:  # finalized as failed: a new save may start
            log.error("local checkpoint failed, the global tier still covers this run: %s", exc)
            return True
        log.warning("local checkpoint of step %d skipped: the previous one is still being written", step)
        return False

    def _finish_local(self) -> None:
        """Finalize the pending local save (collective); its failure is logged, not raised."""
        try:
            self.local.wait()
        except CheckpointError as exc:
            log.error("local checkpoint failed, the global tier still covers this run: %s", exc)

    def _global_latest(self, verify: str | None = "full") -> int:
        info = ckpt.find_latest_checkpoint(self.global_root, verify=verify) if self.global_root.is_dir() else None
        m = _GLOBAL_NAME.match(info.path.name) if info is not None else None
        self._global_is_jit = bool(m) and info.path.name.startswith("jit_")
        return int(m.group(1)) if m else -1

    def _try_local(self, state_dict: dict[str, Any]) -> tuple[bool, str]:
        """Load the local tier into STATE_DICT if every rank can and the hook agrees; (ok, why not)."""
        why = ""
        loaded = None
        try:
            restored, _ = self.local.load()
            loaded = restored.state_dict
            if self.validate is not None and not self.validate(loaded):
                why = f"the validation hook rejected rank {self.local.rank}'s restored state"
        except CheckpointError as exc:
            why = str(exc)
        whys = [w for w in self._dist.all_gather_json(why) if w]
        if whys:
            return False, whys[0]
        copy_into(state_dict, loaded)
        return True, ""

    def resume(self, state_dict: dict[str, Any]) -> RestoreResult:
        """Restore the newest restorable iteration into STATE_DICT (in place) and say which tier and why."""
        local_it = self.local.find_latest()
        global_it = self._global_latest()
        fallback = ""
        if local_it >= 0 and local_it >= global_it:
            ok, why = self._try_local(state_dict)
            if ok:
                return self._report(RestoreResult(local_it, "local", f"local iteration {local_it} is at least as new as the "
                                                  f"global tier's ({global_it if global_it >= 0 else 'none'}) and restores faster"))
            fallback = f"local iteration {local_it} is unusable ({why}); "
        elif local_it < 0:
            notes = self.local.find_notes
            fallback = f"no restorable local checkpoint{f' ({notes[-1]})' if notes else ''}; "
        else:
            fallback = f"local iteration {local_it} is not newer; "
        if global_it < 0:
            return self._report(RestoreResult(-1, None, fallback + "no global checkpoint either: starting fresh"))
        jit = " (a just-in-time checkpoint)" if self._global_is_jit else ""
        ckpt.resume(self.global_root, state_dict)
        return self._report(RestoreResult(global_it, "global", fallback + f"global iteration {global_it}{jit}"))

    def _report(self, result: RestoreResult) -> RestoreResult:
        self._mark(max(result.iteration, 0))
        if self.local.rank == 0:
            log.warning("resume: %s from %s tier: %s", result.iteration, result.tier, result.reason)
        return result

    def close(self) -> None:
        """Finish pending saves of both tiers (training is over: nothing is saved on a failure any more)."""
        if self._jit is not None:
            self._jit.close()
            self._jit = None
        self._finish_local()
        ckpt.wait()
