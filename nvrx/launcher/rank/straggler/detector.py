"""``Detector``: explicit timing of named sections inside ranks, scored across ranks (NVRx's straggler API).

A compatible subset of ``nvidia_resiliency_ext.straggler.Detector``: class methods, no instances::

    Detector.initialize(scores_to_compute="all", gather_on_rank0=True, report_time_interval=60)
    with Detector.detection_section("fwd_bwd"):
        loss = model(batch); loss.backward()
    report = Detector.generate_report_if_interval_elapsed()   # collective; None until the interval passed
    if report is not None and dist.get_rank() == 0:
        print(report.identify_stragglers())
    Detector.shutdown()

Each section's CPU wall-clock time is measured (every ``profiling_interval``-th entry) with
``time.perf_counter``; a report summarises each section per rank (``Statistic``) and scores its median with
the one straggler method the agents use too (``nvrx.monitors.straggler``): relative to the median of the
other ranks' medians, and individually to the median of the rank's own earlier reports, worded as NVRx's
performance scores (``perf_score``: 1.0 = as fast as the reference, 0.5 = twice as slow). The ranks
exchange their medians as JSON in uint8 tensors over the default process group (never pickled); without
one, a report covers this process alone.

Not provided: CUDA kernel profiling (CUPTI) - ``profile_cuda`` is accepted and the GPU scores are empty;
the first section entered with ``profile_cuda=True`` (the default) says so in one warning line, with the
reason (no CUDA device, or no kernel profiling in nvrx); ``profile_cuda=False`` says nothing.
``wrap_callables``. Time a section that holds the rank's own work, not a collective: in lock-step training
every rank waits for the slowest inside a collective, so such a section takes equally long everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from nvrx.launcher.rank.rerun.collective import all_gather_json, rank_and_world, reduce_max
from nvrx.launcher.rank.straggler.reporting import Report
from nvrx.launcher.rank.straggler.statistics import Statistic, summarize
from nvrx.monitors.straggler import HISTORY, own_reference, perf_score, slowdowns

log = logging.getLogger("nvrx.straggler")

SCORES = ("relative_perf_scores", "individual_perf_scores")


@dataclass
class _Section:
    """One named section: how often it was entered, and the timed durations of this report interval."""

    entries: int = 0
    elapsed: list[float] = field(default_factory=list)
    history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))  # medians of earlier reports


def _scores_wanted(scores_to_compute: str | Sequence[str]) -> frozenset[str]:
    wanted = set(SCORES) if scores_to_compute == "all" else set(scores_to_compute)
    bad = sorted(wanted - set(SCORES))
    if bad or isinstance(scores_to_compute, str) and scores_to_compute != "all":
        raise ValueError(f"scores_to_compute must be 'all' or a list of {', '.join(SCORES)}; got {scores_to_compute!r}")
    return frozenset(wanted)


class Detector:
    """Straggler detection sections inside a rank (class methods only, like NVRx's)."""

    initialized: bool = False
    scores_to_compute: frozenset[str] = frozenset()
    gather_on_rank0: bool = True
    profiling_interval: int = 1
    report_time_interval: float = 60.0
    node_name: str = ""
    custom_sections: dict[str, _Section] = {}
    _last_report: float = 0.0
    _calls: int = 0              # calls of generate_report_if_interval_elapsed since its last check
    _check_every: int = 1        # calls between two checks (agreed by all ranks)
    _last_check: float = 0.0
    _cuda_said: bool = False     # the one line about profile_cuda was logged (once per initialize)

    def __new__(cls, *args: Any, **kwargs: Any) -> "Detector":
        raise TypeError("Detector is not instantiated: use its class methods (Detector.initialize(...))")

    @classmethod
    def initialize(cls, scores_to_compute: str | Sequence[str] = "all", gather_on_rank0: bool = True,
                   profiling_interval: int = 1, report_time_interval: float = 60.0,
                   node_name: str | None = None) -> None:
        """Start detection. ValueError on bad arguments; RuntimeError if already initialized."""
        if cls.initialized:
            raise RuntimeError("Detector is already initialized (call Detector.shutdown() first)")
        wanted = _scores_wanted(scores_to_compute)
        if not isinstance(profiling_interval, int) or isinstance(profiling_interval, bool) or profiling_interval < 1:
            raise ValueError(f"profiling_interval must be an integer >= 1, got {profiling_interval!r}")
        if not isinstance(report_time_interval, (int, float)) or not report_time_interval > 0:
            raise ValueError(f"report_time_interval must be a number of seconds > 0, got {report_time_interval!r}")
        cls.scores_to_compute = wanted
        cls.gather_on_rank0 = bool(gather_on_rank0)
        cls.profiling_interval = profiling_interval
        cls.report_time_interval = float(report_time_interval)
        cls.node_name = node_name or socket.gethostname()
        cls.custom_sections = {}
        cls._last_report = cls._last_check = time.monotonic()
        cls._calls, cls._check_every = 0, 1
        cls._cuda_said = False
        cls.initialized = True

    @classmethod
    def shutdown(cls) -> None:
        """Stop detection and forget every section (initialize may be called again)."""
        cls.initialized = False
        cls.custom_sections = {}

    @classmethod
    @contextlib.contextmanager
    def detection_section(cls, name: str | None = None, profile_cuda: bool = True) -> Iterator[None]:
        """Time the block as section NAME (default: the caller's file:line). PROFILE_CUDA cannot be honoured:
        said once (see the module's docstring)."""
        if not cls.initialized:
            raise RuntimeError("Detector.detection_section: call Detector.initialize(...) first")
        if name is None:
            caller = sys._getframe(2)  # [0] this generator, [1] contextlib's __enter__, [2] the with statement
            name = f"{caller.f_code.co_filename}:{caller.f_lineno}"  # cheap, unlike inspect.stack()
        if profile_cuda and not cls._cuda_said:
            cls._cuda_said = True
            log.warning("straggler.Detector: section %r: profile_cuda=True has no effect (%s); sections are timed on "
                        "the CPU clock and the GPU scores stay empty; pass profile_cuda=False to say so",
                        name, _why_no_cuda_profiling())
        section = cls.custom_sections.get(name)
        if section is None:
            section = cls.custom_sections[name] = _Section()
        section.entries += 1
        if (section.entries - 1) % cls.profiling_interval:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            section.elapsed.append(time.perf_counter() - start)

    @classmethod
    def is_interval_elapsed(cls) -> bool:
        """This rank's report interval has passed (local: ranks' clocks differ, see the next method)."""
        return cls.initialized and time.monotonic() - cls._last_report >= cls.report_time_interval

    @classmethod
    def generate_report_if_interval_elapsed(cls) -> Report | None:
        """Collective (call it on every rank, e.g. once per step): a report once the interval passed, else None.

        The ranks agree with a one-integer all-reduce, but not on every call: only every ``_check_every``-th
        call, a count set from the agreed (maximum) call rate so that there are about 20 checks per interval.
        Every rank computes the same count from the same reduced values, so they stay in step.
        """
        if not cls.initialized:
            raise RuntimeError("Detector.generate_report_if_interval_elapsed: call Detector.initialize(...) first")
        cls._calls += 1
        if cls._calls < cls._check_every:
            return None
        now = time.monotonic()
        rate = cls._calls / max(now - cls._last_check, 1e-6)  # this rank's calls per second since the last check
        cls._calls, cls._last_check = 0, now
        due, top_rate = reduce_max([int(cls.is_interval_elapsed()), int(rate)])
        cls._check_every = max(1, int(top_rate * cls.report_time_interval / 20))
        return cls.generate_report() if due else None

    @classmethod
    def generate_report(cls) -> Report:
        """Collective (every rank must call it): summarise this interval's sections and score the ranks."""
        if not cls.initialized:
            raise RuntimeError("Detector.generate_report: call Detector.initialize(...) first")
        t0 = time.perf_counter()
        rank, _ = rank_and_world()
        summaries = {name: summarize(s.elapsed) for name, s in cls.custom_sections.items() if s.elapsed}
        medians = {name: summary[Statistic.MED] for name, summary in summaries.items()}
        individual = cls._individual_scores(medians)
        everyone = all_gather_json({"node": cls.node_name, "med": medians, "ind": individual})
        rank_to_node = {r: str(v.get("node")) for r, v in enumerate(everyone)}
        relative = _relative_scores([v.get("med") or {} for v in everyone])
        indiv_all = {name: {r: v["ind"][name] for r, v in enumerate(everyone) if name in (v.get("ind") or {})}
                     for name in sorted({n for v in everyone for n in (v.get("ind") or {})})}
        for section in cls.custom_sections.values():
            section.elapsed = []
        cls._last_report = time.monotonic()
        keep = _keeper(cls.gather_on_rank0, rank)
        want_rel, want_ind = "relative_perf_scores" in cls.scores_to_compute, "individual_perf_scores" in cls.scores_to_compute
        return Report(
            gpu_relative_perf_scores={}, gpu_individual_perf_scores={},
            section_relative_perf_scores=_only(relative, keep) if want_rel else {},
            section_individual_perf_scores=_only(indiv_all, keep) if want_ind else {},
            rank_to_node={r: n for r, n in rank_to_node.items() if keep(r)}, local_section_summaries=summaries,
            local_kernel_summaries={}, generate_report_elapsed_time=time.perf_counter() - t0,
            gather_on_rank0=cls.gather_on_rank0, rank=rank)

    @classmethod
    def _individual_scores(cls, medians: dict[str, float]) -> dict[str, float]:
        """Each section's median against the median of its own earlier reports (``own_reference``), as a
        performance score (1.0 until there are enough earlier reports); this median joins the history."""
        out = {}
        for name, median in medians.items():
            section = cls.custom_sections[name]
            own = own_reference(section.history)
            out[name] = perf_score(median / own if own and median > 0 else None)
            section.history.append(median)
        return out


def _why_no_cuda_profiling() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return "nvrx does not profile CUDA kernels"


def _relative_scores(medians: list[dict[str, float]]) -> dict[str, dict[int, float]]:
    """Per section: each rank's performance score against the median of the other ranks' medians."""
    out: dict[str, dict[int, float]] = {}
    for name in sorted({n for m in medians for n in m}):
        values = {r: float(m[name]) for r, m in enumerate(medians)
                  if isinstance(m.get(name), (int, float)) and not isinstance(m.get(name), bool)}
        timed = slowdowns({r: v for r, v in values.items() if v > 0})
        out[name] = {r: perf_score(timed[r][1] if r in timed else None) for r in values}
    return out


def _keeper(gather_on_rank0: bool, rank: int) -> Any:
    """Which ranks' scores this rank's report holds: all on rank 0 when gathering there (none elsewhere),
    else only its own (NVRx's rule)."""
    if not gather_on_rank0:
        return lambda r: r == rank
    return (lambda r: True) if rank == 0 else (lambda r: False)


def _only(scores: dict[str, dict[int, float]], keep: Any) -> dict[str, dict[int, float]]:
    return {name: {r: s for r, s in by_rank.items() if keep(r)} for name, by_rank in scores.items()}
