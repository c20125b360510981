"""Rank monitors under `nvrx launch`: hang detection restarts the job with the reason; monitors live across restarts."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import write_script

pytestmark = pytest.mark.slow

HANG_SCRIPT = r'''
import os, sys, time
import torch.distributed as dist
from monitors import RankMonitorClient
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


def _events(run_dir: Path, prefix: str) -> list[dict]:
    return [json.loads(line) for f in run_dir.glob(f"{prefix}*.jsonl") for line in f.read_text().splitlines()]


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
    hangs = [e for e in _events(run_dir, "monitor-") if e["ev"] == "hang_detected"]
    assert hangs and hangs[0]["reason"] == "heartbeat_timeout" and hangs[0]["timeout"] == 1.0
    assert 1.0 <= hangs[0]["elapsed"] < 1.5
    stops = [e for e in _events(run_dir, "agent-") if e["ev"] == "rdzv_stop" and e["kind"] == "failed"]
    assert stops and stops[0]["detail"]["hang"]["reason"] == "heartbeat_timeout"
    # one monitor per rank, started once, across the restart
    spawned = [e for e in _events(run_dir, "agent-") if e["ev"] == "monitor_spawned"]
    assert len(spawned) == 2
    cfg = [e for e in _events(run_dir, "agent-") if e["ev"] == "ft_config"]
    assert cfg and cfg[0]["config"]["rank_heartbeat_timeout"] == 1.0
    assert launcher.leftovers() == []


def _monitor_children(pid: int) -> list[psutil.Process]:
    """Live rank-monitor children of the agent (a killed one is a zombie until the agent reaps it)."""
    found = []
    for p in psutil.Process(pid).children():
        try:
            if "monitors.rank_monitor" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_killed_monitor_is_restarted_by_the_agent(launcher, tmp_path):
    script = write_script(tmp_path / "hang.py", HANG_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "1", "--rdzv-id", "mon", "--ft-param-rank-heartbeat-timeout", "30",
                          str(script), str(out), "200")
    deadline = time.monotonic() + 60
    while not (out / "ready.0.0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    monitors = _monitor_children(proc.pid)
    assert len(monitors) == 1
    monitors[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    new = []
    while time.monotonic() < deadline and not new:
        new = [p for p in _monitor_children(proc.pid) if p.pid != monitors[0].pid]
        time.sleep(0.05)
    assert new, "the agent did not restart the killed monitor"
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert launcher.leftovers() == []
