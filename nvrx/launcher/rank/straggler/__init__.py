"""Straggler detection inside ranks: NVRx's ``nvidia_resiliency_ext.straggler`` API (a compatible subset).

``Detector`` times named sections (``detection_section``) and scores the ranks in collective reports
(``generate_report``); ``Report.identify_stragglers`` picks the slow ones. ``nvrx launch`` detects
stragglers by itself from the section and heartbeat timings every rank already reports to its monitor
(``nvrx.monitors.straggler``); this API is for finer detail: time exactly the rank's own work.
"""

from nvrx.launcher.rank.straggler.detector import Detector
from nvrx.launcher.rank.straggler.reporting import Report, StragglerId
from nvrx.launcher.rank.straggler.statistics import Statistic

__all__ = ["Detector", "Report", "Statistic", "StragglerId"]
