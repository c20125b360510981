"""Aborts: called (from the monitor thread, or the main thread after a local fault) to stop everything
the wrapped function may be blocked in, so that the restart exception can reach it.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

from nvrx.launcher.rank.inprocess import gloo_unblock, pg_graveyard
from nvrx.launcher.rank.inprocess.state import State

log = logging.getLogger(__name__)


class Abort(abc.ABC):
    """Base class: ``__call__(state) -> state`` (or ``None``). Must not block for long."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State | None:
        raise NotImplementedError


class AbortTorchDistributed(Abort):
    """Tear down torch.distributed: unblock gloo collectives, abort every process group, forget them.

    gloo: its abort does not wake a blocked collective (see ``gloo_unblock``), so the group's TCP
    connections are shut down first. Then ``_abort_process_group`` (NCCL communicators are aborted
    there) and the process-group registry is cleared, so the next iteration can call
    ``init_process_group`` again. The aborted groups stay referenced (``pg_graveyard``) until their gloo
    workers are idle, so their destructor never runs in the restart path while a worker needs the GIL.
    """

    def __init__(self, torch_fr_trace_path: str | None = None) -> None:
        # NCCL's Flight Recorder dumps its traces on abort; gloo (the only backend without a GPU) has none
        self.torch_fr_trace_path = torch_fr_trace_path
        self._trace_note_logged = False

    def __call__(self, state: State) -> State:
        import torch.distributed as dist

        if self.torch_fr_trace_path and not self._trace_note_logged:
            self._trace_note_logged = True
            log.info("AbortTorchDistributed: torch_fr_trace_path is for NCCL Flight Recorder traces (GPU only); "
                     "gloo process groups have none to write")

        closed = gloo_unblock.shutdown_gloo_connections()
        if not (dist.is_available() and dist.is_initialized()):
            return state  # (a group counted by an unfinished init: forget_partial_init at the next iteration start)
        pg_graveyard.keep(_process_groups(dist))
        abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
        try:
            if abort_all is not None:
                abort_all()
            else:
                dist.destroy_process_group()
        except Exception as exc:  # a half-dead group must not stop the restart
            log.debug("aborting the process groups raised %s; destroying them instead", exc)
            try:
                dist.destroy_process_group()
            except Exception:
                log.debug("destroy_process_group failed too", exc_info=True)
        log.debug("process groups aborted (%d gloo connection(s) shut down)", closed)
        return state

    def __repr__(self) -> str:
        return "AbortTorchDistributed()"


def forget_partial_init() -> None:
    """Undo what an ``init_process_group`` that never finished left behind, when no default group exists.

    torch names each new group after a counter (``_world.group_count``) and keys the group's rendezvous by that
    name; it is reset only when a default group is destroyed. An ``init_process_group`` that failed or was
    interrupted part-way (its store's host died, a restart came) has counted its group on this rank only, so in
    the next iteration this rank would rendezvous under another name than its peers and every rank would wait
    for the others for good (seen: both ranks in gloo's ``createAndConnectAllPairs`` until the hard timeout).
    Only touches torch when torch.distributed is already loaded."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or dist.is_initialized():
        return
    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    try:
        if world is not None and world.group_count:
            log.debug("resetting torch's process-group counter (%d) left by an unfinished init_process_group",
                      world.group_count)
            world.group_count = 0
    except Exception:
        log.debug("could not reset torch's process-group counter", exc_info=True)


def _process_groups(dist: Any) -> list[Any]:
    """Every process group torch.distributed knows of (the default one and the subgroups)."""
    c10d = dist.distributed_c10d
    groups = list(getattr(getattr(c10d, "_world", None), "pg_map", {}) or {})
    world = getattr(c10d.GroupMember, "WORLD", None)
    if world is not None and world not in groups:
        groups.append(world)
    return groups


class AbortTransformerEngine(Abort):
    """Reset Transformer Engine's global state (userbuffers, FP8 state) so the next iteration starts clean.

    Without Transformer Engine installed (always the case without a GPU) it does nothing, and says so once.
    """

    _missing_logged = False

    def __call__(self, state: State) -> State:
        try:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # type: ignore[import-not-found]
            from transformer_engine.pytorch.module.base import destroy_ub  # type: ignore[import-not-found]
        except Exception:
            if not AbortTransformerEngine._missing_logged:
                AbortTransformerEngine._missing_logged = True
                log.info("AbortTransformerEngine skipped: transformer_engine is not installed (GPU only)")
            return state
        destroy_ub()
        FP8GlobalStateManager.reset()
        return state

    def __repr__(self) -> str:
        return "AbortTransformerEngine()"
