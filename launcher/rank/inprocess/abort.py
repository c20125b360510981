"""Aborts: called (from the monitor thread, or the main thread after a local fault) to stop everything
the wrapped function may be blocked in, so that the restart exception can reach it.
"""

from __future__ import annotations

import abc
import logging

from launcher.rank.inprocess import gloo_unblock
from launcher.rank.inprocess.state import State

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
    ``init_process_group`` again.
    """

    def __call__(self, state: State) -> State:
        import torch.distributed as dist

        closed = gloo_unblock.shutdown_gloo_connections()
        if not (dist.is_available() and dist.is_initialized()):
            return state
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
