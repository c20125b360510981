"""RankMonitorGroup's restart policy for dead rank monitors: backoff, then give up (no real processes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nvrx.launcher.agent.rank_monitors import MAX_RESTARTS, RESTART_DELAYS, RESTART_WINDOW, RankMonitorGroup
from nvrx.events import EventLog


class _DeadProc:
    pid = 4242
    returncode = 1

    def poll(self) -> int:
        return self.returncode


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    events: list[dict[str, Any]] = []
    log = EventLog(None, "agent")  # in memory
    log.subscribe(events.append)
    g = RankMonitorGroup(ft=None, nproc=1, run_log_dir=tmp_path, events=log, base_env={},
                     state_dir=tmp_path / "state", node_name="n0")
    started: list[int] = []
    monkeypatch.setattr(g, "_start_one", lambda lr: started.append(lr))
    yield g, events, started
    assert not g.private.exists()  # the monitors make their private dir; no monitor ran here


def _die(g: RankMonitorGroup, now: float) -> list[int]:
    """Report monitor 0 dead at NOW (as if its pidfd fired) and let the group react."""
    g.procs[0] = _DeadProc()  # type: ignore[assignment]
    g.pidfds[os.open(os.devnull, os.O_RDONLY)] = 0  # stands in for the pidfd; restart_dead closes it
    return g.restart_dead(now)


def test_restarts_back_off_then_give_up(group, tmp_path):
    g, events, started = group
    g.log_file(0).write_text("starting\nboom: bad things\n")
    now = 100.0
    for n in range(MAX_RESTARTS):
        assert _die(g, now) == ([0] if RESTART_DELAYS[n] == 0 else [])
        if RESTART_DELAYS[n]:
            assert g.wake_in(now) == pytest.approx(RESTART_DELAYS[n])
            assert g.restart_dead(now + RESTART_DELAYS[n]) == [0]
        assert g.wake_in(now) is None
        now += RESTART_DELAYS[n] + 0.1
    assert g.failure is None
    assert _die(g, now) == []  # one death too many within the window
    assert g.failure is not None and g.failure["local_rank"] == 0
    assert f"died {MAX_RESTARTS + 1} times" in g.failure["describe"] and "boom: bad things" in g.failure["describe"]
    assert "monitor_gave_up" in [e["ev"] for e in events]
    assert len(started) == MAX_RESTARTS


def test_deaths_outside_the_window_are_forgotten(group):
    g, _, started = group
    now = 0.0
    for _ in range(3 * MAX_RESTARTS):
        _die(g, now)
        g.restart_dead(now + max(RESTART_DELAYS))
        now += RESTART_WINDOW / 2  # at most two deaths per window
    assert g.failure is None and len(started) == 3 * MAX_RESTARTS
