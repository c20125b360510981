"""Straggler detection and workload control under a real `nvrx launch` (gloo ranks, real monitors and stores)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvrx.slurm.nodes import find_bad_node
from tests.conftest import REPO, STARTUP_WAIT, free_port, one_line_error, run_events, wait_for

TRAIN = str(Path(__file__).with_name("train.py"))
HOST = socket.gethostname()


def _inspect(run_dir: Path) -> str:
    res = subprocess.run([sys.executable, "-m", "nvrx", "inspect", str(run_dir)], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _launch(launcher, run_id: str, *extra: str, env: dict[str, str], timeout: float = 90):
    return launcher.run("--standalone", "--nproc-per-node", "2", "--rdzv-id", run_id, *extra, TRAIN,
                        env={"OMP_NUM_THREADS": "1", **env}, timeout=timeout)


def test_a_slowed_rank_is_flagged_with_its_rank_and_node(launcher, tmp_path):
    res = _launch(launcher, "slow", "--ft-param-straggler_report_interval", "1",
                  env={"STEPS": "90", "SLOW_RANK": "1", "SLOW_FACTOR": "2"})
    assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "nvrx_logs" / "slow"
    flagged = [e for e in run_events(run_dir, "agent-") if e["ev"] == "straggler"]
    assert flagged, res.stderr
    assert {(e["rank"], e["node"], e["metric"], e["state"]) for e in flagged} == {(1, HOST, "compute", "straggler")}
    assert all(1.6 < e["relative"] < 2.5 for e in flagged)
    assert f"straggler: rank 1 on node {HOST} is slow" in res.stderr  # the agent's log line
    report = _inspect(run_dir)
    assert f"rank 1 on node {HOST} is a straggler since" in report and "section 'compute'" in report
    assert "rank 0 on node" not in report
    assert launcher.leftovers() == []


@pytest.mark.slow
def test_a_steady_run_of_30_seconds_flags_no_straggler(launcher, tmp_path):
    """No false positive with this machine's noise (a short stand-in for the issue's 10 minutes)."""
    t0 = time.monotonic()
    res = _launch(launcher, "steady", "--ft-param-straggler_report_interval", "2", env={"STEPS": "850"},
                  timeout=150)
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 > 25
    run_dir = tmp_path / "nvrx_logs" / "steady"
    timings = [e for e in run_events(run_dir, "monitor-") if e["ev"] == "rank_timing"]
    assert {e["global_rank"] for e in timings} == {0, 1} and len(timings) >= 20  # the detector did look
    assert [e for e in run_events(run_dir, "agent-") if e["ev"] == "straggler"] == []
    assert "straggler" not in res.stderr and "straggler" not in _inspect(run_dir)


@pytest.mark.parametrize("action, code, words", [("ExcludeThisNode", 16, f"exclude its node {HOST}"),
                                                 ("ShutdownWorkload", 93, "shut the job down")])
def test_a_rank_request_through_its_monitor_ends_the_job_at_once(launcher, tmp_path, action, code, words):
    t0 = time.monotonic()
    res = _launch(launcher, "ctl", "--max-restarts", "3",
                  env={"CONTROL": action, "CONTROL_RANK": "1", "STEP_SLEEP": "0.05"})
    assert res.returncode == code, res.stderr
    assert time.monotonic() - t0 < 45  # the ranks step forever: the agent stopped them on the request
    run_dir = tmp_path / "nvrx_logs" / "ctl"
    agent = run_events(run_dir, "agent-")
    assert sum(e["ev"] == "rank_start" for e in agent) == 2  # no restart despite --max-restarts 3
    (stop,) = [e for e in agent if e["ev"] == "rdzv_stop"]
    assert stop["detail"]["steer"] == code and stop["detail"]["rank"] == 1 and stop["give_up"] is True
    (req,) = [e for e in run_events(run_dir, "monitor-") if e["ev"] == "workload_control"]
    assert (req["global_rank"], req["action"], req["description"], req["forwarded"]) == (1, action, "test: bad node", True)
    assert f"rank 1 (local 1) asked to" in res.stderr
    report = _inspect(run_dir)
    assert f"asked through its monitor to {words}" in report and ": test: bad node" in report
    assert "rank 1 asked its monitor to end the job" in report
    assert find_bad_node(tmp_path / "nvrx_logs", "ctl") == (HOST if code == 16 else None)
    assert launcher.leftovers() == []


def test_the_exclusion_policy_keeps_a_straggling_node_out_of_the_next_round(launcher, tmp_path):
    """Two emulated nodes; rank 1 (node B) is slow; after a fault, node B sits out with exit 16 and A goes on."""
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv-id", "pol", "--rdzv-conf", "join_timeout=60,last_call_timeout=3", "--max-restarts", "1",
              "--ft-param-straggler_report_interval", "1", "--ft-param-straggler_exclude_after_reports", "2", TRAIN]
    env = {"OMP_NUM_THREADS": "1", "STEPS": "70", "SLOW_RANK": "1", "CRASH_RANK": "0", "CRASH_STEP": "60"}
    a = launcher.start(*common, env=env)
    run_dir = tmp_path / "nvrx_logs" / "pol"
    assert wait_for(lambda: run_dir.exists() and any(e["ev"] == "rdzv_join" for e in run_events(run_dir, "agent-")), STARTUP_WAIT)
    b = launcher.start(*common, env=env)
    _, err_b = b.communicate(timeout=120)
    out_a, err_a = a.communicate(timeout=120)
    assert b.returncode == 16, err_b
    assert a.returncode == 0, err_a
    events = run_events(run_dir, "agent-")
    flagged = [e for e in events if e["ev"] == "straggler"]
    assert {e["rank"] for e in flagged} == {1} and any(e.get("exclude") for e in flagged)
    sat_out = [e for e in events if e["ev"] == "node_health" and not e["ok"]]
    assert [c["name"] for e in sat_out for c in e["checks"]] == ["straggler"]
    assert "rank 1 was a straggler" in err_b
    assert "(straggler failed: rank 1 was a straggler for 2 reports in a row" in _inspect(run_dir)
    assert launcher.leftovers() == []


@pytest.mark.parametrize("flag, value, words", [
    ("--ft-param-straggler_threshold", "0.9", "straggler_threshold"),
    ("--ft-param-straggler_sustain_reports", "0", "straggler_sustain_reports"),
    ("--ft-param-straggler_report_interval", "soon", "straggler_report_interval"),
    ("--ft-param-straggler_exclude_after_reports", "-1", "straggler_exclude_after_reports")])
def test_a_bad_straggler_setting_is_one_line_and_exit_2(launcher, flag, value, words):
    res = launcher.run("--standalone", "--nproc-per-node", "1", flag, value, TRAIN, timeout=60)
    one_line_error(res, words, value)


NO_AGENT_RANK = r'''
from nvrx.monitors import RankMonitorClient, RankMonitorClientError, WorkloadAction, WorkloadControlRequest
c = RankMonitorClient()
c.init_workload_monitoring()
for req in (WorkloadControlRequest(WorkloadAction.ExcludeThisNode, "bad"), "ExcludeThisNode"):
    try:
        c.send_workload_control_request(req)
        print("SENT")
    except RankMonitorClientError as exc:
        print("REFUSED", exc)
c.shutdown_workload_monitoring()
'''


def test_a_request_no_agent_can_take_raises_in_the_rank(tmp_path):
    """A monitor started by RankMonitorServer (NVRx's way, no nvrx agent): the rank learns it was not passed on."""
    import os

    from nvrx.monitors import FaultToleranceConfig, RankMonitorServer

    sock = tmp_path / "rank0.socket"
    server = RankMonitorServer.run_in_subprocess(FaultToleranceConfig(), str(sock))
    try:
        script = tmp_path / "rank.py"
        script.write_text(NO_AGENT_RANK)
        env = {**os.environ, "FT_RANK_MONITOR_IPC_SOCKET": str(sock), "RANK": "0", "PYTHONPATH": str(REPO)}
        for name in ("NVRX_MONITOR_SOCKET", "NVRX_MONITOR_TOKEN", "NVRX_MONITOR_SHM"):
            env.pop(name, None)
        res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.terminate()
        server.join(10)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("SENT", "REFUSED"))]
    assert len(lines) == 2 and all(ln.startswith("REFUSED") for ln in lines), res.stdout + res.stderr
    assert "could not pass" in lines[0] and "takes a WorkloadControlRequest" in lines[1]
