"""A rank hangs inside a gloo collective while its peer waits in DDP's all-reduce: restarted in place.

The hanging rank waits in ``dist.recv`` for a message no peer sends; the peer is in ``backward()``, its DDP
buckets (one per layer, so many all-reduce works are queued) waiting for the hanging rank. The Wrapper's soft
timeout aborts: the gloo connections are shut down, the queued works fail, and the peer drops its model (and
with it the last user reference to the process group) while the gloo workers are still freeing those works.
Before the aborted groups were kept (``pg_graveyard``), that could deadlock the rank for good: the group's
destructor, run with the GIL held, joined a worker that waited for the GIL.
"""

from __future__ import annotations

import pytest

from tests.inprocess.harness import JobResult, run_job


WRAPPER = {"soft_timeout": 1.0, "hard_timeout": 20.0, "heartbeat_timeout": 20.0, "monitor_process_interval": 0.25,
           "termination_grace_time": 0.5, "barrier_timeout": 20.0, "completion_timeout": 20.0}


@pytest.fixture(scope="module")
def hangs(tmp_path_factory) -> JobResult:
    plan = {"wrapper": WRAPPER, "steps": 4, "debug": True, "gloo_timeout": 300, "ddp_layers": 300,
            "actions": {"0": {"1": {"at_step": 2, "do": "recv_hang"}},   # rank 1 hangs, rank 0 in DDP's all-reduce
                        "1": {"0": {"at_step": 2, "do": "recv_hang"}}}}  # and the other way round
    return run_job(tmp_path_factory.mktemp("hang_in_collective"), 2, plan, timeout=90)  # each rank starts an interpreter for its monitor process


def test_both_ranks_finish_in_place_with_the_same_model(hangs):
    res = hangs
    assert res.codes == {0: 0, 1: 0}, res.stderr
    values = set()
    for rank in (0, 1):
        assert len(res.pids(rank)) == 1, "a rank was restarted as a new process"
        assert sorted(res.starts(rank)) == [0, 1, 2]
        done = res.of(rank, "done", iteration=2)
        assert done, f"rank {rank} did not finish iteration 2"
        values.add(done[0]["value"])
    assert len(values) == 1, f"the ranks ended with different models: {values}"


def test_each_hang_was_ended_by_the_soft_timeout(hangs):
    res = hangs
    for iteration, rank in ((0, 1), (1, 0)):
        assert res.of(rank, "inject", action="recv_hang", iteration=iteration)
        assert "soft timeout: no progress" in res.stderr[0] + res.stderr[1]
        peer = 1 - rank
        left = res.of(peer, "error", iteration=iteration) + res.of(peer, "interrupted", iteration=iteration)
        assert left, f"the peer of hanging rank {rank} never left iteration {iteration}'s all-reduce"


def test_nothing_is_left_running(hangs):
    res = hangs
    assert res.leftovers == [], f"processes left behind: {res.leftovers}"
    for rank in (0, 1):
        kept = res.of(rank, "returned")[0]["kept_groups"]
        assert kept <= 2, f"rank {rank} still holds {kept} aborted process groups (at most one per restart)"
