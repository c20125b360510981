"""The automatic heartbeat timeout: a tight bound derived from a rank's own liveness gaps.

A configured heartbeat timeout must cover the longest legitimate pause of any job, so it is far longer than
what a given job needs, and a hang costs all of it. The rank's slot counts every gap between liveness marks
(beats, explicit or automatic, and section ends) in a log-spaced histogram (``nvrx.monitors.heartbeat``); from it
this module derives, per rank::

    timeout = max(floor, multiple * percentile P of the steady gaps)   (never above the configured timeout)

P is 99 by default (100 = the longest gap), rounded up to its histogram bucket's upper edge. A percentile
leaves out the rare but regular longer pauses (a save every 200 steps, an evaluation, a peer's save another
rank waits for in a collective, a moment without CPU on a loaded machine): those are not judged by the
timeout alone. When a rank passes it, the monitor looks before it acts (``nvrx.monitors.rank_activity``): a rank
whose main thread is on the CPU, runnable or in disk wait is busy, and so is one whose local peers are (it
is waiting for them); only a stopped rank, or one asleep with every local peer stuck too, is hung. A busy
rank is looked at again one timeout later, and the configured timeout stays the absolute bound.

When the timeout may be derived and enforced (false alarms are the cost to avoid):

* *settle*: after each (re)start of the rank, for ``settle_s`` after its first liveness mark, and on a restart
  until the rank is back in its rhythm (``STEADY_STREAK`` gaps in a row below half the bound), the configured
  timeout applies and the gaps are not counted (process-group set-up, checkpoint load, the first steps after a
  restore are slower than the steady state, and much slower on a loaded machine);
* *warm-up*: the first derivation needs ``warmup_beats`` steady gaps over ``warmup_s`` seconds; observations
  carry over the rank's restarts (the monitor outlives them), so a restarted rank is only settled again;
* *widening*: the bound follows the percentile up as the rank slows (it never narrows).

Modes: ``off``; ``suggest`` (the default: derive and report it, enforce the configured timeout); ``set``.
Every change is reported (event ``heartbeat_timeout_auto``) with the figures it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from nvrx.monitors.heartbeat import GAP_BUCKETS, gap_bucket, gap_bucket_upper

MODES = ("off", "suggest", "set")
STEADY_STREAK = 20  # gaps in a row below half the bound: a restarted rank is back in its rhythm


@dataclass(frozen=True)
class AutoTimeoutSettings:
    """The ``heartbeat_timeout_auto*`` settings of ``FaultToleranceConfig``."""

    mode: str = "suggest"
    multiple: float = 4.0
    floor: float = 0.25
    percentile: float = 99.0
    warmup_beats: int = 300
    warmup_s: float = 20.0
    settle_s: float = 5.0


@dataclass(frozen=True)
class AutoTimeoutChange:
    """A new automatic timeout and the figures it was derived from (the event's content)."""

    timeout: float
    previous: float | None
    reason: str             # warm-up done | longer gap observed
    basis: float            # the percentile's gap the bound is a multiple of (its bucket's upper edge)
    longest_gap: float      # the longest steady gap, rounded up to its bucket's edge
    p50: float
    p99: float
    gaps: int               # steady gaps observed
    observed_s: float       # steady seconds observed
    capped: bool            # the bound reached the configured timeout (the configured one stays in force)


def percentile(hist: list[int], q: float) -> float | None:
    """The upper edge of the bucket holding quantile Q (0..1) of HIST; None if empty."""
    total = sum(hist)
    if not total:
        return None
    need, seen = q * total, 0
    for b, n in enumerate(hist):
        seen += n
        if n and seen >= need:
            return gap_bucket_upper(b)
    return gap_bucket_upper(max(b for b, n in enumerate(hist) if n))


def longest(hist: list[int]) -> float | None:
    top = max((b for b, n in enumerate(hist) if n), default=None)
    return None if top is None else gap_bucket_upper(top)


class AutoTimeout:
    """One rank's steady gap statistics and the automatic heartbeat timeout derived from them."""

    def __init__(self, settings: AutoTimeoutSettings, configured: float | None) -> None:
        self.settings = settings
        self.configured = configured
        self.reset()

    def reset(self) -> None:
        """Forget everything (another global rank's observations must not carry over)."""
        self.prior = [0] * GAP_BUCKETS     # steady gaps of earlier runs of the rank
        self.prior_s = 0.0
        self.timeout: float | None = None  # derived (None: still warming up)
        self.start_run()

    def start_run(self) -> None:
        """A new run of the rank: settle again before anything is counted or enforced."""
        self.settle_from: float | None = None  # the run's first liveness mark
        self.settle_end: float | None = None   # when it settled (None: still settling)
        self.streak = 0
        self.baseline: tuple[int, ...] | None = None
        self.run_hist = [0] * GAP_BUCKETS
        self.run_s = 0.0

    def end_run(self) -> None:
        self.prior = [a + b for a, b in zip(self.prior, self.run_hist)]
        self.prior_s += self.run_s
        self.start_run()

    @property
    def active(self) -> bool:
        return self.settings.mode != "off"

    def settled(self, now: float) -> bool:
        return self.settle_end is not None and now >= self.settle_end

    def _settle(self, hist: tuple[int, ...], now: float) -> None:
        """Count the steady streak (restarts) and end the settling phase when it is over."""
        if self.baseline is not None and self.timeout is not None:
            edge = gap_bucket(self.timeout / 2)
            new = [a - b for a, b in zip(hist, self.baseline)]
            self.streak = 0 if any(new[edge:]) else self.streak + sum(new)
        self.baseline = hist  # gaps of the settling phase are not steady ones
        if now - self.settle_from >= self.settings.settle_s and (self.timeout is None
                                                                 or self.streak >= STEADY_STREAK):
            self.settle_end = now

    def observe(self, hist: tuple[int, ...], beaten: bool, now: float) -> AutoTimeoutChange | None:
        """Fold the slot's histogram HIST in; returns the change of the derived timeout, if any."""
        if not self.active or not hist:
            return None
        if self.settle_from is None:
            if not beaten:
                return None
            self.settle_from = now
        if self.settle_end is None:
            self._settle(hist, now)
            return None
        self.run_hist = [a - b for a, b in zip(hist, self.baseline)]
        self.run_s = now - self.settle_end
        return self._derive()

    def _derive(self) -> AutoTimeoutChange | None:
        s = self.settings
        steady = [a + b for a, b in zip(self.prior, self.run_hist)]
        gaps, seconds = sum(steady), self.prior_s + self.run_s
        if self.timeout is None and (gaps < s.warmup_beats or seconds < s.warmup_s):
            return None
        top = longest(steady)
        if top is None:
            return None
        top = round(top, 6)  # as reported
        basis = top if s.percentile >= 100 else round(percentile(steady, s.percentile / 100) or top, 6)
        bound = round(max(s.floor, s.multiple * basis), 6)
        capped = self.configured is not None and bound >= self.configured
        if capped:
            bound = float(self.configured)  # type: ignore[arg-type]
        if self.timeout is not None and bound <= self.timeout:
            return None  # only ever widens: a bound that held so far stays
        previous, self.timeout = self.timeout, bound
        return AutoTimeoutChange(timeout=bound, previous=previous,
                                 reason="warm-up done" if previous is None else "longer gap observed",
                                 basis=basis, longest_gap=top, p50=percentile(steady, 0.5) or 0.0,
                                 p99=percentile(steady, 0.99) or 0.0, gaps=gaps, observed_s=round(seconds, 3),
                                 capped=capped)

    def enforced(self, now: float) -> float | None:
        """The timeout to enforce now instead of the configured one (None: the configured one applies)."""
        if self.settings.mode != "set" or self.timeout is None or not self.settled(now):
            return None
        if self.configured is not None and self.timeout >= self.configured:
            return None
        return self.timeout
