"""Finalizers: after a fault and the abort, bring the process back to a state a restart can start from.

An exception raised by a finalizer ends the Wrapper on this rank (the health check is skipped).
"""

from __future__ import annotations

import abc
import threading
from typing import Callable

from launcher.rank.inprocess.state import State


class Finalize(abc.ABC):
    """Base class: ``__call__(state) -> state`` (or ``None`` for unchanged)."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State | None:
        raise NotImplementedError


class ThreadedFinalize(Finalize):
    """Run ``fn(state)`` in a helper thread and give up after ``timeout`` seconds.

    For cleanup that may hang (joining a data-loader, waiting on async checkpoint writes): a hang
    becomes a ``TimeoutError``, which ends this rank instead of stalling every rank's restart.
    """

    def __init__(self, fn: Callable[[State], object], timeout: float) -> None:
        if not callable(fn):
            raise ValueError(f"ThreadedFinalize: fn must be callable, not {fn!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"ThreadedFinalize: timeout must be a number of seconds > 0, not {timeout!r}")
        self.fn = fn
        self.timeout = float(timeout)

    def __call__(self, state: State) -> State:
        box: list[BaseException] = []

        def run() -> None:
            try:
                self.fn(state)
            except BaseException as exc:  # handed to the caller
                box.append(exc)

        thread = threading.Thread(target=run, name="inprocess-finalize", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            name = getattr(self.fn, "__name__", self.fn)
            raise TimeoutError(f"finalize {name!r} did not finish in {self.timeout:g} s")
        if box:
            raise box[0]
        return state
