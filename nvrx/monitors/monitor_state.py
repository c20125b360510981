"""NVRx's ``RankMonitorState``: the states of its rank monitor's in-job restart handling, under NVRx's name.

NVRx code imports it (``fault_tolerance.RankMonitorState``) to compare a monitor's state or to log it. nvrx's
rank monitor has no such state machine (a restart is the agent's next round, and a monitor outlives it), so the
enum is here for those imports and comparisons; no nvrx object reports one of these states.
"""

from __future__ import annotations

import enum


class RankMonitorState(enum.Enum):
    """A rank monitor's phase in NVRx: not yet initialized, monitoring, handling a restart (started, in
    progress, completed), finalized at the end, or aborted."""

    UNINITIALIZED = enum.auto()
    INITIALIZE = enum.auto()
    HANDLING_START = enum.auto()
    HANDLING_PROCESSING = enum.auto()
    HANDLING_COMPLETED = enum.auto()
    FINALIZED = enum.auto()
    ABORTED = enum.auto()
