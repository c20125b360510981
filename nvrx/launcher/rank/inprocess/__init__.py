"""In-process restart: when any rank fails, restart the wrapped function in every live process.

    from nvrx.launcher.rank import inprocess
    @inprocess.Wrapper(rank_assignment=inprocess.Compose(
        inprocess.rank_assignment.MaxActiveWorldSize(8), inprocess.rank_assignment.ShiftRanks()))
    def train(call_wrapper: inprocess.CallWrapper):
        ...

Restarting inside the process skips process start, ``import torch`` and most re-initialisation.
The names follow NVRx's ``nvidia_resiliency_ext.inprocess`` (see docs/porting.md). See
docs/guides/inprocess.md and ``Wrapper`` for the parameters.
"""

from nvrx.launcher.rank.inprocess import (abort, completion, exception, exceptions, finalize, health_check, initialize,
                                     monitor_thread, nested_restarter, rank_assignment, rank_filter, state, store,
                                     terminate)
from nvrx.launcher.rank.inprocess.call_wrapper import CallWrapper, current
from nvrx.launcher.rank.inprocess.compose import Compose
from nvrx.launcher.rank.inprocess.exceptions import RestartInterrupt
from nvrx.launcher.rank.inprocess.state import FrozenState, Mode, State
from nvrx.launcher.rank.inprocess.wrapper import Wrapper

__all__ = ["CallWrapper", "Compose", "FrozenState", "Mode", "RestartInterrupt", "State", "Wrapper", "abort",
           "completion", "current", "exception", "exceptions", "finalize", "health_check", "initialize",
           "monitor_thread", "nested_restarter", "rank_assignment", "rank_filter", "state", "store", "terminate"]
