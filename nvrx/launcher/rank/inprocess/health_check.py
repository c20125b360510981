"""Health checks: after a fault, decide locally whether this rank can take part in another iteration.

An unhealthy rank raises; the Wrapper records it as terminated (the others continue without it) and
re-raises, which should end the process. Checks that need hardware this machine does not have skip
with one log line: on a CPU-only machine they never turn a restartable fault into a job exit.
"""

from __future__ import annotations

import abc
import datetime
import logging
import threading

from nvrx.launcher.rank.inprocess.exceptions import HealthCheckError, RestartInterrupt, TimeoutError
from nvrx.launcher.rank.inprocess.state import State

log = logging.getLogger(__name__)


class HealthCheck(abc.ABC):
    """Base class: ``__call__(state) -> state`` (or ``None``); raise to report this rank unhealthy."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State | None:
        raise NotImplementedError


class CudaHealthCheck(HealthCheck):
    """Wait for this rank's CUDA work to finish (with a deadline); a CUDA error or hang is unhealthy.

    Without a usable CUDA device it does nothing, and says so once per process.
    """

    _skip_logged = False

    def __init__(self, timeout: float | datetime.timedelta = datetime.timedelta(seconds=30)) -> None:
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"CudaHealthCheck: timeout must be a number of seconds > 0, not {timeout!r}")
        self.timeout = float(timeout)

    @staticmethod
    def _cuda_usable() -> bool:
        try:
            import torch

            return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
        except Exception:
            return False

    def __call__(self, state: State) -> State:
        if not self._cuda_usable():
            if not CudaHealthCheck._skip_logged:
                CudaHealthCheck._skip_logged = True
                log.info("CudaHealthCheck skipped: no CUDA device on this machine (GPU-only check)")
            return state
        import torch

        box: list[BaseException] = []

        def sync() -> None:
            try:
                torch.cuda.synchronize()
            except BaseException as exc:
                box.append(exc)

        thread = threading.Thread(target=sync, name="inprocess-cuda-sync", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise TimeoutError(f"CUDA did not finish its pending work within {self.timeout:g} s")
        if box:
            raise HealthCheckError(f"CUDA reports an error: {box[0]}") from box[0]
        return state

    def __repr__(self) -> str:
        return f"CudaHealthCheck(timeout={self.timeout:g})"


class FaultCounterExceeded(HealthCheckError):
    """Raised by ``FaultCounter``: this rank failed more often than allowed (NVRx's name; a HealthCheckError)."""


class FaultCounter(HealthCheck):
    """Declare this rank unhealthy once its own wrapped function has failed more than ``max_rank_faults`` times.

    Only faults raised on this rank count (not restarts caused by other ranks).
    """

    def __init__(self, max_rank_faults: int | None = None) -> None:
        if max_rank_faults is not None and (isinstance(max_rank_faults, bool) or not isinstance(max_rank_faults, int)
                                            or max_rank_faults < 0):
            raise ValueError("FaultCounter: max_rank_faults must be a whole number >= 0 or None, "
                             f"not {max_rank_faults!r}")
        self.max_rank_faults = max_rank_faults
        self.faults = 0
        self._counted: BaseException | None = None  # health checks run twice per fault (after it, before the next run)

    def __call__(self, state: State) -> State:
        exc = state.fn_exception
        if exc is not None and not isinstance(exc, RestartInterrupt) and exc is not self._counted:
            self._counted = exc
            self.faults += 1
            log.info("fault %d on this rank: %s", self.faults, type(exc).__name__)
        if self.max_rank_faults is not None and self.faults > self.max_rank_faults:
            raise FaultCounterExceeded(f"this rank failed {self.faults} times (FaultCounter max_rank_faults="
                                   f"{self.max_rank_faults})")
        return state

    def __repr__(self) -> str:
        return f"FaultCounter(max_rank_faults={self.max_rank_faults})"
