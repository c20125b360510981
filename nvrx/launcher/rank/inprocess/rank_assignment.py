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
import bisect
import dataclasses
import enum
import heapq
import itertools
import warnings
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


class TopologyError(RestartError, RuntimeError):
    """The ranks' Tree keys do not form one tree (a ``RuntimeError``, as in NVRx)."""


def _exchanges_states(store: Any) -> bool:
    """NVRx's store shape for Tree: ``send_state/get_states/send_key/get_keys``."""
    return all(callable(getattr(store, name, None)) for name in ("send_state", "get_states", "send_key", "get_keys"))


class _Leaf:
    """One rank of a Tree: its ``State`` (NVRx's ``init_rank_map[r].state``), its groups (outermost first) and
    the group its lost active rank is backfilled from (``domain``)."""

    __slots__ = ("state", "groups", "domain")

    def __init__(self, state: State, groups: list[tuple[Any, ...]], domain: Optional[tuple[Any, ...]]) -> None:
        self.state = state
        self.groups = groups
        self.domain = domain

    @property
    def mode(self) -> Mode:
        return self.state.mode


class Tree(RankAssignment):
    """Hierarchical assignment: ranks grouped by ``layers`` (outermost first; the first layer's key must be
    the same on every rank, e.g. ``Layer(key_or_fn="root")``). Ranks are ordered depth first (groups in the
    order their first rank appears); a warning says when that order differs from the ranks' own.

    First call: in that order, a rank becomes active while every group it belongs to is below its
    ``max_ranks``; the rest are spares. Every call, for the terminated ranks: a group left with fewer than
    ``min_ranks`` live ranks is terminated whole (innermost layers first); a lost active rank's place goes
    to the most recently idled spare of its nearest group, climbing while the layers are flagged RESERVE;
    else, when the innermost layers are flagged BACKFILL, to the highest active ranks of the outermost group
    of that flagged chain; the remaining gaps close by shifting. ``world_size_filter(n)`` may then lower
    the number of active ranks (the highest become spares). Live ranks are numbered 0..n-1 in tree order.

    The keys travel through ``ctx.store`` when it has NVRx's ``send_state/get_states/send_key/get_keys``,
    else through the Wrapper's gather (``ctx.gather``). A Tree keeps its own record of every rank
    (``init_rank_map``: initial rank -> leaf with ``.state``), so it replaces (is not composed with) other
    assignments.
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
        self.init_rank_map: dict[int, _Leaf] = {}  # initial rank -> leaf (NVRx's name)
        self.rank_map: dict[int, _Leaf] = {}  # current rank -> leaf (NVRx's name)
        self._leaves: list[_Leaf] = []  # depth-first order
        self._members: dict[tuple[Any, ...], list[_Leaf]] = {}  # group -> its leaves, depth-first
        self._by_depth: list[list[tuple[Any, ...]]] = []  # the groups of each layer
        self._spares: dict[tuple[Any, ...], dict[int, _Leaf]] = {}  # group -> its inactive leaves, oldest first
        self._live: dict[tuple[Any, ...], int] = {}  # group -> how many of its leaves are not terminated
        self._active_world_size = 0

    # ------------------------------------------------------------ the component

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        if ctx.initial or not self.init_rank_map:
            self._build(self._exchange(ctx))
        for leaf in self._leaves:
            leaf.state.iteration, leaf.state.fn_exception = ctx.state.iteration, ctx.state.fn_exception
        self.terminate({r for r in ctx.terminated_ranks if r in self.rank_map})
        me = self.init_rank_map.get(ctx.state.initial_rank)  # type: ignore[arg-type]
        if me is None or me.mode is Mode.TERMINATED:
            raise _discard(ctx.state, "Tree")
        mine = me.state
        new = dataclasses.replace(ctx.state, rank=mine.rank, world_size=mine.world_size, active_rank=mine.active_rank,
                                  active_world_size=mine.active_world_size, mode=mine.mode)
        return dataclasses.replace(ctx, state=new, terminated_ranks=set())

    def _exchange(self, ctx: RankAssignmentCtx) -> list[tuple[int, int, tuple[Any, ...]]]:
        """(rank, initial rank, key per layer) of every rank taking part, in rank order."""
        state = ctx.state
        if _exchanges_states(ctx.store):
            store = ctx.store
            store.send_state(state, state.rank)
            states = store.get_states(range(state.world_size))
            store.send_key([key(ctx) for key in self._keys], state.rank)
            keys = store.get_keys(range(state.world_size))
            return [(int(getattr(s, "rank", i)), int(getattr(s, "initial_rank", None) or getattr(s, "rank", i)),
                     tuple(k)) for i, (s, k) in enumerate(zip(states, keys))]
        if ctx.gather is _no_gather:
            raise RestartError("Tree needs every rank's layer keys: pass RankAssignmentCtx(state, store) with a store "
                               "that has send_state/get_states/send_key/get_keys, or run it inside the Wrapper")

        def mine(own_state: State) -> list[Any]:
            own = dataclasses.replace(ctx, state=own_state)
            return [own_state.initial_rank, *(repr(key(own)) for key in self._keys)]

        gathered = ctx.gather("Tree", mine)
        return sorted((int(r), int(v[0]), tuple(v[1:])) for r, v in gathered.items())

    # ------------------------------------------------------------ building

    def _build(self, entries: list[tuple[int, int, tuple[Any, ...]]]) -> None:
        """The tree of ENTRIES (rank, initial rank, keys), with the first activation."""
        roots = {keys[0] for _, _, keys in entries}
        if len(roots) > 1:
            raise TopologyError(f"Tree: the first layer's key must be the same on every rank, got {sorted(map(repr, roots))}")
        depth = len(self.layers)
        seen: dict[tuple[Any, ...], int] = {}  # group -> when it first appeared (orders siblings)
        paths = []
        for rank, initial, keys in entries:
            groups = [keys[: d + 1] for d in range(depth)]
            paths.append(([seen.setdefault(g, len(seen)) for g in groups], rank, initial, groups))
        paths.sort(key=lambda p: (p[0], p[1]))
        ranks = [p[1] for p in paths]
        if any(a > b for a, b in zip(ranks, ranks[1:])):
            warnings.warn("Tree: the ranks' order differs from the order of the layers' groups; ranks are renumbered "
                          "in group order", UserWarning, stacklevel=3)
        world_size = len(entries)
        domain_depth = self._backfill_depth()
        self._leaves, self._members, self._spares = [], {g: [] for g in seen}, {g: {} for g in seen}
        self._by_depth = [[] for _ in range(depth)]
        for group in seen:
            self._by_depth[len(group) - 1].append(group)
        for _, rank, initial, groups in paths:
            leaf = _Leaf(State(rank, world_size, initial_rank=initial, initial_world_size=world_size), groups,
                         None if domain_depth is None else groups[domain_depth])
            self._leaves.append(leaf)
            for group in groups:
                self._members[group].append(leaf)
        self._live = {group: len(members) for group, members in self._members.items()}
        self.init_rank_map = {leaf.state.initial_rank: leaf for leaf in self._leaves}  # type: ignore[misc]
        self.rank_map = {leaf.state.rank: leaf for leaf in self._leaves}  # type: ignore[misc]
        self._activate_first()

    def _flagged(self, flag: LayerFlag) -> list[bool]:
        return [bool(layer.flag and layer.flag & flag) for layer in self.layers]

    def _backfill_depth(self) -> Optional[int]:
        """The outermost layer of the chain of BACKFILL layers that starts at the innermost layer, if any: a
        lost active rank is backfilled from its group in that layer."""
        flagged = self._flagged(LayerFlag.BACKFILL)
        domain = None
        for depth in range(len(self.layers) - 1, -1, -1):
            if not flagged[depth]:
                break
            domain = depth
        return domain

    def _activate_first(self) -> None:
        limits = [layer.max_ranks for layer in self.layers]
        counts: dict[tuple[Any, ...], int] = {}
        active = 0
        for leaf in self._leaves:
            if all(m is None or counts.get(g, 0) < m for m, g in zip(limits, leaf.groups)):
                self._activate(leaf, active)
                active += 1
                for group in leaf.groups:
                    counts[group] = counts.get(group, 0) + 1
            else:
                self._idle(leaf)
        self._set_active_world_size(active)

    # ------------------------------------------------------------ a leaf's role

    def _activate(self, leaf: _Leaf, active_rank: int) -> None:
        leaf.state.mode, leaf.state.active_rank = Mode.ACTIVE, active_rank
        for group in leaf.groups:
            self._spares[group].pop(leaf.state.initial_rank, None)  # type: ignore[arg-type]

    def _idle(self, leaf: _Leaf) -> None:
        leaf.state.mode, leaf.state.active_rank = Mode.INACTIVE, None
        for group in leaf.groups:
            self._spares[group].setdefault(leaf.state.initial_rank, leaf)  # type: ignore[arg-type]

    def _end(self, leaf: _Leaf) -> None:
        if leaf.mode is Mode.TERMINATED:
            return
        leaf.state.mode = Mode.TERMINATED  # its active rank stays until the gaps are filled
        for group in leaf.groups:
            self._spares[group].pop(leaf.state.initial_rank, None)  # type: ignore[arg-type]
            self._live[group] -= 1

    def _set_active_world_size(self, size: int) -> None:
        self._active_world_size = size
        for leaf in self._leaves:
            leaf.state.active_world_size = size

    # ------------------------------------------------------------ after a termination

    def terminate(self, lost: set[int]) -> None:
        """Update the assignment after losing LOST (current ranks)."""
        lost = self._whole_groups(set(lost))
        lost_active = sorted(r for r in lost if self.rank_map[r].mode is Mode.ACTIVE)
        for rank in lost:
            self._end(self.rank_map[rank])
        unfilled = [r for r in lost_active if not self._from_reserve(self.rank_map[r])]
        if unfilled:
            freed = self._backfill([self.rank_map[r] for r in unfilled])
            self._shift(sorted(freed), len(unfilled))
        if self.world_size_filter is not None:
            self._filter_world_size()
        for rank in lost:
            self.rank_map[rank].state.active_rank = None
        self._renumber()

    def _whole_groups(self, lost: set[int]) -> set[int]:
        """LOST (the live ones) plus the live ranks of every group left below its layer's min_ranks (innermost
        layer first)."""
        lost = {r for r in lost if self.rank_map[r].mode is not Mode.TERMINATED}
        leaving: Counter[tuple[Any, ...]] = Counter(g for r in lost for g in self.rank_map[r].groups)
        for depth in range(len(self.layers) - 1, -1, -1):
            minimum = self.layers[depth].min_ranks
            for group in self._by_depth[depth]:
                if self._live[group] - leaving[group] >= minimum:
                    continue
                for leaf in self._members[group]:
                    if leaf.mode is not Mode.TERMINATED and leaf.state.rank not in lost:
                        lost.add(leaf.state.rank)  # type: ignore[arg-type]
                        leaving.update(leaf.groups)
        return lost

    def _from_reserve(self, lost: _Leaf) -> bool:
        """Give LOST's active rank to a spare of its nearest group, climbing while the layers say RESERVE."""
        reserve = self._flagged(LayerFlag.RESERVE)
        for depth in range(len(self.layers) - 1, -1, -1):
            if not reserve[depth]:
                return False
            spares = self._spares[lost.groups[depth]]
            if spares:
                _, spare = spares.popitem()  # the most recently idled
                self._activate(spare, lost.state.active_rank)  # type: ignore[arg-type]
                return True
        return False

    def _backfill(self, lost: list[_Leaf]) -> set[int]:
        """Move the highest active ranks of each lost rank's backfill domain into the lost places; returns the
        active ranks left empty (to be closed by the shift)."""
        freed: set[int] = set()
        by_domain: dict[tuple[Any, ...], list[_Leaf]] = {}
        for leaf in lost:
            if leaf.domain is None:
                freed.add(leaf.state.active_rank)  # type: ignore[arg-type]
            else:
                by_domain.setdefault(leaf.domain, []).append(leaf)
        for domain, gone in by_domain.items():
            active = (leaf for leaf in self._members[domain] if leaf.mode is Mode.ACTIVE)
            highest = heapq.nlargest(len(gone), active, key=lambda leaf: leaf.state.active_rank)
            for filler, hole in itertools.zip_longest(reversed(highest), gone):
                if filler is None:
                    freed.add(hole.state.active_rank)
                else:
                    freed.add(filler.state.active_rank)
                    filler.state.active_rank = hole.state.active_rank
        return freed

    def _shift(self, freed: list[int], lost: int) -> None:
        """Close the freed active ranks: every active rank above one moves down."""
        for leaf in self._leaves:
            if leaf.state.active_rank is not None:
                leaf.state.active_rank -= bisect.bisect_left(freed, leaf.state.active_rank)
        self._set_active_world_size(self._active_world_size - lost)

    def _filter_world_size(self) -> None:
        size = int(self.world_size_filter(self._active_world_size))  # type: ignore[misc]
        if not 0 <= size <= self._active_world_size:
            raise RestartError(f"Tree: world_size_filter({self._active_world_size}) returned {size}; it must return "
                               f"0..{self._active_world_size}")
        for leaf in self._leaves:
            if leaf.mode is Mode.ACTIVE and leaf.state.active_rank >= size:  # type: ignore[operator]
                self._idle(leaf)
        self._set_active_world_size(size)

    def _renumber(self) -> None:
        """Live ranks 0..n-1 in tree order; the terminated ones after them (never handed out)."""
        live = [leaf for leaf in self._leaves if leaf.mode is not Mode.TERMINATED]
        ended = [leaf for leaf in self._leaves if leaf.mode is Mode.TERMINATED]
        self.rank_map = {}
        for index, leaf in enumerate(live + ended):
            leaf.state.rank, leaf.state.world_size = index, len(live)
            self.rank_map[index] = leaf

    def assignment(self) -> dict[int, tuple[int, Optional[int]]]:
        """Initial rank -> (rank, active rank or None) of every live rank."""
        return {initial: (leaf.state.rank, leaf.state.active_rank) for initial, leaf in self.init_rank_map.items()
                if leaf.mode is not Mode.TERMINATED}  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Tree({self.layers!r})"
