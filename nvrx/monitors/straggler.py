"""Straggler detection: the one home of the scoring method, and the sampling every rank monitor does.

**The method** (used by the agents' ``StragglerScorer`` and by the in-rank ``Detector`` of
``nvrx.launcher.rank.straggler``): the statistic is the **median** duration of a metric (a section, or the
heartbeat interval) over a report window. A rank's **relative** slowdown is its median / the median of the
*other* ranks' medians (``slowdowns``: 1.5 = 50 % slower than its peers; the peers' median, not the fastest
rank, so one unusually fast rank does not make everyone look slow); its **individual** slowdown is its median
/ the median of its own earlier reports (``own_reference``, from ``BASELINE_MIN`` reports on). The agents
judge slowdowns against ``threshold``; NVRx's ``Report`` words the same numbers as performance scores,
``perf_score(slowdown) = min(1, 1 / slowdown)`` (1.0 = as fast as the reference, 0.5 = twice as slow).

Around it, pure (no I/O), so tested and benchmarked without processes:

* ``TimingSampler`` runs in each rank monitor. On every look at its rank's heartbeat slot it records the
  duration of each section closed since the last look (the slot keeps the last duration and a close
  count per section) and the mean heartbeat interval since the last look (beat count and last beat time).
  Every report interval it hands over one ``RankSummary``: per metric (a section name, or ``HEARTBEAT``)
  the median of the window's samples and how many there were. A monitor knows only its own rank, so it
  never compares; its summary goes to its event file (``rank_timing``), which its agent reads.
* ``StragglerScorer`` runs in one agent (group rank 0), which gathers every node's summaries through the
  rendezvous store (``nvrx.launcher.agent.stragglers``). A rank is slow in a report when its relative
  slowdown reaches ``threshold`` (with enough samples on both sides; without peers, its individual slowdown
  decides: a job-wide slowdown is not a straggler); it is flagged once it was slow in ``sustain``
  consecutive reports, and cleared after one report that is not slow.

Robustness on a noisy machine comes from medians (of the samples in a window, of the peers, of the own
history), a minimum sample count per window and the sustain count; a single slow step never flags a rank.

In lock-step (data-parallel) training every rank waits for the slowest in the step's collective, so a
section that contains the collective lasts equally long on every rank: time the rank's own work in a
section (e.g. ``forward_backward``) or use ``nvrx.launcher.rank.straggler.Detector`` to see which rank is slow.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

HEARTBEAT = "<heartbeat>"     # the metric name of heartbeat intervals (section names cannot contain '<')
MIN_SAMPLES = 3               # a window's median needs at least this many samples to count
MAX_SAMPLES = 4096            # per metric and window: bounds a monitor's memory for very short sections
HISTORY = 32                  # reports of a rank's own history kept for its individual score
BASELINE_MIN = 2              # earlier reports needed before an individual score is given


# ------------------------------------------------------------------ the method


def slowdowns(medians: Mapping[int, float]) -> dict[int, tuple[float | None, float | None]]:
    """Per rank of MEDIANS (all > 0): (reference, slowdown), the reference being the median of the other
    ranks' medians (None without other ranks) and the slowdown median / reference. O(n log n): one sort."""
    ordered = sorted(medians.values())
    position: dict[float, int] = {}
    for i, m in enumerate(ordered):
        position.setdefault(m, i)  # equal values are interchangeable: any one of them may be left out
    out = {}
    for rank, median in medians.items():
        ref = median_without(ordered, position[median])
        out[rank] = (ref, median / ref if ref else None)
    return out


def own_reference(history: Sequence[float] | None) -> float | None:
    """The reference of a rank's individual slowdown: the median of its own earlier report medians
    (None before ``BASELINE_MIN`` of them)."""
    return statistics.median(history) if history is not None and len(history) >= BASELINE_MIN else None


def perf_score(slowdown: float | None) -> float:
    """A slowdown as NVRx's performance score: reference / median, at most 1.0 (1.0: nothing to compare with)."""
    return 1.0 if slowdown is None or slowdown <= 0 else min(1.0, 1.0 / slowdown)


# ------------------------------------------------------------------ monitor side


@dataclass(frozen=True)
class MetricSummary:
    """One metric of one rank over one report window: the median duration (seconds) and the sample count."""

    median: float
    samples: int


RankSummary = dict[str, MetricSummary]


@dataclass
class TimingSampler:
    """Collects one rank's section durations and heartbeat intervals between reports (see the module doc)."""

    _closes: dict[int, int] = field(default_factory=dict)     # section id -> close count at the last look
    _hb: tuple[int, float] | None = None                      # (beat count, last beat time) at the last look
    _samples: dict[str, list[float]] = field(default_factory=dict)

    def reset(self) -> None:
        """A new rank run: its slot starts from zero, and its windows must not mix with the previous run's."""
        self._closes.clear()
        self._hb = None
        self._samples.clear()

    def observe(self, hb_count: int, last_hb: float, section_closes: Iterable[int],
                section_last: Iterable[float], names: Mapping[int, str]) -> None:
        """Record what changed since the last look: NAMES maps the slot's section ids to names."""
        for sid, (closes, last) in enumerate(zip(section_closes, section_last)):
            seen = self._closes.get(sid)
            if closes != seen:
                self._closes[sid] = closes
                name = names.get(sid)
                if seen is not None and closes > seen and name is not None and last >= 0:
                    self._add(name, last)  # the newest close only: sampled, not every close
        if hb_count > 0:
            if self._hb is not None and hb_count > self._hb[0] and last_hb > self._hb[1]:
                self._add(HEARTBEAT, (last_hb - self._hb[1]) / (hb_count - self._hb[0]))
            self._hb = (hb_count, last_hb)

    def _add(self, name: str, value: float) -> None:
        bucket = self._samples.setdefault(name, [])
        if len(bucket) < MAX_SAMPLES:
            bucket.append(value)

    def take(self) -> RankSummary:
        """The window's summary (metrics with at least one sample); starts the next window."""
        out = {name: MetricSummary(statistics.median(values), len(values))
               for name, values in self._samples.items() if values}
        self._samples = {}
        return out


# ------------------------------------------------------------------ aggregator side


@dataclass(frozen=True)
class Score:
    """One rank's scores for one metric in one report (ratios: 1.0 = as fast as the reference)."""

    rank: int
    node: str
    metric: str
    median: float
    peers: float | None          # the median of the other ranks' medians (None: no peer with enough samples)
    relative: float | None
    individual: float | None
    slow: bool


@dataclass(frozen=True)
class Straggler:
    """A rank flagged (or just cleared) as a straggler for one metric."""

    rank: int
    node: str
    metric: str
    relative: float | None
    individual: float | None
    median: float
    peers: float | None
    since: float                  # when its first slow report of this streak was made
    reports: int                  # consecutive slow reports so far
    state: str                    # "straggler" | "recovered"


@dataclass
class _Streak:
    start: float
    reports: int = 0
    flagged: bool = False


class StragglerScorer:
    """Compares ranks report by report; keeps each rank's history and slow streaks (see the module doc)."""

    def __init__(self, threshold: float = 1.2, sustain: int = 2, min_samples: int = MIN_SAMPLES) -> None:
        self.threshold = threshold
        self.sustain = max(1, int(sustain))
        self.min_samples = max(1, int(min_samples))
        self._history: dict[tuple[int, str], deque[float]] = {}
        self._streaks: dict[tuple[int, str], _Streak] = {}

    def scores(self, summaries: Mapping[int, tuple[str, RankSummary]]) -> list[Score]:
        """The scores of one report; SUMMARIES maps each global rank to (its node, its summary)."""
        out: list[Score] = []
        metrics = sorted({m for _, summary in summaries.values() for m in summary})
        for metric in metrics:
            usable = {r: s[metric].median for r, (_, s) in summaries.items()
                      if metric in s and s[metric].samples >= self.min_samples and s[metric].median > 0}
            relative_to_peers = slowdowns(usable)
            for rank, median in sorted(usable.items()):
                ref, relative = relative_to_peers[rank]
                own = own_reference(self._history.get((rank, metric)))
                individual = median / own if own else None
                # Peers decide: a job-wide slowdown (every rank slower than its own past) is not a straggler.
                # Without peers (a one-rank job) the rank's own history is the only reference.
                slow = (relative >= self.threshold if relative is not None
                        else individual is not None and individual >= self.threshold)
                out.append(Score(rank, summaries[rank][0], metric, median, ref, relative, individual, slow))
        return out

    def update(self, summaries: Mapping[int, tuple[str, RankSummary]], now: float,
               fresh: Iterable[int] | None = None) -> tuple[list[Score], list[Straggler]]:
        """Score one report, advance the streaks and the histories; returns (scores, flagged or cleared ranks).

        FRESH: the ranks whose summary is new in this report (default all); the others serve as peers only,
        so a summary is never counted twice in a streak. A flagged rank is returned on every report while it
        stays slow (its ``reports`` grows), once as ``recovered`` when it is not slow any more.
        """
        scores = self.scores(summaries)
        new = set(summaries) if fresh is None else set(fresh)
        changes: list[Straggler] = []
        for sc in scores:
            key = (sc.rank, sc.metric)
            if sc.rank not in new:
                continue
            streak = self._streaks.get(key)
            if sc.slow:
                streak = streak or self._streaks.setdefault(key, _Streak(now))
                streak.reports += 1
                if streak.reports >= self.sustain:
                    streak.flagged = True
                    changes.append(self._straggler(sc, streak, "straggler"))
            elif streak is not None:
                if streak.flagged:
                    changes.append(self._straggler(sc, streak, "recovered"))
                del self._streaks[key]
            if not sc.slow or (sc.individual is None and self._history.get(key) is None):
                # the own history learns from normal reports only, so a slow streak does not become the norm
                self._history.setdefault(key, deque(maxlen=HISTORY)).append(sc.median)
        return scores, changes  # a rank without data this report keeps its streak as it was

    @staticmethod
    def _straggler(sc: Score, streak: _Streak, state: str) -> Straggler:
        return Straggler(sc.rank, sc.node, sc.metric, sc.relative, sc.individual, sc.median, sc.peers,
                         streak.start, streak.reports, state)

    def streak_of_node(self, node: str, summaries: Mapping[int, tuple[str, RankSummary]]) -> int:
        """The longest current slow streak of any rank on NODE (for the exclusion policy)."""
        ranks = {r for r, (n, _) in summaries.items() if n == node}
        return max((s.reports for (r, _), s in self._streaks.items() if r in ranks and s.flagged), default=0)


def median_without(ordered: list[float], i: int) -> float | None:
    """The median of the sorted list ORDERED without its element at index I, in O(1) (None if nothing is left).

    Each rank is compared with the median of the *other* ranks, so with two ranks a slow one is measured
    against the fast one, not against a middle it pulls towards itself. Per report this is O(n log n) for
    n ranks (one sort), not O(n^2).
    """
    n = len(ordered) - 1
    if n <= 0:
        return None

    def at(j: int) -> float:  # the j-th element of the list without index i
        return ordered[j] if j < i else ordered[j + 1]

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


def metric_text(metric: str) -> str:
    """A metric as a person reads it: ``section 'step'`` or ``heartbeat interval``."""
    return "heartbeat interval" if metric == HEARTBEAT else f"section {metric!r}"


def summary_to_json(summary: RankSummary) -> dict[str, list[float | int]]:
    """A summary as JSON ({metric: [median, samples]}): what crosses process and node boundaries."""
    return {name: [round(m.median, 9), m.samples] for name, m in summary.items()}


def summary_from_json(raw: object) -> RankSummary:
    """The inverse of summary_to_json; entries that are not [number > 0, count >= 1] are dropped (untrusted)."""
    out: RankSummary = {}
    if not isinstance(raw, dict):
        return out
    for name, value in raw.items():
        if (isinstance(name, str) and isinstance(value, list) and len(value) == 2
                and isinstance(value[0], (int, float)) and not isinstance(value[0], bool) and value[0] > 0
                and isinstance(value[1], int) and not isinstance(value[1], bool) and value[1] >= 1):
            out[name] = MetricSummary(float(value[0]), value[1])
    return out
