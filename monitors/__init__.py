"""Rank monitoring: the per-rank monitor process, the rank-side client API and the event schema."""

from monitors.client import RankMonitorClient

__all__ = ["RankMonitorClient"]
