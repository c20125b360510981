"""Rank monitoring: the per-rank monitor process, the rank-side client API and the event schema.

The NVRx ``fault_tolerance`` names are exported here (``from monitors import RankMonitorClient, ...``);
``FaultToleranceConfig`` and ``RankMonitorServer`` are imported on first use, since they pull in
YAML parsing and process management that a rank sending heartbeats does not need.
"""

from typing import Any

from nvrx.monitors.client import RankMonitorClient
from nvrx.monitors.data import (HeartbeatTimeouts, RankMonitorClientError, SectionTimeouts, WorkloadAction,
                           WorkloadControlRequest)
from nvrx.monitors.monitor_state import RankMonitorState

__all__ = ["FaultToleranceConfig", "HeartbeatTimeouts", "RankMonitorClient", "RankMonitorClientError",
           "RankMonitorServer", "RankMonitorState", "SectionTimeouts", "WorkloadAction", "WorkloadControlRequest"]


def __getattr__(name: str) -> Any:
    if name == "FaultToleranceConfig":
        from nvrx.monitors.ft_config import FaultToleranceConfig

        return FaultToleranceConfig
    if name == "RankMonitorServer":
        from nvrx.monitors.server import RankMonitorServer

        return RankMonitorServer
    raise AttributeError(f"module 'monitors' has no attribute {name!r}")
