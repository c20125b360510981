"""``CallWrapper``: what the wrapped function may ask the Wrapper for while it runs.

The Wrapper passes it to the wrapped function when the function declares a parameter annotated
``CallWrapper`` or named ``call_wrapper``. Code that cannot take a parameter (a script run by
``nvrx launch --inprocess``) gets the same object from ``current()``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

from launcher.rank.inprocess.interruption import InterruptGate
from launcher.rank.inprocess.progress import ProgressRecorder
from launcher.rank.inprocess.state import State

PARAMETER_NAME = "call_wrapper"

_current: "CallWrapper | None" = None


class CallWrapper:
    """Handle on the running Wrapper: ``iteration``, ``state``, ``ping()``, ``atomic()``."""

    def __init__(self, gate: InterruptGate, recorder: ProgressRecorder) -> None:
        self._gate = gate
        self._recorder = recorder
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
        self._recorder.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block the restart never interrupts (e.g. writing a checkpoint).

        The termination procedure waits until the block ends; a block does not start once the
        termination procedure has begun (``RestartInterrupt`` is raised instead).
        """
        with self._gate.atomic():
            yield


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
