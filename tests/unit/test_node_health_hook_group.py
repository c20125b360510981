"""The node health hook's process group is killed while its leader is unreaped (code review, issue 27).

`killpg(pid)` after the hook's leader was reaped could signal a recycled process group: another program that got
the same pid. The leader must be alive or a zombie (our unreaped child) at every killpg. Real processes; os.killpg
is wrapped only to look at the leader at the moment of each call.
"""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from nvrx.launcher.agent import node_health


def _leader(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of PID, or None when it no longer exists (reaped: its pid may be anyone's now)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1])
    except OSError:
        return None


@pytest.fixture
def killpg_calls(monkeypatch):
    calls: list[tuple[int, tuple[str, int] | None]] = []
    real = os.killpg

    def spy(pgid: int, sig: int) -> None:
        calls.append((pgid, _leader(pgid)))
        real(pgid, sig)

    monkeypatch.setattr(node_health.os, "killpg", spy)
    return calls


def test_hook_that_passes(killpg_calls):
    code, out = node_health._run([sys.executable, "-c", "print('healthy')"], 30)
    assert (code, out) == (0, "healthy")
    assert killpg_calls, "the group is still swept after a passing hook"
    assert all(leader is not None and leader[1] == os.getpid() for _, leader in killpg_calls), killpg_calls


def test_hook_that_hangs_is_killed_with_its_group(killpg_calls, tmp_path):
    marker = tmp_path / "child.pid"
    script = f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(300)"
    with pytest.raises(TimeoutError):
        node_health._run([sys.executable, "-c", script], 3)
    assert killpg_calls and all(leader is not None and leader[1] == os.getpid() for _, leader in killpg_calls)
    child = int(marker.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
