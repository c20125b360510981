"""NVRx's fault-tolerance value types, under their NVRx names (``fault_tolerance.data`` there).

Code written against NVRx reads the client's ``hb_timeouts`` / ``section_timeouts`` as these records
and builds ``WorkloadControlRequest``s; the fields, defaults and enum values match NVRx's so such code
runs unchanged. The monitor itself works with ``nvrx.monitors.timeouts.Timeouts``; the client converts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Optional, Set

from nvrx.common.errors import NvrxError

# NVRx's launcher hands the rank its monitor socket in this variable. nvrx launch sets NVRX_MONITOR_SOCKET
# (with a token and a heartbeat slot) instead; the client reads this one for a monitor that
# RankMonitorServer started (nvrx.monitors.server).
FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR = "FT_RANK_MONITOR_IPC_SOCKET"
FT_LAUNCHER_IPC_SOCKET_ENV_VAR = "FT_LAUNCHER_IPC_SOCKET"


class RankMonitorClientError(NvrxError, RuntimeError):
    """A RankMonitorClient call failed (not initialized, no monitor, not enough data, refused).

    NVRx code catches it by this name; it is also a RuntimeError because nvrx raised RuntimeError for
    these cases before the NVRx name existed.
    """


class SectionUsageError(RankMonitorClientError, ValueError):
    """A section was opened twice or closed while not open (a bug in the caller's section marks).

    A ValueError as well, as nvrx raised before; NVRx reports it as a RankMonitorClientError.
    """


@dataclass
class RankInfo:
    """Who a rank is: the global and local rank, its host and pid."""

    global_rank: int
    local_rank: int
    host: str
    pid: int

    @classmethod
    def get_for_current_rank(cls) -> "RankInfo":
        """This process's RankInfo: torch.distributed's rank if initialized, else ``RANK``."""
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        elif "RANK" in os.environ:
            rank = int(os.environ["RANK"])
        else:
            raise RuntimeError("cannot tell this process's rank: torch.distributed is not initialized and RANK is unset")
        return cls(rank, int(os.environ.get("LOCAL_RANK", -1)), socket.gethostname(), os.getpid())


@dataclass
class HeartbeatTimeouts:
    """The heartbeat timeouts in force (seconds; None = not checked)."""

    initial: Optional[float] = None
    subsequent: Optional[float] = None
    were_calculated: Optional[bool] = None

    @property
    def are_valid(self) -> bool:
        return self.initial is not None and self.subsequent is not None


@dataclass
class SectionTimeouts:
    """Section timeouts in force and which of them were calculated from observations."""

    section: Mapping[str, Optional[float]] = field(default_factory=dict)
    out_of_section: Optional[float] = None
    calculated_sections: Set[str] = field(default_factory=set)
    is_out_of_section_calculated: bool = False

    def __post_init__(self) -> None:
        self.calculated_sections = set(self.calculated_sections or ())

    @property
    def were_calculated(self) -> bool:
        return set(self.section) <= self.calculated_sections and self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        return self.out_of_section is not None and all(v is not None for v in self.section.values())


class WorkloadAction(Enum):
    """What a rank asks the launcher to do with the workload."""

    Continue = 0
    ExcludeThisNode = 1
    ShutdownWorkload = 2


class WorkloadControlRequest:
    """A rank's request to the launcher: an action and why."""

    def __init__(self, action: WorkloadAction, description: str = "<not set>") -> None:
        if not isinstance(action, WorkloadAction):
            raise ValueError(f"action must be a WorkloadAction, got {action!r}")
        self.action = action
        self.description = description

    def __repr__(self) -> str:
        return f"WorkloadControlRequest(action={self.action}, description={self.description!r})"

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, WorkloadControlRequest) and self.action == other.action
                and self.description == other.description)


# ---- conversions from the monitor's reply (Timeouts.to_dict() + the calculated marks)


def hb_timeouts_of(timeouts: Mapping[str, Any], calculated: Mapping[str, Any]) -> HeartbeatTimeouts:
    """HeartbeatTimeouts from a monitor reply's ``timeouts`` and ``calculated``."""
    return HeartbeatTimeouts(timeouts.get("initial_heartbeat"), timeouts.get("heartbeat"),
                             bool(calculated.get("initial_heartbeat") and calculated.get("heartbeat")))


def section_timeouts_of(timeouts: Mapping[str, Any], calculated: Mapping[str, Any]) -> SectionTimeouts:
    """SectionTimeouts from a monitor reply's ``timeouts`` and ``calculated``."""
    return SectionTimeouts(dict(timeouts.get("sections") or {}), timeouts.get("out_of_section"),
                           set(calculated.get("sections") or ()), bool(calculated.get("out_of_section")))
