"""NVRx's ``Statistic`` names for the timing summaries of a section (``Report.local_section_summaries``)."""

from __future__ import annotations

import enum
import statistics as _stats
from typing import Sequence


class Statistic(enum.Enum):
    """One statistic of a section's timings over a report interval (seconds, or a count for NUM)."""

    MIN = "min"
    MAX = "max"
    MED = "med"
    AVG = "avg"
    STD = "std"
    NUM = "num"


def summarize(values: Sequence[float]) -> dict[Statistic, float]:
    """Every Statistic of VALUES (empty VALUES: an empty dict; STD of one value: 0)."""
    if not values:
        return {}
    return {Statistic.MIN: min(values), Statistic.MAX: max(values), Statistic.MED: _stats.median(values),
            Statistic.AVG: _stats.fmean(values), Statistic.STD: _stats.pstdev(values) if len(values) > 1 else 0.0,
            Statistic.NUM: float(len(values))}
