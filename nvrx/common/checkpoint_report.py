"""The one call every checkpointer makes when a checkpoint becomes complete: ``report_checkpoint``.

`nvrx inspect` counts work redone after a restart from the checkpoints that were complete when a round
stopped. nvrx's own checkpointers (``nvrx.ckpt``: ``AsyncCheckpointer`` / ``PeriodicCheckpointer``, the local
tier, ``TwoTierCheckpointer``, just-in-time saves) call ``report_checkpoint(step, tier, taken=...)`` at the
moment a checkpoint is complete on every rank (published / written everywhere), once per rank. Under
``nvrx launch`` the rank's monitor link (``nvrx.monitors.client``) is the sink: the report travels to the
rank's monitor, which writes it as a ``checkpoint_complete`` event. Without a sink (no launcher) it does
nothing. It never raises and never blocks for long: a checkpoint is never failed by its report.

This module sits in ``nvrx.common`` so that ``nvrx.ckpt`` (which imports nothing of the monitors) can call it,
and ``nvrx.monitors`` can install the sink.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("nvrx.checkpoint_report")

TIERS = ("global", "local", "jit")  # the tiers nvrx's checkpointers report (others are accepted as they are)


@dataclass(frozen=True)
class CheckpointReport:
    """One complete checkpoint: the STEP it holds, its TIER, when its state was TAKEN and where (PATH)."""

    step: int | None
    tier: str
    taken: float | None
    completed: float
    path: str | None = None


Sink = Callable[[CheckpointReport], bool]
_sink: Sink | None = None


def set_sink(sink: Sink | None) -> Sink | None:
    """Deliver reports to SINK (returns True when delivered); returns the previous sink. None: drop reports."""
    global _sink
    previous, _sink = _sink, sink
    return previous


def report_checkpoint(step: int | None, tier: str, *, taken: float | None = None, path: str | None = None) -> bool:
    """Report that the checkpoint of training step STEP on TIER is complete on every rank (call it on each rank).

    TAKEN: unix time its state was taken (progress after it is not in the checkpoint; default now). PATH: where it
    is. Returns whether a monitor got it. Never raises.
    """
    sink = _sink
    if sink is None:
        return False
    try:
        report = CheckpointReport(step=int(step) if step is not None else None, tier=str(tier),
                                  taken=float(taken) if taken is not None else None, completed=time.time(),
                                  path=str(path) if path is not None else None)
        return bool(sink(report))
    except Exception as exc:  # a report must never fail a checkpoint
        log.debug("checkpoint report of step %s (%s) not delivered: %s", step, tier, exc)
        return False
