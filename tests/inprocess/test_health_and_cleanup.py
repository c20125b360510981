"""Health checks that end a rank, and what a run leaves behind (processes, /dev/shm), with real ranks."""

from __future__ import annotations

import datetime
import signal
from pathlib import Path

import pytest

from nvrx.launcher.rank.inprocess.progress import SLOT_DIR_PREFIX
from tests.inprocess.harness import JobResult, run_job


FAST = {"soft_timeout": 1.5, "hard_timeout": 3.0, "heartbeat_timeout": 3.0, "monitor_process_interval": 0.25,
        "termination_grace_time": 0.5, "barrier_timeout": 30.0, "completion_timeout": 30.0}


@pytest.fixture(scope="module")
def unhealthy(tmp_path_factory) -> JobResult:
    # Iteration 0: rank 2 raises (a restart). Before iteration 1 runs, rank 1's own health check fails:
    # rank 1 must leave for good and ranks 0 and 2 finish as ranks 0 and 1 of 2.
    plan = {"wrapper": FAST, "steps": 3, "gloo_timeout": 300, "unhealthy": {"rank": 1, "iteration": 1},
            "actions": {"0": {"2": {"at_step": 1, "do": "raise"}}}}
    return run_job(tmp_path_factory.mktemp("unhealthy"), 3, plan)


def test_a_rank_whose_health_check_fails_before_the_run_leaves_and_the_rest_finish(unhealthy):
    res = unhealthy
    assert res.codes[1] != 0, res.stderr[1]
    assert res.codes[0] == 0 and res.codes[2] == 0, res.stderr
    assert res.of(1, "unhealthy", iteration=1)
    err = res.of(1, "wrapper_error")
    # as in NVRx, the user's exception is wrapped in a HealthCheckError (its message names the cause)
    assert err and err[0]["kind"] == "HealthCheckError" and "RuntimeError: user health check" in err[0]["message"]
    assert 1 not in res.starts(1), "the unhealthy rank ran the wrapped function"
    assert not [e for e in res.of(1, "health_check") if e["iteration"] > 1], "the unhealthy rank rejoined"
    last = max(res.starts(0))
    assert res.starts(0)[last]["world"] == 2 and res.starts(2)[last]["rank"] == 1
    assert res.of(0, "returned") and res.of(2, "returned")
    assert len(res.pids(0)) == 1 and len(res.pids(2)) == 1
    assert "health check failed before iteration 1" in res.stderr[1]
    assert "health check failed" in res.stderr[0]  # "continuing without rank(s) 1 (health check failed: ...)"
    assert res.leftovers == []


def _slot_dirs(res: JobResult) -> set[str]:
    return {e["slot_dir"] for rank in res.events for e in res.of(rank, "start")}


def _slot_dirs_left(res: JobResult) -> list[str]:
    return [d for d in _slot_dirs(res) if Path(d).exists()]


def _restart_summaries(res: JobResult, rank: int) -> list[str]:
    """The monitor thread's one-line summaries of the faults behind each restart, in RANK's stderr."""
    return [line for line in res.stderr[rank].splitlines() if "INFO restarting: " in line]


def test_the_unhealthy_ranks_shared_memory_is_removed(unhealthy):
    dirs = _slot_dirs(unhealthy)
    assert dirs and all(Path(d).name.startswith(SLOT_DIR_PREFIX) for d in dirs)
    assert _slot_dirs_left(unhealthy) == []


# ---------------------------------------------------------------- a rank deaf to SIGTERM on a hard timeout


@pytest.fixture(scope="module")
def deaf_to_sigterm(tmp_path_factory) -> JobResult:
    tmp = tmp_path_factory.mktemp("deaf")
    plan = {"wrapper": {**FAST, "termination_grace_time": 1.0, "monitor_process_logfile": str(tmp / "monitor{rank}.log")},
            "steps": 3, "actions": {"0": {"1": {"at_step": 1, "do": "gil_hang_ignore_term"}}}}
    return run_job(tmp, 2, plan)


def test_sigkill_follows_sigterm_after_the_grace_time_when_a_rank_ignores_sigterm(deaf_to_sigterm):
    res = deaf_to_sigterm
    assert res.of(1, "ignoring_sigterm")
    assert res.codes[1] == -signal.SIGKILL, res.stderr[1]
    assert res.codes[0] == 0, res.stderr[0]
    assert res.starts(0)[1]["world"] == 1 and res.of(0, "returned")
    log = (res.out.parent / "monitor1.log").read_text()
    assert "hard timeout: no progress" in log and "rank process killed" in log
    assert "ended after SIGTERM" not in log
    assert _slot_dirs_left(res) == [], "the killed rank's shared memory was left"
    assert res.leftovers == []


def test_sigkill_waits_for_the_grace_time(deaf_to_sigterm):
    lines = (deaf_to_sigterm.out.parent / "monitor1.log").read_text().splitlines()

    def when(text: str) -> float:
        stamp = next(line for line in lines if text in line).split(" inprocess-monitor[")[0]
        return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()

    assert when("rank process killed") - when("hard timeout: no progress") >= 1.0 - 0.05


# ---------------------------------------------------------------- last_call_wait gathers concurrent faults


def _gather_plan(last_call_wait: float) -> dict:
    # Rank 1 fails at once, rank 2 one second later; rank 0 is idle in a GIL-releasing sleep, so only its
    # monitor thread can notice, and it reports every fault it gathered.
    return {"wrapper": {**FAST, "soft_timeout": 20.0, "hard_timeout": 40.0, "last_call_wait": last_call_wait},
            "steps": 2, "raise_after_seconds": 1.0, "gloo_timeout": 300,
            "actions": {"0": {"0": {"at_step": 0, "do": "sleep"}, "1": {"at_step": 0, "do": "raise"},
                              "2": {"at_step": 0, "do": "raise_after"}}}}


def test_last_call_wait_gathers_two_concurrent_faults_into_one_restart(tmp_path):
    res = run_job(tmp_path, 3, _gather_plan(last_call_wait=2.5))
    assert res.codes == {0: 0, 1: 0, 2: 0}, res.stderr
    for rank in range(3):
        assert sorted(res.starts(rank)) == [0, 1], "the two faults caused more than one restart"
    assert res.of(2, "error", iteration=0), "rank 2 was interrupted before its own fault"
    summary = _restart_summaries(res, 0)
    assert len(summary) == 1 and "rank 1: ValueError" in summary[0] and "rank 2: ValueError" in summary[0]
    assert _slot_dirs_left(res) == []
    assert res.leftovers == []


def test_without_last_call_wait_the_first_fault_interrupts_at_once(tmp_path):
    res = run_job(tmp_path, 3, _gather_plan(last_call_wait=0.0))
    assert res.codes == {0: 0, 1: 0, 2: 0}, res.stderr
    assert res.of(2, "interrupted", iteration=0) and not res.of(2, "error", iteration=0)
    summary = _restart_summaries(res, 0)
    assert len(summary) == 1 and "rank 1: ValueError" in summary[0] and "rank 2" not in summary[0]
