"""``rank_assignment.Tree`` with either store shape, and NVRx's ``inprocess.store.FileStore``.

Tree takes the ranks' layer keys from ``RankAssignmentCtx.store`` when it has NVRx's
``send_state/get_states/send_key/get_keys`` (a real torch FileStore here, values as JSON), else from the
Wrapper's own gather; the job test runs Tree inside the Wrapper in three real ranks over a FileStore.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterable

import pytest

from nvrx.launcher.rank import inprocess
from nvrx.launcher.rank.inprocess import rank_assignment as ra
from nvrx.launcher.rank.inprocess.state import Mode, State
from tests.inprocess.harness import run_job

B, R = ra.LayerFlag.BACKFILL, ra.LayerFlag.RESERVE


class StateStore(inprocess.store.FileStore):
    """A store of NVRx's shape for Tree, on a real torch FileStore: states and keys as JSON."""

    def send_state(self, state: State, rank: int) -> None:
        self.set(f"state/{rank}", json.dumps([state.rank, state.world_size, state.initial_rank]))

    def get_states(self, ranks: Iterable[int]) -> list[State]:
        values = [json.loads(v) for v in self.multi_get([f"state/{r}" for r in ranks])]
        return [State(rank, world, initial_rank=initial) for rank, world, initial in values]

    def send_key(self, key: list[Any], rank: int) -> None:
        self.set(f"key/{rank}", json.dumps(key))

    def get_keys(self, ranks: Iterable[int]) -> list[list[Any]]:
        return [json.loads(v) for v in self.multi_get([f"key/{r}" for r in ranks])]


def tree_over(tmp_path: Path, world: int, layers: list[ra.Layer], **kwargs: Any) -> tuple[ra.Tree, StateStore]:
    """A Tree and a store in which every rank already published its state and keys (as NVRx's ranks do)."""
    store = StateStore(str(tmp_path / "store"))
    for rank in range(world):
        state = State(rank, world)
        store.send_state(state, rank)
        store.send_key([layer.key_or_fn(state) if callable(layer.key_or_fn) else layer.key_or_fn for layer in layers],
                       rank)
    return ra.Tree(layers, **kwargs), store


def active_ranks(tree: ra.Tree, world: int) -> list[int | None]:
    return [tree.init_rank_map[r].state.active_rank for r in range(world)]


def pairs(flags: tuple[Any, Any], size: int = 4) -> list[ra.Layer]:
    return [ra.Layer(flag=flags[0]), ra.Layer(key_or_fn=lambda s: s.rank // size, flag=flags[1])]


@pytest.mark.parametrize("flags, expected", [
    ((B, B), [0, None, 2, 3, 4, 5, 6, 1]),  # the highest active rank of the job fills the hole
    ((None, B), [0, None, 2, 1, 3, 4, 5, 6]),  # the highest of the lost rank's group (of 4) fills it
    ((None, None), [0, None, 1, 2, 3, 4, 5, 6]),  # no backfill: the ranks above shift down
])
def test_tree_reads_the_keys_from_a_store_of_nvrx_shape_and_backfills(tmp_path, flags, expected):
    tree, store = tree_over(tmp_path, 8, pairs(flags))
    out = tree(ra.RankAssignmentCtx(State(0, 8), store, {1}))  # no gather: only the store can give the keys
    assert active_ranks(tree, 8) == expected
    assert (out.state.rank, out.state.world_size, out.state.active_world_size) == (0, 7, 7)
    assert out.terminated_ranks == set() and out.state.mode is Mode.ACTIVE


def test_tree_reserve_takes_spares_of_the_lost_ranks_group_then_shifts(tmp_path):
    layers = [ra.Layer(flag=R), ra.Layer(max_ranks=3, key_or_fn=lambda s: s.rank // 4, flag=R)]
    tree, store = tree_over(tmp_path, 8, layers)
    ctx = tree(ra.RankAssignmentCtx(State(0, 8), store, {1}))
    assert active_ranks(tree, 8) == [0, None, 2, 1, 3, 4, 5, None]  # spare 3 took 1's place
    ctx.terminated_ranks = {3}  # current numbering: initial rank 4
    ctx = tree(ctx)
    assert active_ranks(tree, 8) == [0, None, 2, 1, None, 4, 5, 3]  # spare 7 took it
    ctx.terminated_ranks = {1}  # initial rank 2: no spare left anywhere
    ctx = tree(ctx)
    assert active_ranks(tree, 8) == [0, None, None, 1, None, 3, 4, 2]
    assert ctx.state.world_size == 5 and ctx.state.active_world_size == 5


def test_tree_ends_a_group_below_min_ranks_and_discards_its_ranks(tmp_path):
    layers = [ra.Layer(flag=R | B), ra.Layer(min_ranks=2, max_ranks=3, key_or_fn=lambda s: s.rank // 4, flag=R | B)]
    tree, store = tree_over(tmp_path, 12, layers)
    ctx = tree(ra.RankAssignmentCtx(State(0, 12), store, set()))
    ctx.terminated_ranks = {0, 1, 2}  # leaves rank 3 alone in its group: below min_ranks, so it goes too
    with pytest.raises(ra.RankDiscarded):
        tree(ctx)
    assert active_ranks(tree, 12) == [None, None, None, None, 3, 4, 5, 1, 6, 7, 2, 0]
    assert tree.init_rank_map[3].state.mode is Mode.TERMINATED
    assert {tree.init_rank_map[r].state.world_size for r in range(12)} == {8}


def test_tree_refuses_two_roots_and_warns_when_groups_reorder_the_ranks(tmp_path):
    tree, store = tree_over(tmp_path, 4, [ra.Layer(key_or_fn=lambda s: s.rank % 2)])
    with pytest.raises(RuntimeError, match="first layer's key must be the same"):
        tree(ra.RankAssignmentCtx(State(0, 4), store, set()))
    tree, store = tree_over(tmp_path / "..", 4, [ra.Layer(), ra.Layer(key_or_fn=lambda s: s.rank % 2)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tree(ra.RankAssignmentCtx(State(0, 4), store, set()))
    assert any("order" in str(w.message) for w in seen)
    assert [tree.init_rank_map[r].state.rank for r in range(4)] == [0, 2, 1, 3]  # group order: 0, 2 | 1, 3


def test_tree_without_store_or_gather_says_what_it_needs():
    tree = ra.Tree([ra.Layer()])
    with pytest.raises(ra.RestartError, match="send_state/get_states/send_key/get_keys"):
        tree(ra.RankAssignmentCtx(State(0, 2), None, set()))


def test_tree_with_the_wrappers_gather_gives_every_rank_the_same_numbering():
    keys = {r: [r, repr("job"), repr(r // 2)] for r in range(4)}  # what each rank sends: initial rank + keys
    results = {}
    for rank in range(4):
        tree = ra.Tree([ra.Layer(key_or_fn="job", flag=B), ra.Layer(key_or_fn=lambda s: s.rank // 2, flag=B)])
        first = tree(ra.RankAssignmentCtx(State(rank, 4), None, set(), gather=lambda name, fn: dict(keys),
                                          initial=True))
        assert first.state.active_rank == rank
        try:
            out = tree(ra.RankAssignmentCtx(first.state, None, {0}))
            results[rank] = (out.state.rank, out.state.active_rank, out.state.world_size)
        except ra.RankDiscarded:
            results[rank] = None
    assert results == {0: None, 1: (0, 1, 3), 2: (1, 2, 3), 3: (2, 0, 3)}


def test_file_store_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="world_size must be"):
        inprocess.store.FileStore(str(tmp_path / "s"), 0)
    with pytest.raises(ValueError, match="file_name must be a path"):
        inprocess.store.FileStore(None)  # type: ignore[arg-type]


def test_tree_backfill_over_a_file_store_survives_losing_rank_0(tmp_path):
    """Three real ranks; the Wrapper's store is a FileStore, so losing rank 0 loses no store. Tree: pairs
    {0, 1}, {2}, BACKFILL up to the job: rank 2 (the highest active) takes rank 0's place."""
    plan = {"wrapper": {"soft_timeout": 10.0, "hard_timeout": 20.0, "heartbeat_timeout": 10.0,
                        "monitor_process_interval": 0.25, "barrier_timeout": 60.0, "completion_timeout": 60.0},
            "file_store": str(tmp_path / "wrapper.store"), "tree_pairs_backfill": True, "steps": 3,
            "actions": {"0": {"0": {"at_step": 1, "do": "exit"}}}}
    res = run_job(tmp_path, 3, plan, timeout=180)
    assert res.codes == {0: 3, 1: 0, 2: 0}, res.stderr
    assert [(e["iteration"], e["rank"], e["world"]) for e in res.of(1, "start")] == [(0, 1, 3), (1, 1, 2)]
    assert [(e["iteration"], e["rank"], e["world"]) for e in res.of(2, "start")] == [(0, 2, 3), (1, 0, 2)]
    assert res.of(1, "returned") and res.of(2, "returned")
    assert (tmp_path / "wrapper.store").exists()  # kept: see FileStore
    assert res.leftovers == []
