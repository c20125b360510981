"""Rank monitoring: the per-rank monitor process, its client API and the event schema.

The rank-monitor pieces arrive with the rank-monitor issue; the event log (``monitors.events``)
is shared already by the agent and, later, by `nvrx inspect`.
"""

from monitors.client import RankMonitorClient

__all__ = ["RankMonitorClient"]
