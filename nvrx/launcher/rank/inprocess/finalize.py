"""Finalizers: after a fault and the abort, bring the process back to a state a restart can start from.

An exception raised by a finalizer ends the Wrapper on this rank (the health check is skipped).
"""

from __future__ import annotations

import abc
import datetime
import threading
from typing import Any, Callable

from nvrx.launcher.rank.inprocess.exceptions import ArgumentTypeError, TimeoutError

from nvrx.launcher.rank.inprocess.state import State


class Finalize(abc.ABC):
    """Base class: ``__call__(state) -> state`` (or ``None`` for unchanged)."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State | None:
        raise NotImplementedError


class ThreadedFinalize(Finalize):
    """Run ``fn(*args, **kwargs)`` in a helper thread and give up after ``timeout``.

    For cleanup that may hang (joining a data-loader, waiting on async checkpoint writes): a hang
    becomes an ``exception.TimeoutError``, which ends this rank instead of stalling every rank's restart.
    NVRx's form is ``ThreadedFinalize(timeout, fn, args=(), kwargs=None)``; our earlier form
    ``ThreadedFinalize(fn, timeout_seconds)`` calls ``fn(state)`` and still works.
    """

    def __init__(self, timeout: float | datetime.timedelta, fn: Callable[..., Any] | None = None,
                 args: tuple[Any, ...] | None = (), kwargs: dict[str, Any] | None = None) -> None:
        self._pass_state = callable(timeout) and not callable(fn)  # the earlier (fn, timeout) order
        if self._pass_state:
            timeout, fn = fn, timeout  # type: ignore[assignment]
        if not callable(fn):
            raise ArgumentTypeError(f"ThreadedFinalize: fn must be callable, not {fn!r}")
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ArgumentTypeError(f"ThreadedFinalize: timeout must be a timedelta or seconds, not {timeout!r}")
        if timeout <= 0:
            raise ValueError(f"ThreadedFinalize: timeout must be > 0 seconds, not {timeout!r}")
        self.fn = fn
        self.timeout = float(timeout)
        self.args = tuple(args or ())
        self.kwargs = dict(kwargs or {})

    def __call__(self, state: Any) -> Any:
        box: list[BaseException] = []

        def run() -> None:
            try:
                if self._pass_state:
                    self.fn(state)
                else:
                    self.fn(*self.args, **self.kwargs)
            except BaseException as exc:  # handed to the caller
                box.append(exc)

        thread = threading.Thread(target=run, name=f"ThreadedFinalize-{state.rank}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            name = getattr(self.fn, "__name__", self.fn)
            raise TimeoutError(f"finalize {name!r} did not finish in {self.timeout:g} s")
        if box:
            raise box[0]
        return state
