"""``StragglerDetectionCallback``: NVRx's Lightning callback for straggler detection, on nvrx's ``Detector``.

It times each ``training_step`` (the forward pass: under DDP the gradient all-reduce runs in backward, so
this is the rank's own work) as the detection section ``training_step``, and every ``report_time_interval``
seconds makes a collective report (``nvrx.launcher.rank.straggler.Detector``). Rank 0 logs the best and worst
scores and the stragglers; ``stop_if_detected`` stops the fit on every rank once one is found.

nvrx profiles no CUDA kernels: the "GPU" arguments apply to the ``training_step`` section's CPU wall-clock
scores instead (``calc_relative_gpu_perf`` / ``calc_individual_gpu_perf`` pick the scores,
``gpu_*_perf_threshold`` the thresholds), which is what a CPU-only or gloo job can measure.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from nvrx.launcher.rank.ptl_resiliency._lightning import Callback
from nvrx.launcher.rank.rerun.collective import reduce_max
from nvrx.launcher.rank.straggler import Detector, Report

SECTION = "training_step"


class StragglerDetectionCallback(Callback):
    """Straggler detection for ``Trainer.fit`` (NVRx's arguments; see the module doc for the GPU ones)."""

    def __init__(self, report_time_interval: float, calc_relative_gpu_perf: bool, calc_individual_gpu_perf: bool,
                 num_gpu_perf_scores_to_print: int, gpu_relative_perf_threshold: float,
                 gpu_individual_perf_threshold: float, stop_if_detected: bool, enable_ptl_logging: bool = False,
                 profiling_interval: int = 1,
                 logger_name: Optional[str] = "nemo_logger.StragglerDetectionCallback") -> None:
        """Lightweight: the detector starts in ``setup``. ValueError on a bad argument (checked here, early)."""
        if not isinstance(report_time_interval, (int, float)) or not report_time_interval > 0:
            raise ValueError(f"report_time_interval must be > 0 seconds, got {report_time_interval!r}")
        if not isinstance(num_gpu_perf_scores_to_print, int) or num_gpu_perf_scores_to_print < 0:
            raise ValueError(f"num_gpu_perf_scores_to_print must be an integer >= 0, got {num_gpu_perf_scores_to_print!r}")
        for name, value in (("gpu_relative_perf_threshold", gpu_relative_perf_threshold),
                            ("gpu_individual_perf_threshold", gpu_individual_perf_threshold)):
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a score between 0 and 1, got {value!r}")
        self.report_time_interval = float(report_time_interval)
        self.calc_relative = bool(calc_relative_gpu_perf)
        self.calc_individual = bool(calc_individual_gpu_perf)
        self.num_to_print = num_gpu_perf_scores_to_print
        self.rel_threshold = float(gpu_relative_perf_threshold)
        self.indiv_threshold = float(gpu_individual_perf_threshold)
        self.stop_if_detected = bool(stop_if_detected)
        self.enable_ptl_logging = bool(enable_ptl_logging)
        self.profiling_interval = profiling_interval
        self.logger = logging.getLogger(logger_name)
        self.reports: list[Report] = []  # every report this rank made (tests and callers may read them)
        self._unwrap: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        scores = [n for n, on in (("relative_perf_scores", self.calc_relative),
                                  ("individual_perf_scores", self.calc_individual)) if on]
        Detector.initialize(scores_to_compute=scores or ["relative_perf_scores"], gather_on_rank0=True,
                            profiling_interval=self.profiling_interval, report_time_interval=self.report_time_interval)
        self._wrap_training_step(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        Detector.shutdown()

    def _wrap_training_step(self, trainer: Any) -> None:
        """Time the strategy's training_step (what Lightning calls for the forward pass) as the section."""
        strategy = trainer.strategy
        original = strategy.training_step

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with Detector.detection_section(SECTION):
                return original(*args, **kwargs)

        strategy.training_step = timed
        self._unwrap = lambda: setattr(strategy, "training_step", original)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        report = Detector.generate_report_if_interval_elapsed()  # collective: every rank reaches this hook
        if report is None:
            return
        self.reports.append(report)
        stragglers = self._judge(report)
        if self.enable_ptl_logging:
            self._log_scores(report, pl_module)
        if self.stop_if_detected:
            (found,) = reduce_max([int(bool(stragglers))])  # rank 0 decides; every rank must stop together
            if found:
                self.logger.warning("stopping the fit: stragglers detected")
                trainer.should_stop = True

    def _judge(self, report: Report) -> set:
        """Rank 0: log the extreme scores and the stragglers; returns them (empty on other ranks)."""
        if report.rank != 0:
            return set()
        found: set = set()
        for kind, on, scores_by_section, threshold in (
                ("relative", self.calc_relative, report.section_relative_perf_scores, self.rel_threshold),
                ("individual", self.calc_individual, report.section_individual_perf_scores, self.indiv_threshold)):
            scores = scores_by_section.get(SECTION) or {}
            if not on or not scores:
                continue
            ordered = sorted(scores.items(), key=lambda kv: kv[1])
            if self.num_to_print:
                self.logger.info("%s %s perf scores: worst %s best %s", SECTION, kind,
                                 _fmt(ordered[:self.num_to_print]), _fmt(ordered[::-1][:self.num_to_print]))
            slow = report.identify_stragglers(section_rel_threshold=self.rel_threshold,
                                              section_indiv_threshold=self.indiv_threshold)[
                f"straggler_sections_{kind}"].get(SECTION, set())
            for s in sorted(slow, key=lambda s: s.rank):
                self.logger.warning("straggler: rank %d on node %s, %s score %.2f < %.2f", s.rank, s.node, kind,
                                    scores[s.rank], threshold)
            found |= slow
        return found

    def _log_scores(self, report: Report, pl_module: Any) -> None:
        for kind, scores_by_section in (("relative", report.section_relative_perf_scores),
                                        ("individual", report.section_individual_perf_scores)):
            scores = scores_by_section.get(SECTION) or {}
            if scores:
                pl_module.log(f"straggler/{kind}_perf_score_min", min(scores.values()), rank_zero_only=True)


def _fmt(items: list[tuple[int, float]]) -> str:
    return ", ".join(f"rank {r}: {s:.2f}" for r, s in items)
