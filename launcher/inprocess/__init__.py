"""In-process restart: when any rank fails, restart the wrapped function in every live process.

    from launcher import inprocess

    @inprocess.Wrapper(rank_filter=inprocess.rank_filter.MaxActiveWorldSize(8))
    def train(call_wrapper: inprocess.CallWrapper):
        ...

Restarting inside the process skips process start, ``import torch`` and most re-initialisation.
See README ("In-process restart") and ``Wrapper`` for the parameters.
"""

from launcher.inprocess import (abort, exceptions, finalize, health_check, initialize, rank_assignment, rank_filter,
                                state, store)
from launcher.inprocess.call_wrapper import CallWrapper, current
from launcher.inprocess.compose import Compose
from launcher.inprocess.exceptions import RestartInterrupt
from launcher.inprocess.state import State
from launcher.inprocess.wrapper import Wrapper

__all__ = ["CallWrapper", "Compose", "RestartInterrupt", "State", "Wrapper", "abort", "current", "exceptions",
           "finalize", "health_check", "initialize", "rank_assignment", "rank_filter", "state", "store"]
