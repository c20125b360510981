"""`nvrx inspect` on real `nvrx launch` runs: goodput vs uptime after a hang, and the agent's SIGKILL of a rank.

Each test launches real ranks (subprocesses, real rank monitors) and reads the logs with the real CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


from tests.conftest import REPO, run_events, write_script


INSPECT = [sys.executable, "-m", "nvrx", "inspect"]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*INSPECT, *args], capture_output=True, text=True, env=ENV, timeout=60)


# Progress by the automatic heartbeat (busy Python work), one checkpoint section, then more work that a
# failed round loses; rank 1 hangs in attempt 0 (a call that blocks the interpreter: no automatic beats).
HANG_THEN_RECOMPUTE = r'''
import os, sys, time
from nvrx.monitors import RankMonitorClient
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
c = RankMonitorClient()
c.init_workload_monitoring()

def work(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))

work(1.0)
c.start_section("checkpointing")
work(0.2)
c.end_section("checkpointing")
work(1.5)                       # after the checkpoint: redone if the round fails
if attempt == 0 and rank == 1:
    time.sleep(1000)            # the hang
c.shutdown_workload_monitoring()
'''


def test_a_hang_and_its_recompute_make_goodput_lower_than_uptime(launcher, tmp_path):
    script = write_script(tmp_path / "train.py", HANG_THEN_RECOMPUTE)
    res = launcher.run("--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "gp",
                       "--ft-param-auto-heartbeat", "true", "--ft-param-rank-heartbeat-timeout", "1.5",
                       "--ft-param-workload-check-interval", "0.2", str(script), timeout=120)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "nvrx_logs" / "gp"
    out = inspect("--json", str(run))
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["corrupt"]["count"] == 0 and rep["unknown_events"] == {}
    (fault,) = rep["faults"]
    assert fault["hang"]["reason"] == "heartbeat_timeout" and fault["rank"] == 1
    # one channel for a hang's cause: the monitor's event, copied by the agent into the stop; no side file
    (hang,) = [e for e in run_events(run, "monitor-") if e["ev"] == "hang_detected"]
    assert {k: fault["hang"][k] for k in ("pid", "reason", "elapsed", "timeout")} == \
        {k: hang[k] for k in ("pid", "reason", "elapsed", "timeout")} and fault["hang"]["t"] == hang["t"]
    assert list(run.rglob("*last_hang*")) == []
    assert "by its monitor: heartbeat timeout" in res.stderr  # the agent's failure report names the cause
    assert rep["goodput_source"] == "automatic heartbeats"
    acct = rep["time_accounting"]
    assert acct["recomputed_s"] > 0                    # round 0's work after its checkpoint is done again
    assert 0 < rep["goodput"] < rep["uptime"] <= 1
    assert acct["kept_s"] < acct["uptime_s"]
    text = inspect(str(run)).stdout
    assert f"uptime {rep['uptime'] * 100:.1f} %" in text
    assert f"goodput {rep['goodput'] * 100:.1f} % (from automatic heartbeats)" in text
    ranks = text[text.index("\nRanks\n"):]
    assert " auto " in ranks                           # the heartbeats column under --ft-param-auto-heartbeat
    assert launcher.leftovers() == []


# Rank 0 ignores SIGTERM; rank 1 fails once rank 0 is ready, so the agent stops rank 0 and must SIGKILL it.
IGNORES_SIGTERM = r'''
import os, signal, sys, time
rank, ready = int(os.environ["RANK"]), os.path.join(sys.argv[1], "ready")
if rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(ready, "w").close()
    while True:
        time.sleep(1)
deadline = time.monotonic() + 60
while not os.path.exists(ready) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3)
'''


def test_the_agent_killing_a_rank_that_ignores_sigterm_is_logged_and_shown(launcher, tmp_path):
    script = write_script(tmp_path / "stubborn.py", IGNORES_SIGTERM)
    res = launcher.run("--nproc-per-node", "2", "--max-restarts", "0", "--rdzv-id", "stubborn",
                       "--term-timeout", "1", str(script), str(tmp_path), timeout=120)
    assert res.returncode == 1, res.stderr
    assert "still running" in res.stderr and "sent SIGKILL" in res.stderr  # the terminal status line
    run = tmp_path / "nvrx_logs" / "stubborn"
    (kill,) = [e for e in run_events(run, "agent-") if e["ev"] == "agent_killed_rank"]
    assert (kill["rank"], kill["signal"], kill["after"]) == (0, "SIGKILL", "SIGTERM")
    assert kill["waited"] >= 1.0
    exits = [e for e in run_events(run, "agent-") if e["ev"] == "rank_exit" and e["rank"] == 0]
    assert exits and exits[0]["signal"] == "SIGKILL" and exits[0]["pid"] == kill["pid"]
    out = inspect(str(run))
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "the agent sent SIGKILL" in ln]
    assert "rank 0 (local 0" in line and "ignored SIGTERM while stopping round 0" in line
    rep = json.loads(inspect("--json", "--rank", "0", str(run)).stdout)
    assert [it["kind"] for it in rep["timeline"]].count("agent_killed_rank") == 1
    assert launcher.leftovers() == []
