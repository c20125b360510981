"""In-process restart: when any rank fails, restart the wrapped function in every live process.

    from launcher.rank import inprocess
    @inprocess.Wrapper(rank_filter=inprocess.rank_filter.MaxActiveWorldSize(8))
    def train(call_wrapper: inprocess.CallWrapper):
        ...

Restarting inside the process skips process start, ``import torch`` and most re-initialisation.
See README ("In-process restart") and ``Wrapper`` for the parameters.
"""

from launcher.rank.inprocess import (abort, exceptions, finalize, health_check, initialize, rank_assignment, rank_filter,
                                state, store)
from launcher.rank.inprocess.call_wrapper import CallWrapper, current
from launcher.rank.inprocess.compose import Compose
from launcher.rank.inprocess.exceptions import RestartInterrupt
from launcher.rank.inprocess.state import State
from launcher.rank.inprocess.wrapper import Wrapper

__all__ = ["CallWrapper", "Compose", "RestartInterrupt", "State", "Wrapper", "abort", "current", "exceptions",
           "finalize", "health_check", "initialize", "rank_assignment", "rank_filter", "state", "store"]
