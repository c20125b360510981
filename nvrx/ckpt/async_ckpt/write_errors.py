"""The error a failed asynchronous checkpoint write raises: ours and, at the same time, torch's.

NVRx (and torch's own ``dcp.save``) report a failed write as
``torch.distributed.checkpoint.api.CheckpointException`` with a ``failures`` mapping of rank to wrapped
exception; code ported from NVRx catches that. nvrx code catches ``CheckpointWriteError``. One class
derived from both lets either ``except`` work. It is kept apart from ``nvrx.ckpt.errors`` because it needs
torch, and ``nvrx.ckpt`` is imported by the rank bootstrap before torch is.
"""

from __future__ import annotations

import traceback
from typing import Mapping

from torch.distributed.checkpoint.api import CheckpointException

from nvrx.ckpt.errors import CheckpointWriteError


class CheckpointWriteFailed(CheckpointWriteError, CheckpointException):
    """A checkpoint write failed on one or more ranks; FAILURES maps each failed rank to (exception, traceback).

    ``str()`` is our one-line message (what failed and what is intact), not torch's multi-line dump.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        CheckpointWriteError.__init__(self, message)
        self._failures = {rank: (RuntimeError(reason), traceback.StackSummary())
                          for rank, reason in (failures or {}).items()}

    def __str__(self) -> str:
        return str(self.args[0])


def failures_by_rank(errors: list[str | None]) -> dict[int, str]:
    """ERRORS in rank order (None: that rank succeeded) -> {rank: reason} of the ranks that failed."""
    return {rank: error for rank, error in enumerate(errors) if error}
