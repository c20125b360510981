"""The checkpoint interval that maximises expected goodput (``PeriodicCheckpointer(every_steps="auto")``).

A save every T seconds of training costs C seconds of blocked training each time; a failure (mean time between
failures M) loses the restart R plus, on average, the work since the last save (T / 2 to first order). The
fraction of time lost is about C / T + (R + T / 2) / M, smallest at Young's T = sqrt(2 C M); Daly's higher-order
form (2006), used here, is T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C for C < 2 M, else T = M.
R does not move the optimum (every interval pays it once per failure) but is part of the expected goodput.

Inputs are measured while the job runs: C, what each save blocked the training thread (the copy), the step
time, the time a save takes to drain (copy + write + publish: a save is never started before the previous one
drained), the failures seen (this job's restarts across `nvrx resume` continuations, kept in the checkpoint
directory) over the time it has run, or a configured MTBF. Pure functions; the checkpointer re-tunes at each
save and the ranks agree on the largest interval any of them chose.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

MAX_EVERY_STEPS = 100_000  # no failure seen and no MTBF configured: save rarely, bounded
STEP_WINDOW = 64  # step times kept per kind (no save draining / one draining) for their medians
MIN_DRAIN_STEPS = 8  # steps timed while a save drained before the slowdown a drain causes is trusted


class WindowMedian:
    """The median of the last SIZE samples.

    The save cost C holds how much slower steps run while a save drains: the difference of two step-time
    estimates, a few percent of a step. A short moving average of step times swings with every slow step (a
    GC pause, another process on the core), and so did the chosen interval (3 to 60 steps in one run); one slow
    step in SIZE does not move a median.
    """

    def __init__(self, size: int = STEP_WINDOW) -> None:
        self._samples: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        """Add VALUE (O(1): called every training step; the median is taken only when the interval is chosen)."""
        self._samples.append(value)

    def median(self) -> float | None:
        """The median of the window (None while it is empty)."""
        return float(median(self._samples)) if self._samples else None

    def __len__(self) -> int:
        return len(self._samples)


@dataclass(frozen=True)
class Choice:
    """The chosen interval and why (shown by logs and kept in <root>/nvrx_interval.json)."""

    every_steps: int
    seconds: float | None  # the optimum in seconds of training (None: no failure rate known)
    save_cost_s: float
    step_s: float
    drain_s: float
    mtbf_s: float | None
    restart_s: float | None
    expected_goodput: float | None
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def daly_seconds(save_cost: float, mtbf: float) -> float:
    """Daly's optimum checkpoint interval (seconds of work between saves)."""
    if save_cost <= 0:
        save_cost = 1e-6
    if save_cost >= 2 * mtbf:
        return mtbf
    r = save_cost / (2 * mtbf)
    return math.sqrt(2 * save_cost * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - save_cost


def expected_goodput(interval: float, save_cost: float, mtbf: float, restart: float = 0.0) -> float:
    """First-order fraction of wall time that is useful work: saves and failures (restart + half an interval) lost."""
    if interval <= 0 or mtbf <= 0:
        return 0.0
    waste = save_cost / (interval + save_cost) + (restart + (interval + save_cost) / 2) / mtbf
    return max(0.0, 1.0 - waste)


@dataclass(frozen=True)
class SaveCost:
    """Daly's C in its parts: what a save blocks the training thread, and what its drain costs the steps."""

    blocked: float
    draining: float
    drain_measured: bool  # False: the whole drain counts (its slowdown of the steps not timed yet)

    @property
    def total(self) -> float:
        return self.blocked + self.draining


def save_cost(step_s: float, save_s: float | None, drain_s: float, drain_step_s: float | None,
              drain_steps: int) -> SaveCost:
    """What one save costs training: the time it blocks the training thread (SAVE_S) plus how much slower the
    DRAIN_STEPS steps timed while a save drained ran (median DRAIN_STEP_S against STEP_S) over a drain of DRAIN_S
    seconds. The writer shares the host's cores and memory bandwidth with training: on a small host that slowdown
    is most of the cost.

    A part not measured yet is never taken as free: before any save, one step's time stands for the blocking
    part; before MIN_DRAIN_STEPS steps were timed under a drain, the whole drain counts. Taken as zero, the first
    choice was an interval of one step and the next ones a few, the writer never idle, until the slowdown showed.
    """
    blocked = step_s if save_s is None else save_s
    if drain_steps < MIN_DRAIN_STEPS or drain_step_s is None:
        return SaveCost(blocked, drain_s, False)
    slower = max(0.0, drain_step_s - step_s)
    return SaveCost(blocked, slower * (drain_s / max(step_s + slower, 1e-9)), True)


def choose(step_s: float, save_cost_s: float, drain_s: float, mtbf_s: float | None, restart_s: float | None = None,
           max_every: int = MAX_EVERY_STEPS) -> Choice:
    """The interval in steps: Daly's optimum for the measured costs, never below the writer's drain time."""
    step_s = max(step_s, 1e-6)
    floor = max(1, math.ceil(drain_s / step_s))  # one save in flight at a time
    if mtbf_s is None or mtbf_s <= 0:
        every = max(floor, max_every)
        return Choice(every, None, save_cost_s, step_s, drain_s, None, restart_s, None,
                      f"no failure seen and no MTBF configured: every {every} steps")
    seconds = daly_seconds(save_cost_s, mtbf_s)
    every = min(max_every, max(floor, round(seconds / step_s)))
    why = (f"Daly optimum {seconds:.1f} s for save cost {save_cost_s * 1000:.1f} ms and MTBF {mtbf_s:.0f} s "
           f"= {seconds / step_s:.0f} steps of {step_s * 1000:.1f} ms")
    if every == floor and floor > round(seconds / step_s):
        why += f"; raised to {floor} steps: a save takes {drain_s:.2f} s to drain"
    good = expected_goodput(every * step_s, save_cost_s, mtbf_s, restart_s or 0.0)
    return Choice(every, seconds, save_cost_s, step_s, drain_s, mtbf_s, restart_s, round(good, 5), why)
