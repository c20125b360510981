"""The automatic heartbeat timeout end to end: a real rank monitor process and real rank processes.

A rank with a steady period gets a tight timeout after warm-up and a SIGSTOP is caught by it (reason
``auto_heartbeat_timeout``); a busy slow step, a slower phase, a checkpoint section and the restore phase of
a restarted rank are not taken for hangs; ``nvrx inspect`` shows the timeout and where it came from.
"""

from __future__ import annotations

import os
import subprocess
import signal
from pathlib import Path

import pytest

from nvrx.monitors.heartbeat import gap_bucket, gap_bucket_upper
from nvrx.inspection.run_report import build_report
from nvrx.nvrx_cli.inspect_cmd import render_text
from tests.integration.test_rank_monitor import Harness


# A scripted rank: each argv item is one action.
RANK_SCRIPT = r'''
import sys, time
from nvrx.monitors.client import RankMonitorClient

c = RankMonitorClient()
for action in sys.argv[1:]:
    name, _, arg = action.partition(":")
    if name == "init":
        c.init_workload_monitoring()
    elif name == "hb":             # N beats, one every DT seconds (asleep in between)
        n, _, dt = arg.partition("@")
        for _ in range(int(n)):
            c.send_heartbeat()
            time.sleep(float(dt))
    elif name == "busy":           # N steps of DT seconds on the CPU, a beat after each (a slow step, a save)
        n, _, dt = arg.partition("@")
        for _ in range(int(n)):
            end = time.monotonic() + float(dt)
            while time.monotonic() < end:
                pass
            c.send_heartbeat()
    elif name == "sleep":
        time.sleep(float(arg))
    elif name == "start":
        c.start_section(arg)
    elif name == "end":
        c.end_section(arg)
    elif name == "shutdown":
        c.shutdown_workload_monitoring()
'''

AUTO = dict(initial_rank_heartbeat_timeout=30.0, rank_heartbeat_timeout=30.0, workload_check_interval=1.0,
            heartbeat_timeout_auto="set", heartbeat_timeout_auto_multiple=4.0, heartbeat_timeout_auto_min=0.2,
            heartbeat_timeout_auto_warmup_beats=20, heartbeat_timeout_auto_warmup_seconds=2.0,
            heartbeat_timeout_auto_settle_seconds=0.5)


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    harness.script.write_text(RANK_SCRIPT)
    harness.events_path = tmp_path / "monitor-node1-0.jsonl"  # named as under nvrx launch: nvrx inspect reads it
    yield harness
    left = harness.cleanup()
    assert not left, f"orphaned processes: {left}"


def _bound(event: dict) -> float:
    """What the monitor must have chosen from the figures it reports."""
    return round(max(event["floor"], event["multiple"] * event["basis"]), 6)


def test_steady_rank_gets_tight_timeout_and_sigstop_is_caught_by_it(h: Harness) -> None:
    h.start_monitor(**AUTO)
    rank = h.rank("init", "hb:100000@0.1")
    h.wait_for(lambda: h.events("heartbeat_timeout_auto"), 30, "the automatic timeout")
    auto = h.events("heartbeat_timeout_auto")[0]
    assert auto["mode"] == "set" and auto["reason"] == "warm-up done" and auto.get("previous") is None
    assert auto["gaps"] >= 20 and auto["observed_s"] >= 2.0
    # every gap was a 0.1 s sleep or more: the longest is at least that, the median too
    assert auto["longest_gap"] >= 0.1 and auto["p50"] >= 0.1
    assert auto["timeout"] == _bound(auto) and auto["timeout"] < auto["configured"] == 30.0
    os.kill(rank.pid, signal.SIGSTOP)
    rc, _, err = h.finish(rank, timeout=30)
    assert rc == -signal.SIGKILL, err
    hang = h.last_hang()
    assert hang["pid"] == rank.pid and hang["reason"] == "auto_heartbeat_timeout"
    last = h.events("heartbeat_timeout_auto")[-1]  # widened meanwhile perhaps, never narrowed
    assert hang["timeout"] == last["timeout"] >= auto["timeout"]
    assert hang["elapsed"] >= hang["timeout"]
    assert not h.events("heartbeat_timeout_auto_deferred")  # a stopped rank is never taken for a busy one

    h.stop_monitor()
    text = render_text(build_report([h.tmp]))
    assert "automatic heartbeat timeout set to" in text
    assert f"automatic timeout {hang['timeout']:g} s" in text  # the hang, with the timeout that caught it
    assert f"hb {hang['timeout']:g} set" in text                # the timeouts table's automatic column


def test_busy_slow_steps_a_checkpoint_section_and_a_slower_phase_are_not_hangs(h: Harness) -> None:
    h.start_monitor(rank_section_timeouts={"checkpointing": 30.0}, **AUTO)
    rank = h.rank("init", "hb:40@0.1",            # warm-up: tight timeout ~0.4-0.5 s
                  "busy:1@1.5",                   # a 1.5 s save on the CPU without a beat
                  "hb:10@0.1",
                  "start:checkpointing", "sleep:1.5", "end:checkpointing",  # an idle save, in a timed section
                  "hb:10@0.1",
                  "busy:5@0.6",                   # a slower phase of CPU-bound steps
                  "hb:5@0.8",                     # ... then idle ones just as slow: within the widened bound
                  "shutdown")
    h.wait_for(lambda: h.events("heartbeat_timeout_auto"), 30, "the automatic timeout")
    tight = h.events("heartbeat_timeout_auto")[0]["timeout"]
    assert tight < 1.5 / 2  # the busy gaps below are well beyond it
    rc, _, err = h.finish(rank, timeout=60)
    assert rc == 0, err
    assert not h.events("hang_detected")
    deferred = h.events("heartbeat_timeout_auto_deferred")
    assert deferred, "the busy 1.5 s step passed the tight timeout without being judged"
    assert all(d["timeout"] >= tight and d["fallback"] == 30.0 for d in deferred)
    assert all(d["state"] == "R" or (d["cpu_fraction"] or 0) >= 0.5 for d in deferred)
    widened = [e for e in h.events("heartbeat_timeout_auto") if e["reason"] == "longer gap observed"]
    assert widened and widened[-1]["longest_gap"] >= 0.6
    assert widened[-1]["timeout"] == _bound(widened[-1]) >= 4 * 0.6


def test_restarted_rank_settles_before_the_tight_timeout_applies(h: Harness) -> None:
    h.start_monitor(**{**AUTO, "heartbeat_timeout_auto_settle_seconds": 3.0})
    first = h.rank("init", "hb:100000@0.1")
    h.wait_for(lambda: h.events("heartbeat_timeout_auto"), 30, "the automatic timeout")
    tight = h.events("heartbeat_timeout_auto")[0]["timeout"]
    first.kill()
    h.finish(first)
    # the next run of the rank: a restore phase (process group, checkpoint load) far longer than the tight
    # timeout, idle, right after its first beats; then steady steps
    second = h.rank("init", "hb:3@0.1", "sleep:1.5", "hb:30@0.1", "shutdown")
    rc, _, err = h.finish(second, timeout=60)
    assert rc == 0, err
    assert 1.5 > 2 * tight
    assert not h.events("hang_detected")
    assert [e["reason"] for e in h.events("heartbeat_timeout_auto")].count("warm-up done") == 1  # learned once


def test_suggest_mode_reports_but_enforces_the_configured_timeout(h: Harness) -> None:
    h.start_monitor(**{**AUTO, "heartbeat_timeout_auto": "suggest", "rank_heartbeat_timeout": 2.0})
    rank = h.rank("init", "hb:100000@0.1")
    h.wait_for(lambda: h.events("heartbeat_timeout_auto"), 30, "the suggested timeout")
    auto = h.events("heartbeat_timeout_auto")[0]
    assert auto["mode"] == "suggest" and auto["timeout"] == _bound(auto) < 2.0
    os.kill(rank.pid, signal.SIGSTOP)
    rc, _, err = h.finish(rank, timeout=30)
    assert rc == -signal.SIGKILL, err
    hang = h.last_hang()
    assert hang["reason"] == "heartbeat_timeout" and hang["timeout"] == 2.0


def test_gap_buckets_bound_the_gaps_they_hold() -> None:
    for gap in (1e-5, 0.0123, 0.1, 0.5, 7.0, 99.0):
        b = gap_bucket(gap)
        assert gap <= gap_bucket_upper(b) <= max(gap, 1e-4) * 2 ** (1 / 8) * 1.0001
        assert b == 0 or gap_bucket_upper(b - 1) <= gap


def test_idle_rank_waiting_while_a_local_peer_works_is_not_a_hang(h: Harness) -> None:
    """Rank 0 waits asleep (as in a collective) while rank 1 of the same node saves on the CPU: not a hang."""
    h.start_monitor(**AUTO)
    events1 = h.tmp / "monitor-node1-1.jsonl"
    sock1, shm1 = h.run_dir / "rank1.sock", h.run_dir / "rank1.slot"
    cmd = h.monitor_cmd(**AUTO)
    cmd[cmd.index("--rank") + 1] = "1"
    cmd[cmd.index("--socket") + 1] = str(sock1)
    cmd[cmd.index("--shm") + 1] = str(shm1)
    cmd[cmd.index("--events") + 1] = str(events1)
    monitor1 = subprocess.Popen(cmd, env=h.env(), cwd=h.tmp, stderr=subprocess.PIPE, text=True)
    h.procs.append(monitor1)
    h.wait_for(sock1.exists, 10, "the second monitor's socket")
    waiting = h.rank("init", "hb:40@0.1", "sleep:1.5", "hb:10@0.1", "shutdown")
    saving = h.rank("init", "hb:40@0.1", "busy:1@1.5", "hb:10@0.1", "shutdown",
                    NVRX_MONITOR_SOCKET=str(sock1), NVRX_MONITOR_SHM=str(shm1))
    for proc in (waiting, saving):
        rc, _, err = h.finish(proc, timeout=60)
        assert rc == 0, err
    assert not h.events("hang_detected")
    deferred = h.events("heartbeat_timeout_auto_deferred")
    assert deferred and "local peer works" in deferred[0]["why"] and deferred[0]["state"] == "S"
    monitor1.send_signal(signal.SIGTERM)
    monitor1.wait(10)
