"""Initializers: run at the start of every iteration, before the health check and the wrapped function.

An ``Exception`` raised here restarts the iteration like a fault in the wrapped function; a
``BaseException`` (such as ``RetriesExhausted``) ends the Wrapper.
"""

from __future__ import annotations

import abc
import logging

from nvrx.launcher.rank.inprocess.exceptions import RetriesExhausted
from nvrx.launcher.rank.inprocess.state import State

log = logging.getLogger(__name__)


class Initialize(abc.ABC):
    """Base class: ``__call__(state) -> state`` (or ``None`` for unchanged)."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State | None:
        raise NotImplementedError


def _count(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"RetryController: {what} must be a whole number >= {minimum}, not {value!r}")
    return value


class RetryController(Initialize):
    """Stop restarting after ``max_iterations`` calls, or when too few ranks are left.

    Iterations count from 0, so ``max_iterations=3`` allows the first call and two restarts.
    Every rank sees the same iteration and world sizes, so every rank stops at the same point.
    """

    def __init__(self, max_iterations: int | None = None, min_world_size: int = 1,
                 min_active_world_size: int = 1) -> None:
        self.max_iterations = None if max_iterations is None else _count(max_iterations, "max_iterations", 1)
        self.min_world_size = _count(min_world_size, "min_world_size", 1)
        self.min_active_world_size = _count(min_active_world_size, "min_active_world_size", 1)

    def __call__(self, state: State) -> State:
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            raise RetriesExhausted(f"in-process restart gave up: {state.iteration} iterations done "
                                   f"(RetryController max_iterations={self.max_iterations})")
        if state.world_size < self.min_world_size:
            raise RetriesExhausted(f"in-process restart gave up: {state.world_size} ranks left, fewer than "
                                   f"min_world_size={self.min_world_size}")
        if state.active_world_size < self.min_active_world_size:
            raise RetriesExhausted(f"in-process restart gave up: {state.active_world_size} active ranks, fewer than "
                                   f"min_active_world_size={self.min_active_world_size}")
        return state

    def __repr__(self) -> str:
        return (f"RetryController(max_iterations={self.max_iterations}, min_world_size={self.min_world_size}, "
                f"min_active_world_size={self.min_active_world_size})")
