"""Rank filters: which ranks are active (call the wrapped function) in an iteration.

Inactive ranks wait idle as pre-initialised spares; when active ranks are lost, rank assignment
shifts spares into the active range and they are used in the next iteration. Active ranks are always
the lowest ranks, ``0..active_world_size-1``. Filters compose with ``Compose`` (the last runs first).
"""

from __future__ import annotations

import abc

from launcher.rank.inprocess.state import State


class RankFilter(abc.ABC):
    """Base class: ``__call__(state) -> state`` with a new ``active_world_size`` / ``active_rank``."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        raise NotImplementedError

    @staticmethod
    def limit(state: State, active_world_size: int) -> State:
        """Keep the lowest ACTIVE_WORLD_SIZE ranks active, the others become spares."""
        size = max(0, min(active_world_size, state.active_world_size))
        active = state.active_rank if state.active_rank is not None and state.active_rank < size else None
        return state.replace(active_world_size=size, active_rank=active)


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a whole number >= 1, not {value!r}")
    return value


class WorldSizeDivisibleBy(RankFilter):
    """Shrink the active world to the largest multiple of ``divisor`` (e.g. the ranks of one node)."""

    def __init__(self, divisor: int) -> None:
        self.divisor = _positive_int(divisor, "WorldSizeDivisibleBy: divisor")

    def __call__(self, state: State) -> State:
        return self.limit(state, state.active_world_size // self.divisor * self.divisor)

    def __repr__(self) -> str:
        return f"WorldSizeDivisibleBy({self.divisor})"


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active; the rest are spares."""

    def __init__(self, max_active_world_size: int) -> None:
        self.max_active_world_size = _positive_int(max_active_world_size, "MaxActiveWorldSize: max_active_world_size")

    def __call__(self, state: State) -> State:
        return self.limit(state, self.max_active_world_size)

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size})"
