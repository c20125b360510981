"""Fault matrix: faults of a rank or of its monitor (crash, hangs, stuck in C, monitor killed, budget spent)."""

from __future__ import annotations

import os
import stat


from tests.faults.conftest import children_named, kill, one_line


# a restart must finish within the test's timeout even on a busy 2-core machine; hang timeouts are short
FAST = {"FAULT_STEP_TIME": "0.03"}


def _recovered(job, proc, needle: str = "", hang: str = "") -> str:
    """The job restarted once, finished every step, lost nothing and left nothing. NEEDLE: on the terminal. HANG:
    the reason of the monitor's hang_detected event (the terminal may name a peer whose collective failed first)."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert needle in err, err
    assert "restarting the job (restart 1)" in err
    if hang:
        hangs = [e["reason"] for e in job.events(_run_id(job), "monitor-") if e["ev"] == "hang_detected"]
        assert hang in hangs, (hangs, err)  # (a peer blocked in a collective with it may hang too)
    assert job.ledger.finished() and len(job.ledger.resumes()) == 2
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()
    return err


def test_rank_crash(job):
    """Fault: a rank crashes (exits with an error) mid-training.
    Outcome: every rank is restarted in place from the last checkpoint; the job finishes, exit 0.
    """
    proc = job.start("--nproc-per-node", "2", "--max-restarts", "1", *job.train(12, "crash"), env=FAST)
    _recovered(job, proc, "rank 1 (local 1) exited with code 3")


def test_rank_hang_heartbeat(job):
    """Fault: a rank hangs and stops sending heartbeats.
    Outcome: its monitor kills it after rank_heartbeat_timeout; the job restarts in place and finishes.
    """
    proc = job.start("--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-rank-heartbeat-timeout", "1",
                     *job.train(12, "hang_heartbeat"), env=FAST)
    _recovered(job, proc, hang="heartbeat_timeout")


def test_rank_hang_in_section(job):
    """Fault: a rank hangs inside a timed section ("step").
    Outcome: its monitor kills it after the section's timeout; the job restarts in place and finishes.
    """
    proc = job.start("--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-rank-section-timeouts", "step:1",
                     *job.train(12, "hang_section"), env=FAST)
    _recovered(job, proc, hang="section_timeout")


def test_rank_hang_out_of_section(job):
    """Fault: a rank hangs outside of any section.
    Outcome: its monitor kills it after rank_out_of_section_timeout; the job restarts in place and finishes.
    """
    proc = job.start("--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-rank-out-of-section-timeout", "1",
                     *job.train(12, "hang_outside"), env=FAST)
    _recovered(job, proc, hang="out_of_section_timeout")


def test_rank_hang_before_first_heartbeat(job):
    """Fault: a rank hangs during start-up, before its first heartbeat.
    Outcome: its monitor kills it after initial_rank_heartbeat_timeout (counted from the rank's start); restart, finish.
    """
    proc = job.start("--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-initial-rank-heartbeat-timeout", "4",
                     *job.train(12, "hang_first"), env=FAST)
    _recovered(job, proc, hang="no_first_heartbeat")


def test_rank_stuck_in_c_call_ignoring_sigterm(job):
    """Fault: a hung rank is stuck in a C call and ignores SIGTERM (the configured termination signal).
    Outcome: SIGKILL after --term-timeout; the job restarts in place and finishes.
    """
    proc = job.start("--nproc-per-node", "2", "--max-restarts", "1", "--term-timeout", "1",
                     "--ft-param-rank-heartbeat-timeout", "1", "--ft-param-rank-termination-signal", "SIGTERM",
                     *job.train(12, "stuck_c"), env=FAST)
    _recovered(job, proc, hang="heartbeat_timeout")
    # its monitor's grace, or the agent's when a peer's failure stopped the round first, ends in SIGKILL
    killed = [e for e in job.events(_run_id(job), "") if e["ev"] in ("rank_killed", "agent_killed_rank")]
    assert killed, "the rank that ignored SIGTERM was not SIGKILLed after the grace"


def test_monitor_killed(job):
    """Fault: a rank monitor is SIGKILLed while its rank trains.
    Outcome: the agent restarts the monitor and the rank re-attaches; the job finishes without a restart, exit 0.
    """
    proc = job.start("--nproc-per-node", "1", *job.train(40), env={"FAULT_STEP_TIME": "0.05"})
    job.wait_running()
    (monitor,) = children_named(proc.pid, "nvrx.monitors.rank_monitor")
    kill(monitor.pid)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert job.ledger.finished() and len(job.ledger.resumes()) == 1
    spawned = [e for e in job.events(_run_id(job)) if e["ev"] == "monitor_spawned"]
    assert len(spawned) == 2  # the first one and its replacement
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_restarts_used_up(job):
    """Fault: a rank fails in every attempt until --max-restarts is spent.
    Outcome: exit 1; the report names each round's failed rank and exit code.
    """
    res = job.run("--nproc-per-node", "2", "--max-restarts", "1", *job.train(12, "crash_always"), env=FAST,
                  timeout=120)
    assert res.returncode == 1, res.stderr
    assert "job failed" in res.stderr and res.stderr.count("rank 1 (local 1) exited with code 3") >= 2
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_run_files_are_private(job):
    """Fault: a permissive umask (0) on a shared machine: other users could read the job's output.
    Outcome: every file of the run is 0600 and every directory 0700 (events, rank stdout/stderr, monitor logs).
    """
    old = os.umask(0)
    try:
        proc = job.start("--nproc-per-node", "1", "--tee", "3", "--rdzv-id", "private", *job.train(3))
    finally:
        os.umask(old)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    run = job.run_dir("private")
    modes = {str(p.relative_to(run)): stat.S_IMODE(p.stat().st_mode) for p in [run, *run.rglob("*")]}
    assert "attempt_0/0/stdout.log" in modes and "attempt_0/0/stderr.log" in modes
    assert any(name.startswith("monitor-") and name.endswith(".log") for name in modes)
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o700 if (run / name).is_dir() else 0o600)}
    assert wrong == {}, wrong
    job.assert_clean()


def _run_id(job) -> str:
    (run,) = [p.name for p in (job.tmp_path / "nvrx_logs").iterdir()]
    return run
