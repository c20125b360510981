"""Nested-restarter status lines: tell an outer restarter (a launcher that also restarts the job) what the
in-process restart is doing, one line per event on one rank, on stdout:

    active_rank=0 [NestedRestarter] name=[InProcess] state=handling stage=starting

``NestedRestarterHandlingStarting`` is an ``Abort`` (a fault is being handled);
``NestedRestarterHandlingCompleted`` an ``Initialize`` (the first call: ``state=initialize``; after a
restart: ``state=handling stage=completed``). Only the rank whose initial rank is ``special_rank`` writes.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Optional

from nvrx.launcher.rank.inprocess.abort import Abort
from nvrx.launcher.rank.inprocess.initialize import Initialize


def _status_logger() -> logging.Logger:
    """A logger writing bare lines to stdout (where outer restarters read them), set up once."""
    logger = logging.getLogger("nvrx.nested_restarter")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


@dataclasses.dataclass
class NestedRestarterCallback:
    """Writes one status line (``restarter_state`` and optional ``restarter_stage``) on the special rank."""

    restarter_state: str = ""
    restarter_stage: Optional[str] = None
    special_rank: int = 0

    @property
    def logger(self) -> logging.Logger:
        return _status_logger()

    def log_status(self, state: Any) -> None:
        if state.initial_rank != self.special_rank:
            return
        line = f"active_rank={state.active_rank} [NestedRestarter] name=[InProcess] state={self.restarter_state}"
        if self.restarter_stage:
            line += f" stage={self.restarter_stage}"
        self.logger.info("%s", line)


class NestedRestarterHandlingCompleted(Initialize, NestedRestarterCallback):
    """At the start of each iteration: ``state=initialize`` the first time, ``state=handling stage=completed``
    after a restart."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "initialize", None, special_rank)
        self._first = True

    def __call__(self, state: Any) -> Any:
        if self._first:
            self.restarter_state, self.restarter_stage = "initialize", None
            self._first = False
        else:
            self.restarter_state, self.restarter_stage = "handling", "completed"
        self.log_status(state)
        return state


class NestedRestarterHandlingStarting(Abort, NestedRestarterCallback):
    """When a fault is being handled (as an abort): ``state=handling stage=starting``."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "handling", "starting", special_rank)

    def __call__(self, state: Any) -> Any:
        self.log_status(state)
        return state
