"""What a rank knows about itself in the current restart iteration; handed to every component."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class State:
    """One rank's view of the current iteration.

    ``rank``/``world_size`` are the rank after rank assignment (``None`` once this rank is
    terminated); ``active_rank``/``active_world_size`` are what the wrapped function sees as
    ``RANK``/``WORLD_SIZE`` (``active_rank`` is ``None`` on an inactive, spare rank).
    """

    initial_rank: int
    initial_world_size: int
    rank: int | None
    world_size: int
    active_rank: int | None
    active_world_size: int
    iteration: int = 0
    fn_exception: BaseException | None = None  # what ended the last iteration on this rank (None: a fault elsewhere)

    @property
    def active(self) -> bool:
        return self.active_rank is not None

    def replace(self, **changes: object) -> "State":
        return dataclasses.replace(self, **changes)

    @classmethod
    def initial(cls, rank: int, world_size: int) -> "State":
        return cls(rank, world_size, rank, world_size, rank, world_size)
