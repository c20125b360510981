"""NVRx's straggler ``Report``: per-rank performance scores and how to pick the stragglers out of them.

Scores follow NVRx's convention: a ratio of reference performance to the rank's, in (0, 1]; 1.0 is the
reference itself (or faster), 0.5 twice as slow. The method is the agents' one (``nvrx.monitors.straggler``):
relative scores take the median of the other ranks as the reference, individual scores the median of the
rank's own earlier reports; the agents word the same facts as slowdowns (1 / score).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from nvrx.launcher.rank.straggler.statistics import Statistic

DEFAULT_THRESHOLD = 0.75  # NVRx's default thresholds of identify_stragglers


@dataclasses.dataclass(frozen=True)
class StragglerId:
    """Who a straggler is: its global rank and its node."""

    rank: int
    node: str


@dataclasses.dataclass(frozen=True)
class Report:
    """The scores of one report (``Detector.generate_report``).

    With ``gather_on_rank0=True`` rank 0 holds every rank's scores and the other ranks empty containers;
    with ``False`` every rank holds its own. The GPU scores are always empty in nvrx (no CUDA kernel
    profiling); section scores come from each section's CPU wall-clock time (its median per report).
    """

    gpu_relative_perf_scores: Mapping[int, float]
    section_relative_perf_scores: Mapping[str, Mapping[int, float]]
    gpu_individual_perf_scores: Mapping[int, float]
    section_individual_perf_scores: Mapping[str, Mapping[int, float]]
    rank_to_node: Mapping[int, str]
    local_section_summaries: Mapping[str, Mapping[Statistic, float]]
    local_kernel_summaries: Mapping[str, Mapping[Statistic, float]]
    generate_report_elapsed_time: float
    gather_on_rank0: bool
    rank: int

    def identify_stragglers(self, gpu_rel_threshold: float = DEFAULT_THRESHOLD,
                            section_rel_threshold: float = DEFAULT_THRESHOLD,
                            gpu_indiv_threshold: float = DEFAULT_THRESHOLD,
                            section_indiv_threshold: float = DEFAULT_THRESHOLD) -> dict:
        """The ranks whose scores are below the thresholds: ``straggler_gpus_relative`` /
        ``straggler_gpus_individual`` (sets of StragglerId) and ``straggler_sections_relative`` /
        ``straggler_sections_individual`` (section -> set of StragglerId)."""
        return {
            "straggler_gpus_relative": self._below(self.gpu_relative_perf_scores, gpu_rel_threshold),
            "straggler_gpus_individual": self._below(self.gpu_individual_perf_scores, gpu_indiv_threshold),
            "straggler_sections_relative": {
                name: self._below(scores, section_rel_threshold)
                for name, scores in self.section_relative_perf_scores.items()},
            "straggler_sections_individual": {
                name: self._below(scores, section_indiv_threshold)
                for name, scores in self.section_individual_perf_scores.items()},
        }

    def _below(self, scores: Mapping[int, float], threshold: float) -> set[StragglerId]:
        return {StragglerId(rank, self.rank_to_node.get(rank, "?")) for rank, score in scores.items()
                if score < threshold}
