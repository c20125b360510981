"""Rank filters (deprecated, as in NVRx: use the filters of ``rank_assignment``): which ranks are active
(call the wrapped function) in an iteration.

Inactive ranks wait idle as pre-initialised spares; when active ranks are lost, rank assignment
shifts spares into the active range and they are used in the next iteration. Active ranks are always
the lowest ranks, ``0..active_world_size-1``. Filters compose with ``Compose`` (the last runs first).
"""

from __future__ import annotations

import abc
import warnings
from typing import Optional

from nvrx.launcher.rank.inprocess.state import Mode, State


def _deprecated(name: str) -> None:
    new = "ActiveWorldSizeDivisibleBy" if name == "WorldSizeDivisibleBy" else name
    warnings.warn(f"rank_filter.{name} is deprecated (as in NVRx); use rank_assignment.{new} in rank_assignment=",
                  DeprecationWarning, stacklevel=3)


class RankFilter(abc.ABC):
    """Base class: ``__call__(state) -> state`` with a new ``active_world_size`` / ``active_rank``."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        raise NotImplementedError

    @staticmethod
    def limit(state: State, active_world_size: int) -> State:
        """Keep the lowest ACTIVE_WORLD_SIZE ranks active, the others become spares."""
        current = state.active_world_size if state.active_world_size is not None else state.world_size
        size = max(0, min(active_world_size, current))
        rank = state.active_rank if state.active_rank is not None else state.rank
        active = rank if rank is not None and rank < size else None
        return state.replace(active_world_size=size, active_rank=active,
                             mode=Mode.ACTIVE if active is not None else Mode.INACTIVE)

    def _size(self, state: State) -> int:
        return state.active_world_size if state.active_world_size is not None else state.world_size


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a whole number >= 1, not {value!r}")
    return value


class ActiveWorldSizeDivisibleBy(RankFilter):
    """Shrink the active world to the largest multiple of ``divisor`` (e.g. the ranks of one node)."""

    def __init__(self, divisor: int = 1) -> None:
        _deprecated(type(self).__name__)
        self.divisor = _positive_int(divisor, f"{type(self).__name__}: divisor")

    def __call__(self, state: State) -> State:
        return self.limit(state, self._size(state) // self.divisor * self.divisor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.divisor})"


class WorldSizeDivisibleBy(ActiveWorldSizeDivisibleBy):
    """Spec 000's (older) name of ``ActiveWorldSizeDivisibleBy``."""


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active; the rest are spares (None: no limit)."""

    def __init__(self, max_active_world_size: Optional[int] = None) -> None:
        _deprecated(type(self).__name__)
        self.max_active_world_size = (None if max_active_world_size is None else
                                      _positive_int(max_active_world_size, "MaxActiveWorldSize: max_active_world_size"))

    def __call__(self, state: State) -> State:
        if self.max_active_world_size is None:
            return self.limit(state, self._size(state))
        return self.limit(state, self.max_active_world_size)

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size})"
