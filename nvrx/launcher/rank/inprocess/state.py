"""What a rank knows about itself in the current restart iteration; handed to every component.

``State`` has NVRx's fields in NVRx's order (``State(rank, world_size, ...)``); the Wrapper keeps one
mutable ``State`` per call and hands components ``state.freeze()``, a ``FrozenState`` they cannot change
by accident (a component returns a new state instead).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Any, Optional


class Mode(enum.Enum):
    """A rank's role in the current iteration."""

    INITIALIZED = enum.auto()  # before the first rank assignment
    ACTIVE = enum.auto()  # runs the wrapped function
    INACTIVE = enum.auto()  # a spare: waits while the active ranks run
    TERMINATED = enum.auto()  # removed from the job (no rank)


class _StateMethods:
    """What State and FrozenState share (FrozenState is a frozen copy of State's fields)."""

    rank: Optional[int]
    world_size: int
    active_rank: Optional[int]
    active_world_size: Optional[int]

    def _fields(self) -> dict[str, Any]:
        # dataclasses.asdict would deep-copy fn_exception (and its traceback's frames); a field copy does not
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @property
    def active(self) -> bool:
        """True when this rank runs the wrapped function in this iteration."""
        return self.active_rank is not None

    def replace(self, **changes: Any) -> Any:
        """A copy with CHANGES applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass
class State(_StateMethods):
    """One rank's view of the current iteration.

    ``rank``/``world_size``: the rank after rank assignment (``None`` once this rank is terminated);
    ``active_rank``/``active_world_size``: what the wrapped function sees as ``RANK``/``WORLD_SIZE``
    (``active_rank`` is ``None`` on an inactive, spare rank); ``initial_*``: the values at the first call
    (default: ``rank``/``world_size``); ``fn_exception``: what ended the last iteration on this rank
    (``None`` when the fault was elsewhere).
    """

    rank: Optional[int]
    world_size: int
    active_rank: Optional[int] = None
    active_world_size: Optional[int] = None
    initial_rank: Optional[int] = None
    initial_world_size: Optional[int] = None
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: Optional[BaseException] = None

    def __post_init__(self) -> None:
        if self.initial_rank is None:
            self.initial_rank = self.rank
        if self.initial_world_size is None:
            self.initial_world_size = self.world_size

    @classmethod
    def from_env(cls) -> "State":
        """The state of a rank started by torchrun / nvrx launch: ``RANK`` (default 0), ``WORLD_SIZE`` (default 1)."""
        values = {}
        for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
            raw = os.environ.get(name, default)
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"State.from_env: {name}={raw!r} is not a whole number") from None
        return cls(values["RANK"], values["WORLD_SIZE"])

    @classmethod
    def initial(cls, rank: int, world_size: int) -> "State":
        """The state before the first rank assignment: every rank active."""
        return cls(rank, world_size, rank, world_size)

    def set_distributed_vars(self) -> None:
        """``RANK``/``WORLD_SIZE`` in the environment := the active rank and world size."""
        os.environ["RANK"] = str(self.active_rank)
        os.environ["WORLD_SIZE"] = str(self.active_world_size)

    def advance(self) -> None:
        """Move to the next iteration."""
        self.iteration += 1
        self.fn_exception = None

    def freeze(self) -> "FrozenState":
        """An immutable copy, for components."""
        return FrozenState(**self._fields())

    def copy_from(self, other: Any, fields: Optional[list[str]] = None) -> None:
        """Take FIELDS (default: all) from OTHER (a State or FrozenState)."""
        for name in fields if fields is not None else [f.name for f in dataclasses.fields(self)]:
            setattr(self, name, getattr(other, name))


FrozenState = dataclasses.make_dataclass(
    "FrozenState", [(f.name, f.type, f) for f in dataclasses.fields(State)], bases=(_StateMethods,), frozen=True,
    namespace={"__doc__": "An immutable copy of a State (``State.freeze()``), what components receive.",
               "__module__": __name__,
               "thaw": lambda self: State(**self._fields())})


def as_state(value: Any) -> State:
    """A component's result as a mutable State (components may return a FrozenState or a State)."""
    if isinstance(value, State):
        return value
    return State(**value._fields())
