"""Rank monitors under `nvrx launch`: hang detection restarts the job with the reason; monitors live across restarts."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil

from tests.conftest import run_events, wait_for, write_script


HANG_SCRIPT = r'''
import os, sys, time
import torch.distributed as dist
from nvrx.monitors import RankMonitorClient
out = sys.argv[1]
dist.init_process_group("gloo")
c = RankMonitorClient()
c.init_workload_monitoring()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join(out, f"ready.{dist.get_rank()}.{attempt}"), "w").write(str(os.getpid()))
for step in range(int(sys.argv[2])):
    c.send_heartbeat()
    time.sleep(0.05)
    if attempt == 0 and dist.get_rank() == 1 and step == 5:
        time.sleep(1000)  # hang without heartbeats
    dist.barrier()
c.shutdown_workload_monitoring()
'''


def test_hang_is_detected_and_job_restarts_with_reason(launcher, tmp_path):
    script = write_script(tmp_path / "hang.py", HANG_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    res = launcher.run("--nproc-per-node", "2", "--max-restarts", "2", "--rdzv-id", "hang",
                       "--ft-param-rank-heartbeat-timeout", "1", "--ft-param-initial_rank_heartbeat_timeout=30",
                       str(script), str(out), "20", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "by its monitor: heartbeat timeout" in res.stderr
    run_dir = tmp_path / "nvrx_logs" / "hang"
    hangs = [e for e in run_events(run_dir, "monitor-") if e["ev"] == "hang_detected"]
    assert hangs and hangs[0]["reason"] == "heartbeat_timeout" and hangs[0]["timeout"] == 1.0
    assert 1.0 <= hangs[0]["elapsed"] < 1.5
    stops = [e for e in run_events(run_dir, "agent-") if e["ev"] == "rdzv_stop" and e["kind"] == "failed"]
    assert stops and stops[0]["detail"]["hang"]["reason"] == "heartbeat_timeout"
    # one monitor per rank, started once, across the restart
    spawned = [e for e in run_events(run_dir, "agent-") if e["ev"] == "monitor_spawned"]
    assert len(spawned) == 2
    cfg = [e for e in run_events(run_dir, "agent-") if e["ev"] == "ft_config"]
    assert cfg and cfg[0]["config"]["rank_heartbeat_timeout"] == 1.0
    assert launcher.leftovers() == []


def _monitors(pid: int) -> list[tuple[psutil.Process, list[str]]]:
    """Live rank-monitor children of the agent and their command lines (a killed one is a zombie until the
    agent reaps it)."""
    found = []
    for p in psutil.Process(pid).children():
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "nvrx.monitors.rank_monitor" in " ".join(cmd):
            found.append((p, cmd))
    return found


def _monitor_children(pid: int) -> list[psutil.Process]:
    return [p for p, _ in _monitors(pid)]


def test_killed_monitor_is_restarted_by_the_agent(launcher, tmp_path):
    script = write_script(tmp_path / "hang.py", HANG_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "1", "--rdzv-id", "mon", "--ft-param-rank-heartbeat-timeout", "30",
                          str(script), str(out), "200")
    wait_for((out / "ready.0.0").exists, 60)
    monitors = _monitor_children(proc.pid)
    assert len(monitors) == 1
    monitors[0].send_signal(signal.SIGKILL)
    assert wait_for(lambda: [p for p in _monitor_children(proc.pid) if p.pid != monitors[0].pid], 10), \
        "the agent did not restart the killed monitor"
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert launcher.leftovers() == []


AUTO_SCRIPT = r'''
import os, sys, time
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
deadline = time.monotonic() + 2.0
while time.monotonic() < deadline:   # busy Python work: the progress watchdog beats
    sum(range(1000))
if attempt == 0 and os.environ["RANK"] == "1":
    open(os.path.join(sys.argv[1], "hanging"), "w").close()
    time.sleep(1000)                 # blocks the interpreter: no bytecode, no automatic heartbeat
'''


def test_auto_heartbeat_gives_an_unmodified_script_hang_detection(launcher, tmp_path):
    script = write_script(tmp_path / "auto.py", AUTO_SCRIPT)
    res = launcher.run("--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "auto",
                       "--ft-param-auto-heartbeat", "true", "--ft-param-rank-heartbeat-timeout", "1",
                       str(script), str(tmp_path), timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "hanging").exists()
    hangs = [e for e in run_events(tmp_path / "nvrx_logs" / "auto", "monitor-") if e["ev"] == "hang_detected"]
    assert [h["reason"] for h in hangs] == ["heartbeat_timeout"], hangs  # only the blocked rank, only once
    assert hangs[0]["global_rank"] == 1
    assert "by its monitor: heartbeat timeout" in res.stderr
    assert launcher.leftovers() == []


LATE_INIT_SCRIPT = r'''
import os, sys, time
from nvrx.monitors import RankMonitorClient
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    time.sleep(float(sys.argv[1]))       # a slow start, before any monitoring call
c = RankMonitorClient()
c.init_workload_monitoring()
if attempt == 0:
    time.sleep(30)                      # would never heartbeat
for _ in range(3):
    c.send_heartbeat()
c.shutdown_workload_monitoring()
'''


def test_first_heartbeat_timeout_counts_from_rank_start_once_monitoring_starts(launcher, tmp_path):
    """The bootstrap attaches ranks at start: no deadline before init, but the initial timeout covers the start."""
    script = write_script(tmp_path / "late.py", LATE_INIT_SCRIPT)
    res = launcher.run("--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-id", "late",
                       "--ft-param-initial-rank-heartbeat-timeout", "1.5", "--ft-param-workload-check-interval", "0.2",
                       str(script), "2.5", timeout=120)
    assert res.returncode == 0, res.stderr
    events = run_events(tmp_path / "nvrx_logs" / "late", "monitor-")
    attach = [e for e in events if e["ev"] == "monitor_attach"]
    assert attach and attach[0]["armed"] is False
    hangs = [e for e in events if e["ev"] == "hang_detected"]
    assert len(hangs) == 1 and hangs[0]["reason"] == "no_first_heartbeat", hangs
    assert hangs[0]["elapsed"] >= 2.5  # measured from the rank's start, not from init; not killed before init
    assert launcher.leftovers() == []


REATTACH_SCRIPT = r'''
import os, sys, time
from nvrx.monitors import RankMonitorClient
out = sys.argv[1]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
c = RankMonitorClient()
c.init_workload_monitoring()
open(os.path.join(out, f"ready.{attempt}"), "w").write(str(os.getpid()))
while attempt == 0 and not os.path.exists(os.path.join(out, "hang-now")):
    c.send_heartbeat()
    time.sleep(0.05)
if attempt == 0:
    time.sleep(1000)   # hang after the monitor was replaced: only a re-attached rank is still watched
c.send_heartbeat()
c.shutdown_workload_monitoring()
'''


def test_rank_reattaches_to_a_restarted_monitor_and_stays_watched(launcher, tmp_path):
    script = write_script(tmp_path / "reattach.py", REATTACH_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-id", "reattach",
                          "--ft-param-rank-heartbeat-timeout", "1", str(script), str(out))
    wait_for((out / "ready.0").exists, 60)
    first = _monitor_children(proc.pid)
    assert len(first) == 1
    first[0].send_signal(signal.SIGKILL)
    run_dir = tmp_path / "nvrx_logs" / "reattach"
    wait_for(lambda: any(e["ev"] == "monitor_attach" and e.get("reattach") for e in run_events(run_dir, "monitor-")), 20)
    (out / "hang-now").touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    events = run_events(run_dir, "monitor-")
    assert any(e["ev"] == "monitor_attach" and e.get("reattach") and e["armed"] for e in events)
    hangs = [e for e in events if e["ev"] == "hang_detected"]
    assert len(hangs) == 1 and hangs[0]["reason"] == "heartbeat_timeout"
    assert (out / "ready.1").exists()
    assert launcher.leftovers() == []


LEARN_SCRIPT = r'''
import json, os, sys, time
from nvrx.monitors import RankMonitorClient
c = RankMonitorClient()
c.init_workload_monitoring()
print("TIMEOUTS_AT_START", json.dumps(c.timeouts), flush=True)
if sys.argv[1] == "learn":
    for _ in range(8):
        c.send_heartbeat()
        time.sleep(0.1)
    c.calculate_and_set_timeouts()
    print("TIMEOUTS_LEARNED", json.dumps(c.timeouts), flush=True)
c.shutdown_workload_monitoring()
'''


def _printed(stdout: str, tag: str) -> dict:
    line = next(line for line in stdout.splitlines() if tag in line)
    return json.loads(line.split(tag, 1)[1])


def test_second_job_starts_with_the_timeouts_the_first_learned(launcher, tmp_path):
    script = write_script(tmp_path / "learn.py", LEARN_SCRIPT)
    state = tmp_path / "state"
    first = launcher.run("--nproc-per-node", "1", "--rdzv-id", "job1", "--state-dir", str(state),
                         "--ft-param-rank-heartbeat-timeout", "null", str(script), "learn", timeout=120)
    assert first.returncode == 0, first.stderr
    learned = _printed(first.stdout, "TIMEOUTS_LEARNED")
    assert learned["heartbeat"] is not None and 0.5 <= learned["heartbeat"] <= 5 * 0.1 * 3  # ~0.1 s x factor 5
    second = launcher.run("--nproc-per-node", "1", "--rdzv-id", "job2", "--state-dir", str(state),
                          "--ft-param-rank-heartbeat-timeout", "null", str(script), "use", timeout=120)
    assert second.returncode == 0, second.stderr
    assert _printed(second.stdout, "TIMEOUTS_AT_START")["heartbeat"] == learned["heartbeat"]
    loaded = [e for e in run_events(tmp_path / "nvrx_logs" / "job2", "monitor-") if e["ev"] == "timeouts_loaded"]
    assert loaded and loaded[0]["timeouts"]["heartbeat"] == learned["heartbeat"]
    assert launcher.leftovers() == []


def test_monitor_that_keeps_dying_fails_the_job_with_the_reason(launcher, tmp_path):
    """Restarting a broken monitor forever would leave its rank unwatched while the job 'succeeds'."""
    from nvrx.launcher.agent.rank_monitors import MAX_RESTARTS

    script = write_script(tmp_path / "hang.py", HANG_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-id", "flaky",
                          "--ft-param-rank-heartbeat-timeout", "30", str(script), str(out), "100000")
    assert wait_for((out / "ready.0.0").exists, 60)
    killed: set[int] = set()
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        for p in _monitor_children(proc.pid):
            if p.pid not in killed:
                killed.add(p.pid)
                p.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert len(killed) == MAX_RESTARTS + 1
    assert f"rank monitor of local rank 0 died {MAX_RESTARTS + 1} times" in err
    events = run_events(tmp_path / "nvrx_logs" / "flaky", "agent-")
    assert [e for e in events if e["ev"] == "monitor_gave_up"]
    end = [e for e in events if e["ev"] == "job_end"][-1]
    assert end["status"] == "failed" and end["failures"][0]["monitor_failed"]
    assert not [e for e in events if e["ev"] == "rdzv_round" and e.get("round", 0) > 1]  # no useless job restart
    assert launcher.leftovers() == []


def test_monitors_clean_up_when_the_agent_is_killed(launcher, tmp_path):
    """SIGKILL the agent: its monitors exit, remove their /tmp/nvrx-mon-* dir, and nothing is left running."""
    script = write_script(tmp_path / "hang.py", HANG_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "2", "--rdzv-id", "killed", "--ft-param-rank-heartbeat-timeout", "30",
                          str(script), str(out), "100000")
    assert wait_for(lambda: (out / "ready.0.0").exists() and (out / "ready.1.0").exists(), 60)
    assert wait_for(lambda: len(_monitor_children(proc.pid)) == 2, 10)
    dirs = {os.path.dirname(cmd[cmd.index("--socket") + 1]) for _, cmd in _monitors(proc.pid)}  # private dirs
    assert len(dirs) == 1 and os.path.basename(next(iter(dirs))).startswith("nvrx-mon-")
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) >= 4  # 2 ranks + 2 monitors (+ fork server)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                                    for pid in tree), 15), "processes of the killed agent are still running"
    assert wait_for(lambda: not any(os.path.exists(d) for d in dirs), 5), f"left behind: {dirs}"
    assert launcher.leftovers() == []


TOKEN_SCRIPT = r'''
import os, subprocess, sys
from nvrx.monitors import RankMonitorClient
print("TOKEN_IN_ENV", "NVRX_MONITOR_TOKEN" in os.environ, flush=True)
child = subprocess.run([sys.executable, "-c", "import os; print('NVRX_MONITOR_TOKEN' in os.environ)"],
                       capture_output=True, text=True)
print("TOKEN_IN_CHILD", child.stdout.strip(), flush=True)
c = RankMonitorClient()
c.init_workload_monitoring()   # the bootstrap kept the token for this process
c.send_heartbeat()
c.shutdown_workload_monitoring()
'''


def test_bootstrap_removes_the_token_from_the_rank_environment(launcher, tmp_path):
    script = write_script(tmp_path / "token_check.py", TOKEN_SCRIPT)
    res = launcher.run("--nproc-per-node", "1", "--rdzv-id", "token", str(script), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "TOKEN_IN_ENV False" in res.stdout and "TOKEN_IN_CHILD False" in res.stdout
    connects = [e for e in run_events(tmp_path / "nvrx_logs" / "token", "monitor-") if e["ev"] == "monitor_connect"]
    assert connects
    assert launcher.leftovers() == []
