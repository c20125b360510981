"""``CallWrapper``: what the wrapped function may ask the Wrapper for while it runs.

The Wrapper passes it to the wrapped function when the function declares a parameter annotated
``CallWrapper`` or named ``call_wrapper``. Code that cannot take a parameter (a script run by
``nvrx launch --inprocess``) gets the same object from ``current()``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

from nvrx.launcher.rank.inprocess.interruption import InterruptGate
from nvrx.launcher.rank.inprocess.progress import ProgressRecorder
from nvrx.launcher.rank.inprocess.state import State

PARAMETER_NAME = "call_wrapper"

_current: "CallWrapper | None" = None


class CallWrapper:
    """Handle on the running Wrapper: ``iteration``, ``state``, ``ping()``, ``atomic()``,
    ``disable_hang_protection()``."""

    def __init__(self, gate: InterruptGate, recorder: ProgressRecorder) -> None:
        self._gate: InterruptGate | None = gate
        self._recorder: ProgressRecorder | None = recorder
        self._unprotected = 0  # depth of nested disable_hang_protection() blocks
        self.state: State | None = None
        # The restart that led to this iteration: seconds per phase (abort, finalize_health_check,
        # termination_barrier, rank_assignment, iteration_barrier) and "began", its wall-clock start.
        self.restart_timings: dict[str, float] = {}

    @property
    def iteration(self) -> int:
        """0 on the first call, +1 for every restart."""
        return self.state.iteration if self.state is not None else 0

    def ping(self) -> None:
        """Manual heartbeat: once used, the soft/hard timeouts also apply to the time between pings."""
        if self._recorder is not None:  # after the call returned there is nothing to ping
            self._recorder.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block the restart never interrupts (e.g. writing a checkpoint).

        The termination procedure waits until the block ends; a block does not start once the
        termination procedure has begun (``RestartInterrupt`` is raised instead).
        """
        if self._gate is None:
            raise RuntimeError("CallWrapper.atomic(): the Wrapper call this CallWrapper belongs to has returned")
        with self._gate.atomic():
            yield

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """A block exempt from the soft and hard timeouts (a long compile, a slow first checkpoint load).

        Faults elsewhere still restart it. When it ends, the progress clock starts afresh, so the block's
        duration never counts as a stall.
        """
        recorder = self._recorder
        if recorder is None:
            raise RuntimeError("CallWrapper.disable_hang_protection(): the Wrapper call has returned")
        self._unprotected += 1
        if self._unprotected == 1:
            recorder.end_iteration()  # the timeouts apply only while the run section is open
        try:
            yield
        finally:
            self._unprotected -= 1
            if self._unprotected == 0:
                recorder.start_iteration()  # reopened: the stall clock starts now

    @property
    def hang_protection_enabled(self) -> bool:
        """False inside ``disable_hang_protection()``."""
        return self._unprotected == 0

    def release(self) -> None:
        """Forget the Wrapper call's resources once it returned (a user may keep this object)."""
        self._gate = None
        self._recorder = None


def current() -> CallWrapper | None:
    """The CallWrapper of the Wrapper running in this process, if any."""
    return _current


def set_current(call_wrapper: CallWrapper | None) -> None:
    global _current
    _current = call_wrapper


def wants_call_wrapper(fn: Callable[..., Any]) -> str | None:
    """The parameter through which FN takes a CallWrapper (by annotation or by name), or None."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    for name, param in params.items():
        annotation = param.annotation
        if annotation is CallWrapper or (isinstance(annotation, str)
                                         and annotation.strip("'\"").split(".")[-1] == "CallWrapper"):
            return name
    return PARAMETER_NAME if PARAMETER_NAME in params else None
