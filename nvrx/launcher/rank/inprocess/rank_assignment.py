"""Rank assignment: after a fault, decide every surviving rank's new rank, and which ranks are active.

A ``RankAssignment`` takes a ``RankAssignmentCtx`` (this rank's ``State``, the store, and the set of
ranks, in the numbering of the iteration that just ended, that are gone) and returns one. Every rank
runs the same assignment on the same inputs, so every rank computes the same numbering. Assignments
compose with ``Compose`` (the last runs first); the final result must leave no gaps (``terminated_ranks``
empty), which ``ShiftRanks``, ``FillGaps`` and ``Tree`` guarantee. A rank that is removed raises
``RankDiscarded``, which ends the Wrapper on it.

Grouping keys (``key_or_fn``) are evaluated on each rank's own ``State`` (``lambda state:
state.initial_rank // 8``, or a function reading the host name) and exchanged through the store
(``ctx.gather``); a plain string is a constant key (every rank in one group); the string ``"hostname"``
groups ranks by their host. Old-style ``FilterGroupedByKey`` keys are functions ``(rank, world_size)``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Hashable, Mapping, Optional, Union

from nvrx.launcher.rank.inprocess.exceptions import ArgumentTypeError, RankTerminated, RestartError
from nvrx.launcher.rank.inprocess.state import Mode, State

StateKey = Union[str, Callable[[State], Hashable]]
Gather = Callable[[str, Callable[[State], Any]], dict[int, Any]]
HOSTNAME = "hostname"  # group ranks by the host they run on


class RankDiscarded(RankTerminated, RestartError):
    """Raised by a rank assignment on a rank it removes from the job; ends the Wrapper on that rank."""


def _no_gather(name: str, fn: Callable[[State], Any]) -> dict[int, Any]:
    raise RestartError(f"rank assignment needs the other ranks' values ({name}) but has no store to ask; "
                       "run it inside the Wrapper")


@dataclass
class RankAssignmentCtx:
    """Input and output of a rank assignment (NVRx's fields first: ``state``, ``store``, ``terminated_ranks``).

    terminated_ranks: ranks (current numbering) that will not take part in the next iteration.
    hostnames: current rank -> host name of every rank still in the job (for ``"hostname"`` keys).
    gather: ``gather(name, fn)`` -> ``{current rank: fn(that rank's State)}`` over the live ranks, through
    the store (the Wrapper provides it; tests may pass their own).
    """

    state: State
    store: Any = None
    terminated_ranks: set[int] = field(default_factory=set)
    hostnames: Mapping[int, str] = field(default_factory=dict)
    gather: Gather = _no_gather
    initial: bool = False  # the first assignment of a Wrapper call (a Tree builds its tree then)

    def __post_init__(self) -> None:
        self.terminated_ranks = set(self.terminated_ranks)


class RankAssignment(abc.ABC):
    """Base class: ``__call__(ctx) -> ctx``."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


def _alive(ctx: RankAssignmentCtx) -> list[int]:
    return [r for r in range(ctx.state.world_size) if r not in ctx.terminated_ranks]


def _discard(state: State, by: str) -> RankDiscarded:
    return RankDiscarded(f"rank {state.initial_rank} was excluded by rank assignment ({by}); it does not rejoin")


def _renumber(ctx: RankAssignmentCtx, new_rank: dict[int, int], by: str) -> RankAssignmentCtx:
    """Give the ranks in NEW_RANK (old -> new) their new ranks; this rank raises RankDiscarded if not among them."""
    state = ctx.state
    if state.rank not in new_rank:
        raise _discard(state, by)
    hostnames = {new_rank[old]: host for old, host in ctx.hostnames.items() if old in new_rank}
    new = dataclasses.replace(state, rank=new_rank[state.rank], world_size=len(new_rank))
    return dataclasses.replace(ctx, state=new, terminated_ranks=set(), hostnames=hostnames)


class ShiftRanks(RankAssignment):
    """Close the gaps: surviving ranks keep their order and shift down to 0..n-1."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        return _renumber(ctx, {old: new for new, old in enumerate(_alive(ctx))}, "ShiftRanks")

    def __repr__(self) -> str:
        return "ShiftRanks()"


class FillGaps(RankAssignment):
    """Fill the gaps from the end: ranks below the new world size keep their rank, the highest ones move
    into the holes (fewest ranks change)."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = ctx.state.world_size - len(ctx.terminated_ranks & set(range(ctx.state.world_size)))
        holes = iter(sorted(r for r in ctx.terminated_ranks if r < size))
        new_rank = {old: old if old < size else next(holes) for old in _alive(ctx)}
        return _renumber(ctx, new_rank, "FillGaps")

    def __repr__(self) -> str:
        return "FillGaps()"


class RankFilter(RankAssignment):
    """A rank assignment that only chooses the active ranks (``mode``, ``active_rank``, ``active_world_size``)."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        size = min(state.active_world_size or state.world_size, state.world_size)
        size = max(0, min(size, self.limit(size)))
        active = state.rank is not None and state.rank < size
        new = dataclasses.replace(state, active_world_size=size, active_rank=state.rank if active else None,
                                  mode=Mode.ACTIVE if active else Mode.INACTIVE)
        return dataclasses.replace(ctx, state=new)

    def limit(self, size: int) -> int:
        """The number of active ranks allowed out of SIZE."""
        return size


class ActivateAllRanks(RankFilter):
    """Every rank is active: ``active_rank = rank``, ``active_world_size = world_size``."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        new = dataclasses.replace(state, active_rank=state.rank, active_world_size=state.world_size,
                                  mode=Mode.ACTIVE)
        return dataclasses.replace(ctx, state=new)

    def __repr__(self) -> str:
        return "ActivateAllRanks()"


def _optional_count(value: Any, what: str, minimum: int) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{what} must be a whole number, not {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, not {value!r}")
    return value


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active (the lowest ones); the rest are spares."""

    def __init__(self, max_active_world_size: Optional[int] = None) -> None:
        self.max_active_world_size = _optional_count(max_active_world_size, "MaxActiveWorldSize: "
                                                     "max_active_world_size", 1)

    def limit(self, size: int) -> int:
        return size if self.max_active_world_size is None else min(size, self.max_active_world_size)

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size})"


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The number of active ranks is the largest multiple of ``divisor`` (e.g. the ranks of one node)."""

    def __init__(self, divisor: int = 1) -> None:
        self.divisor = _optional_count(divisor, "ActiveWorldSizeDivisibleBy: divisor", 1)

    def limit(self, size: int) -> int:
        return size // self.divisor * self.divisor  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"ActiveWorldSizeDivisibleBy({self.divisor})"


def _state_key(key_or_fn: StateKey, what: str) -> Callable[[RankAssignmentCtx], Hashable]:
    """KEY_OR_FN as a function of this rank's ctx: a constant string, "hostname", or fn(State)."""
    if key_or_fn == HOSTNAME:
        import socket

        return lambda ctx: socket.gethostname()
    if isinstance(key_or_fn, str):
        constant = key_or_fn
        return lambda ctx: constant
    if not callable(key_or_fn):
        raise ArgumentTypeError(f"{what}: key_or_fn must be a string or a function State -> key, not {key_or_fn!r}")
    fn = key_or_fn
    return lambda ctx: fn(ctx.state)


def _gather_keys(ctx: RankAssignmentCtx, name: str, keys: list[Callable[[RankAssignmentCtx], Hashable]]
                 ) -> dict[int, tuple[Any, ...]]:
    """Every live rank's keys (current rank -> tuple), as JSON-safe strings (they travel through the store)."""
    def mine(state: State) -> list[str]:
        own = dataclasses.replace(ctx, state=state)
        return [repr(key(own)) for key in keys]

    return {int(r): tuple(v) for r, v in ctx.gather(name, mine).items()}


class FilterCountGroupedByKey(RankAssignment):
    """Terminate every rank of a group (ranks with the same key) whose number of live ranks fails ``condition``.

    ``key_or_fn(state)`` gives a rank's group, e.g. ``lambda state: state.initial_rank // 8``;
    ``condition(count)`` says whether a group of ``count`` live ranks may go on, e.g. ``lambda n: n == 8``.
    It only marks ranks terminated: compose it with ``ShiftRanks()`` or ``FillGaps()`` listed before it
    (they run after it). ``timeout`` bounds the exchange of keys (the Wrapper's barrier timeout applies too).
    """

    def __init__(self, key_or_fn: StateKey, condition: Callable[[int], bool],
                 timeout: timedelta = timedelta(seconds=60)) -> None:
        if not callable(condition):
            raise ArgumentTypeError(f"FilterCountGroupedByKey: condition must be a function count -> bool, "
                                    f"not {condition!r}")
        self.key = _state_key(key_or_fn, "FilterCountGroupedByKey")
        self.condition = condition
        self.timeout = timeout

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        keys = {r: k for r, k in _gather_keys(ctx, "FilterCountGroupedByKey", [self.key]).items()
                if r not in ctx.terminated_ranks}
        counts = Counter(keys.values())
        dropped = {r for r, k in keys.items() if not self.condition(counts[k])}
        return dataclasses.replace(ctx, terminated_ranks=ctx.terminated_ranks | dropped)


def _rank_key(key_or_fn: Any, what: str) -> Callable[[int, RankAssignmentCtx], Hashable]:
    if key_or_fn == HOSTNAME:
        return lambda rank, ctx: ctx.hostnames.get(rank, f"<unknown host of rank {rank}>")
    if isinstance(key_or_fn, str) or not callable(key_or_fn):
        raise ValueError(f"{what}: key_or_fn must be a function (rank, world_size) -> key or the string "
                         f"'{HOSTNAME}', not {key_or_fn!r}")
    fn = key_or_fn
    return lambda rank, ctx: fn(rank, ctx.state.world_size)


class FilterGroupedByKey(RankAssignment):
    """Spec 000's name: like ``FilterCountGroupedByKey``, with keys computed locally from ``(rank, world_size)``
    (or ``"hostname"``), so no exchange is needed."""

    def __init__(self, key_or_fn: Any, condition: Callable[[int], bool]) -> None:
        if not callable(condition):
            raise ValueError(f"FilterGroupedByKey: condition must be a function count -> bool, not {condition!r}")
        self.key = _rank_key(key_or_fn, "FilterGroupedByKey")
        self.condition = condition

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        alive = _alive(ctx)
        keys = {r: self.key(r, ctx) for r in alive}
        counts = Counter(keys.values())
        dropped = {r for r in alive if not self.condition(counts[keys[r]])}
        return dataclasses.replace(ctx, terminated_ranks=ctx.terminated_ranks | dropped)


class LayerFlag(enum.Flag):
    """What a Tree layer's groups may do for a terminated active rank among them.

    RESERVE: an inactive (spare) rank of the same group takes the lost rank's place.
    BACKFILL: the active rank with the highest active rank in the same group moves into the lost rank's place.
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


@dataclass
class Layer:
    """One level of a Tree: how ranks are grouped (``key_or_fn``), the fewest live ranks a group needs to
    survive (``min_ranks``; fewer and the whole group is terminated), the most active ranks it may have
    (``max_ranks``; the others are spares), and what it does for lost ranks (``flag``)."""

    min_ranks: int = 1
    max_ranks: Optional[int] = None
    key_or_fn: StateKey = ""
    flag: Optional[LayerFlag] = None

    def __post_init__(self) -> None:
        _optional_count(self.min_ranks, "Layer: min_ranks", 0)
        _optional_count(self.max_ranks, "Layer: max_ranks", 1)
        if self.flag is not None and not isinstance(self.flag, LayerFlag):
            raise ArgumentTypeError(f"Layer: flag must be a LayerFlag or None, not {self.flag!r}")
        _state_key(self.key_or_fn, "Layer")


class Tree(RankAssignment):
    """Hierarchical assignment: ranks grouped by ``layers`` (outermost first; the first layer's key must be
    the same on every rank, e.g. ``Layer(key_or_fn="root")``).

    First call: ranks become active in rank order while every group they belong to is below its
    ``max_ranks``; the rest are spares. Later calls, for the terminated ranks: a group left with fewer than
    ``min_ranks`` live ranks is terminated whole (innermost layers first); each lost active rank's place is
    taken by a spare of the nearest RESERVE group containing it, else by the highest active rank of the
    nearest BACKFILL group, else the remaining active ranks shift down. ``world_size_filter(n)`` may then
    lower the number of active ranks (the highest become spares). Live ranks are renumbered 0..n-1 in order.
    A Tree keeps its own record of the ranks, so it replaces (is not composed with) other assignments.
    """

    def __init__(self, layers: list[Layer], world_size_filter: Optional[Callable[[int], int]] = None) -> None:
        if isinstance(layers, Layer):
            layers = [layers]
        if not layers or not all(isinstance(layer, Layer) for layer in layers):
            raise ValueError("Tree needs a list of one or more Layer(...), outermost first")
        if world_size_filter is not None and not callable(world_size_filter):
            raise ArgumentTypeError(f"Tree: world_size_filter must be a function n -> n or None, "
                                    f"not {world_size_filter!r}")
        self.layers = list(layers)
        self.world_size_filter = world_size_filter
        self._keys = [_state_key(layer.key_or_fn, "Layer") for layer in self.layers]
        self._paths: dict[int, tuple[Any, ...]] = {}  # initial rank -> group key per layer
        self._alive: list[int] = []  # initial ranks of the live ranks, in rank order
        self._active: dict[int, int] = {}  # initial rank -> active rank
        self._last_holder: dict[int, int] = {}  # active rank -> initial rank, before the current termination

    # ------------------------------------------------------------ the pure part

    def start(self, paths: Mapping[int, tuple[Any, ...]]) -> None:
        """The first assignment over the ranks' key PATHS (initial rank -> one key per layer)."""
        roots = {path[0] for path in paths.values()}
        if len(roots) > 1:
            raise RestartError(f"Tree: the first layer's key must be the same on every rank, got {sorted(roots)}")
        self._paths = dict(paths)
        self._alive = self._surviving(sorted(paths))
        self._active = {}
        counts: Counter[tuple[Any, ...]] = Counter()
        for rank in self._alive:
            groups = self._groups(rank)
            if all(layer.max_ranks is None or counts[g] < layer.max_ranks for layer, g in zip(self.layers, groups)):
                self._active[rank] = len(self._active)
                counts.update(groups)
        self._filter_world_size()

    def terminate(self, lost: set[int]) -> None:
        """Update the assignment after losing LOST (initial ranks)."""
        self._last_holder = {a: r for r, a in self._active.items()}
        gaps = sorted(self._active.pop(r) for r in lost if r in self._active)
        self._alive = self._surviving([r for r in self._alive if r not in lost])
        for rank in [r for r in self._active if r not in self._alive]:  # whole groups terminated
            gaps.append(self._active.pop(rank))
        for gap in sorted(gaps):
            self._fill(gap)
        order = sorted(self._active, key=self._active.__getitem__)  # close what is still open
        self._active = {rank: i for i, rank in enumerate(order)}
        self._filter_world_size()

    def assignment(self) -> dict[int, tuple[int, Optional[int]]]:
        """Initial rank -> (rank, active rank or None) of every live rank."""
        return {r: (i, self._active.get(r)) for i, r in enumerate(self._alive)}

    def _groups(self, rank: int) -> list[tuple[Any, ...]]:
        path = self._paths[rank]
        return [path[: depth + 1] for depth in range(len(self.layers))]

    def _surviving(self, ranks: list[int]) -> list[int]:
        """RANKS without the groups that fell below their layer's min_ranks (innermost layer first)."""
        for depth in range(len(self.layers) - 1, -1, -1):
            counts = Counter(self._paths[r][: depth + 1] for r in ranks)
            ranks = [r for r in ranks if counts[self._paths[r][: depth + 1]] >= self.layers[depth].min_ranks]
        return ranks

    def _fill(self, gap: int) -> None:
        """Give active rank GAP to a spare of the nearest RESERVE group, or the top of the nearest BACKFILL one."""
        lost_groups = self._gap_groups(gap)
        for depth in range(len(self.layers) - 1, -1, -1):
            flag, group = self.layers[depth].flag, lost_groups.get(depth)
            if group is None or not flag:
                continue
            members = [r for r in self._alive if self._paths[r][: depth + 1] == group]
            if flag & LayerFlag.RESERVE:
                spares = [r for r in members if r not in self._active and self._fits(r)]
                if spares:
                    self._active[spares[0]] = gap
                    return
            if flag & LayerFlag.BACKFILL:
                above = [r for r in members if self._active.get(r, -1) > gap]
                if above:
                    top = max(above, key=self._active.__getitem__)
                    self._active[top] = gap  # its old place is closed by the final shift
                    return

    def _gap_groups(self, gap: int) -> dict[int, tuple[Any, ...]]:
        """The groups (per layer) of the rank that held active rank GAP before it was lost."""
        holder = self._last_holder.get(gap)
        return {} if holder is None else dict(enumerate(self._groups(holder)))

    def _fits(self, rank: int) -> bool:
        counts = Counter(g for r in self._active for g in self._groups(r))
        return all(layer.max_ranks is None or counts[g] < layer.max_ranks
                   for layer, g in zip(self.layers, self._groups(rank)))

    def _filter_world_size(self) -> None:
        if self.world_size_filter is None:
            return
        size = int(self.world_size_filter(len(self._active)))
        self._active = {r: a for r, a in self._active.items() if a < size}

    # ------------------------------------------------------------ the component

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        first = ctx.initial or not self._paths
        if first:
            gathered = _gather_keys(ctx, "Tree", self._keys)
            alive = [r for r in sorted(gathered) if r not in ctx.terminated_ranks]
            self.start({r: gathered[r] for r in alive})
        else:
            lost = {self._alive[r] for r in ctx.terminated_ranks if r < len(self._alive)}
            self.terminate(lost)
        assignment = self.assignment()
        me = state.rank if first else state.initial_rank
        if me not in assignment:
            raise _discard(state, "Tree")
        rank, active = assignment[me]
        new = dataclasses.replace(state, rank=rank, world_size=len(assignment), active_rank=active,
                                  active_world_size=len(self._active),
                                  mode=Mode.ACTIVE if active is not None else Mode.INACTIVE)
        return dataclasses.replace(ctx, state=new, terminated_ranks=set())

    def __repr__(self) -> str:
        return f"Tree({self.layers!r})"
