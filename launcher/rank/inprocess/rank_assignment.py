"""Rank assignment: after a fault, give the surviving ranks consecutive ranks 0..WORLD_SIZE-1.

A ``RankAssignment`` takes a ``RankAssignmentCtx`` (this rank's ``State`` plus the set of ranks, in
the numbering of the iteration that just ended, that are gone) and returns a new one. Every rank
runs the same assignment on the same inputs, so every rank computes the same new numbering without
talking to the others. Assignments compose with ``Compose``; the Wrapper requires the final result to
have no gaps left (``terminated_ranks`` empty), which ``ShiftRanks`` and ``Tree`` guarantee.
"""

from __future__ import annotations

import abc
import enum
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Mapping, Union

from launcher.rank.inprocess.state import State

KeyFn = Union[str, Callable[[int, int], Hashable]]
HOSTNAME = "hostname"  # group ranks by the host they run on


@dataclass(frozen=True)
class RankAssignmentCtx:
    """Input and output of a rank assignment.

    terminated_ranks: ranks (current numbering) that will not take part in the next iteration.
    hostnames: current rank -> host name of every rank still in the job (for node-level grouping).
    """

    state: State
    terminated_ranks: frozenset[int] = frozenset()
    hostnames: Mapping[int, str] = field(default_factory=dict)


class RankAssignment(abc.ABC):
    """Base class: ``__call__(ctx) -> ctx``."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


def _renumber(ctx: RankAssignmentCtx, order: list[int]) -> RankAssignmentCtx:
    """Give the ranks in ORDER the new ranks 0..len-1; everybody else is terminated."""
    new = {old: i for i, old in enumerate(order)}
    state = ctx.state
    rank = new.get(state.rank) if state.rank is not None else None
    hostnames = {new[old]: host for old, host in ctx.hostnames.items() if old in new}
    return RankAssignmentCtx(state.replace(rank=rank, world_size=len(order)), frozenset(), hostnames)


def _alive(ctx: RankAssignmentCtx) -> list[int]:
    return [r for r in range(ctx.state.world_size) if r not in ctx.terminated_ranks]


class ShiftRanks(RankAssignment):
    """Close the gaps: surviving ranks keep their order and shift left to 0..n-1."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        return _renumber(ctx, _alive(ctx))

    def __repr__(self) -> str:
        return "ShiftRanks()"


def _key_function(key_or_fn: KeyFn, what: str) -> Callable[[int, RankAssignmentCtx], Hashable]:
    if key_or_fn == HOSTNAME:
        def by_host(rank: int, ctx: RankAssignmentCtx) -> Hashable:
            return ctx.hostnames.get(rank, f"<unknown host of rank {rank}>")
        return by_host
    if isinstance(key_or_fn, str) or not callable(key_or_fn):
        raise ValueError(f"{what}: key_or_fn must be a function (rank, world_size) -> key or the string "
                         f"'{HOSTNAME}', not {key_or_fn!r}")
    fn = key_or_fn
    return lambda rank, ctx: fn(rank, ctx.state.world_size)


class FilterGroupedByKey(RankAssignment):
    """Terminate every group of ranks (same key) whose number of surviving ranks fails ``condition``.

    ``key_or_fn(rank, world_size)`` gives a rank's group, e.g. ``lambda rank, _: rank // 8`` for
    groups of 8 consecutive ranks, or ``"hostname"`` for one group per node. ``condition(count)``
    says whether a group with ``count`` surviving ranks may continue, e.g. ``lambda n: n == 8``.
    Compose it with ``ShiftRanks`` (which runs after it) to close the gaps.
    """

    def __init__(self, key_or_fn: KeyFn, condition: Callable[[int], bool]) -> None:
        if not callable(condition):
            raise ValueError(f"FilterGroupedByKey: condition must be a function count -> bool, not {condition!r}")
        self.key = _key_function(key_or_fn, "FilterGroupedByKey")
        self.condition = condition

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        alive = _alive(ctx)
        keys = {r: self.key(r, ctx) for r in alive}
        counts = Counter(keys.values())
        dropped = {r for r in alive if not self.condition(counts[keys[r]])}
        return replace(ctx, terminated_ranks=ctx.terminated_ranks | dropped)


class LayerFlag(enum.Enum):
    """What a Tree layer does with a group that fell below its minimum."""

    TERMINATE = "terminate"  # drop the whole group (its healthy ranks leave the job)
    KEEP = "keep"  # keep the group's survivors (they are renumbered with their group)


@dataclass(frozen=True)
class Layer:
    """One level of a Tree: how ranks are grouped at this level, and the smallest acceptable group."""

    key_or_fn: KeyFn
    min_ranks: int = 1
    flag: LayerFlag = LayerFlag.TERMINATE

    def __post_init__(self) -> None:
        if not isinstance(self.min_ranks, int) or self.min_ranks < 1:
            raise ValueError(f"Layer: min_ranks must be a whole number >= 1, not {self.min_ranks!r}")
        if not isinstance(self.flag, LayerFlag):
            raise ValueError(f"Layer: flag must be a LayerFlag, not {self.flag!r}")
        _key_function(self.key_or_fn, "Layer")


class Tree(RankAssignment):
    """Hierarchical grouping (e.g. rack > node): drop groups that fall below their layer's minimum,
    then renumber the survivors so that each group's ranks stay contiguous, groups in order of their
    lowest rank. ``Tree(Layer("hostname", min_ranks=8))`` keeps only complete 8-rank nodes.
    """

    def __init__(self, *layers: Layer) -> None:
        if not layers or not all(isinstance(layer, Layer) for layer in layers):
            raise ValueError("Tree needs one or more Layer(...) arguments, outermost first")
        self.layers = layers
        self._keys = [_key_function(layer.key_or_fn, "Layer") for layer in layers]

    def _paths(self, ranks: list[int], ctx: RankAssignmentCtx) -> dict[int, tuple[Any, ...]]:
        return {r: tuple(key(r, ctx) for key in self._keys) for r in ranks}

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        survivors = _alive(ctx)
        paths = self._paths(survivors, ctx)
        for depth in range(len(self.layers) - 1, -1, -1):  # innermost first: a lost node can empty a rack
            layer = self.layers[depth]
            if layer.flag is not LayerFlag.TERMINATE:
                continue
            counts = Counter(paths[r][: depth + 1] for r in survivors)
            survivors = [r for r in survivors if counts[paths[r][: depth + 1]] >= layer.min_ranks]
        first_rank: dict[tuple[Any, ...], int] = {}
        for r in survivors:
            for depth in range(len(self.layers)):
                first_rank.setdefault(paths[r][: depth + 1], r)
        depths = range(len(self.layers))
        order = sorted(survivors, key=lambda r: (tuple(first_rank[paths[r][: d + 1]] for d in depths), r))
        return _renumber(ctx, order)
