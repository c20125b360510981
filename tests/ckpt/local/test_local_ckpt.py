"""Local checkpoints with replication, end to end: 4 real ranks (gloo) on 2 emulated nodes, each node with its own
local root (WORK/node0, WORK/node1). Default J = ranks per node = 2, F = 2: cliques {0, 2} and {1, 3}, so every
shard has a copy on the other node."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from nvrx.ckpt.local.ckpt_managers.local_manager import SUFFIX, ckpt_id
from tests.ckpt.conftest import run_rank_procs
from tests.conftest import tagged_processes

HERE = Path(__file__).resolve().parent
WORLD = 4


def run_ranks(work: Path, scenario: str, expect_rc: int = 0, timeout: float = 90) -> list[dict]:
    """Run the 4 ranks of SCENARIO; each must exit EXPECT_RC. Returns what each wrote (none for a killed run);
    asserts that no process of the run is left."""
    token = run_rank_procs(HERE / "local_ranks.py", work, timeout, scenario, world=WORLD, expect_rc=expect_rc)
    assert tagged_processes(token) == []
    if expect_rc:
        return []
    return [json.loads((work / f"{scenario}-rank{r}.json").read_text()) for r in range(WORLD)]


def holder_dir(work: Path, rank: int) -> Path:
    return work / f"node{rank // 2}" / "job" / f"rank{rank}"


def files_of(work: Path, rank: int) -> set[str]:
    return {p.name for p in holder_dir(work, rank).iterdir()}


def assert_restored(res: list[dict], iteration: int) -> None:
    for rank, r in enumerate(res):
        assert r["found"] == iteration and r["id"] == ckpt_id(iteration, rank)
        assert r["w"] == [[float(100 * iteration + rank)] * 4] * 3
        assert r["b"] == [rank + i for i in range(5)]
        assert (r["step"], r["iteration"], r["betas"]) == (iteration, iteration, [0.9, 0.99])


@pytest.fixture(scope="module")
def journey(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One 4-rank job through every phase (processes are the expensive part on a loaded machine)."""
    return run_ranks(tmp_path_factory.mktemp("journey"), "journey")


def test_cliques_span_the_two_nodes(journey: list[dict]) -> None:
    assert [r["clique"] for r in journey] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # the spec's replicate(): each rank gets its partner's state dict, by id
    for rank, partner in ((0, 2), (1, 3), (2, 0), (3, 1)):
        assert journey[rank]["replicate_api"] == [[f"probe_{partner}"], [900.0 + partner]]


def test_each_rank_holds_its_shard_and_its_partners_replica_of_the_newest_iteration_only(journey: list[dict]) -> None:
    for rank, partner in ((0, 2), (1, 3), (2, 0), (3, 1)):
        assert journey[rank]["files"] == sorted([ckpt_id(2, rank) + SUFFIX, ckpt_id(2, partner) + SUFFIX])
        assert journey[rank]["modes"] == ["0o700", "0o700"]


def test_a_lost_node_directory_is_restored_from_replicas(journey: list[dict]) -> None:
    res = [r["lost_node"] for r in journey]
    assert_restored(res, 2)
    assert [r["source"] for r in res] == ["own file", "own file", "replica", "replica"]


def test_a_corrupted_file_is_detected_and_the_replica_used(journey: list[dict]) -> None:
    res = [r["corrupt"] for r in journey]
    assert_restored(res, 3)
    assert [r["source"] for r in res] == ["own file", "replica", "own file", "own file"]
    assert journey[1]["corrupt_moved_aside"] == [f".corrupt-{ckpt_id(3, 1)}{SUFFIX}"]


def test_both_copies_gone_raises_no_replicas_available(journey: list[dict]) -> None:
    for r in journey:
        r = r["both_gone"]
        assert r["found"] == -1  # iteration 4 was removed once 5 was complete everywhere
        assert "iteration 5" in r["no_replicas"] and "shard of rank(s) [1]" in r["no_replicas"]
        assert "global checkpoint tier" in r["no_replicas"]


def test_a_copy_that_breaks_between_find_and_load_makes_every_rank_look_again_not_hang(journey: list[dict]) -> None:
    assert [r["late_found"] for r in journey] == [4] * 4
    # rank 0's replica of rank 2's shard (its last copy: node 1 was lost) breaks before it is sent: every rank
    # learns it, the broken file is moved aside, and no local iteration is left to restore -> the global tier
    for r in journey:
        assert "no local checkpoint can be restored" in r["late_error"] and "shard of rank(s) [2]" in r["late_error"]
    assert journey[0]["late_moved_aside"] == [f".corrupt-{ckpt_id(4, 2)}{SUFFIX}"]


def test_sigkill_during_a_local_save_restores_the_previous_iteration(tmp_path: Path) -> None:
    run_ranks(tmp_path, "kill", expect_rc=-signal.SIGKILL)
    # every rank wrote iteration 1 completely; iteration 2 was being written (64 MiB per shard) when each rank died
    own2 = [(holder_dir(tmp_path, r) / (ckpt_id(2, r) + SUFFIX)).exists() for r in range(WORLD)]
    res = run_ranks(tmp_path, "restore")
    expected = 2 if all(own2) else 1  # a shard whose own file is missing has no replica either (written after it)
    assert_restored(res, expected)
    for rank in range(WORLD):
        assert not [n for n in files_of(tmp_path, rank) if ".tmp-" in n]  # interrupted writes swept
    if expected == 2:
        pytest.skip("every rank finished writing before its SIGKILL (machine idle): nothing was torn this time")


def test_disk_full_on_one_node_is_one_clear_error_and_the_previous_iteration_stays(tmp_path: Path, tmpfs) -> None:
    tmpfs("4m", name="node1")
    res = run_ranks(tmp_path, "disk_full")
    for r in res:
        assert "local checkpoint of iteration 2 failed" in r["error"] and "not enough space" in r["error"]
        assert "rank 2" in r["error"] and "previous local checkpoint is kept" in r["error"]
        assert "\n" not in r["error"]
        assert r["found_after_failure"] == 1


def test_async_saves_through_nvrx_queue_are_written_by_the_persistent_writer_process(tmp_path: Path) -> None:
    res = run_ranks(tmp_path, "queue")
    for rank, partner in ((0, 2), (1, 3), (2, 0), (3, 1)):
        r = res[rank]
        for it in (1, 2):
            assert r[f"job{it}"] == {"writer_job": True, "same_writer": True, "writer_pid_is_child": True}
            assert r[f"files{it}"] == sorted([ckpt_id(it, rank) + SUFFIX, ckpt_id(it, partner) + SUFFIX])
        assert "scheduled on an AsyncCallsQueue and is not finalized yet" in r["unfinalized_error"]
        assert not [t for t in r["threads"] if "local-ckpt" in t]  # no writer thread left in the rank
    assert_restored([r["restored"] for r in res], 2)  # values as at save time, not the -1 written right after


def test_an_async_save_that_fails_on_one_node_fails_on_every_rank_through_the_queue(tmp_path: Path, tmpfs) -> None:
    tmpfs("4m", name="node1")
    res = run_ranks(tmp_path, "queue_disk_full")
    for rank, r in enumerate(res):
        assert r["error"].startswith("CheckpointWriteFailed") and "local iteration 1" in r["error"], r
        assert "not enough space" in r["error"] and "previous checkpoint is intact" in r["error"]
        assert r["files_after_error"] == []  # the failed iteration's files are removed on every rank


def test_a_writer_process_killed_during_an_async_save_fails_that_save_everywhere_and_the_next_one_works(
        tmp_path: Path) -> None:
    res = run_ranks(tmp_path, "writer_killed")
    for r in res:
        assert "local checkpoint of iteration 2 failed" in r["error"] and "rank 0:" in r["error"]
        assert "killed by SIGKILL" in r["error"] and "previous local checkpoint is kept" in r["error"]
        assert r["found_after"] == 1 and r["new_writer"]
    assert_restored(res, 3)


def test_a_cut_off_nodes_late_files_are_never_restored(tmp_path: Path) -> None:
    """No split brain in the local tier (nvrx/ckpt/fence.py): node 1 is cut off, round 1 resumes from iteration 1
    without it, node 1's ranks of round 0 then write iteration 2 (every shard has a copy on node 1). Round 2, with
    node 1 back, restores iteration 1, not 2, and says why; a save by round 0 where round 1 resumed is refused on
    every rank; the job's own later saves and a later launch are restored as usual."""
    res = run_ranks(tmp_path, "cut_off")
    assert_restored([r["round1"] for r in res], 1)
    assert {ckpt_id(2, 2) + SUFFIX, ckpt_id(2, 0) + SUFFIX} <= set(res[2]["round2_files"])  # the late files
    assert_restored([r["round2"] for r in res], 1)
    for r in res:
        assert "round 0, which the job has left" in r["stale_save"] and "\n" not in r["stale_save"]
        assert not [n for n in r["node0_files"] if n.startswith("iter_000000003")]
        assert any("iteration 2: written by round 0 after round 1 of the job resumed from iteration 1" in n
                   for n in r["round2_notes"]), r["round2_notes"]
        assert r["round2_after_save"] == 4
    assert_restored([r["next_launch"] for r in res], 4)
