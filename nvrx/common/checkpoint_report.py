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


@dataclass(frozen=True)
class IntervalReport:
    """The checkpoint interval ``every_steps="auto"`` chose and why (``nvrx.ckpt.interval.Choice``'s fields)."""

    every_steps: int
    why: str
    seconds: float | None = None
    save_cost_s: float | None = None
    step_s: float | None = None
    drain_s: float | None = None
    mtbf_s: float | None = None
    restart_s: float | None = None
    expected_goodput: float | None = None


Sink = Callable[[CheckpointReport | IntervalReport], bool]
_sink: Sink | None = None


def set_sink(sink: Sink | None) -> Sink | None:
    """Deliver reports (checkpoints and intervals) to SINK (returns True when delivered); returns the previous sink. None: drop reports."""
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


def report_interval(every_steps: int, why: str, **inputs: float | None) -> bool:
    """Report the checkpoint interval just chosen (EVERY_STEPS, WHY, and INPUTS: IntervalReport's measured fields)
    for `nvrx inspect` (a ``checkpoint_interval`` event of the rank's monitor). Never raises."""
    sink = _sink
    if sink is None:
        return False
    try:
        return bool(sink(IntervalReport(every_steps=int(every_steps), why=str(why)[:500], **inputs)))
    except Exception as exc:  # noqa: BLE001 - a report must never fail training
        log.debug("checkpoint interval report not delivered: %s", exc)
        return False
