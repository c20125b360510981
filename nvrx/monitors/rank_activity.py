"""Is a silent rank busy or stuck? Its main thread's scheduler state and CPU time, from /proc, and its local peers.

The automatic heartbeat timeout is tight, so before it declares a hang the monitor looks at what the rank's
main thread did since its last beat (or its last look):

* stopped (SIGSTOP, a tracer) or gone: hung;
* runnable or running (``R``: on a loaded machine it may just not get a CPU), in disk wait (``D``), or asleep
  after using the CPU for at least half of the time: busy (a long save, a garbage collection, a slow step);
* asleep without CPU: it waits. For a peer in a collective (another rank's save, or a peer without a CPU)
  when some other rank of the node is busy or beat recently (the node's other slots, next to its own):
  busy; else hung (a hung collective, a rank waiting for a stopped one).

Busy means "not yet": the monitor looks again one automatic timeout later, and the configured timeout stays
the absolute bound. Limits: peers on other nodes are not seen (a rank waiting idle only for a remote rank's
long pause is judged hung), and a GPU job whose main thread spins while it waits for a hung kernel looks
busy: then the configured timeout catches it, as without the automatic one.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Callable
from dataclasses import dataclass
from pathlib import Path

from nvrx.monitors.heartbeat import read_slot

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BUSY_FRACTION = 0.5   # of the gap, spent on the CPU by the main thread
_SAMPLES = 16


@dataclass(frozen=True)
class ThreadSample:
    t: float          # monotonic time of the sample
    state: str        # R, S, D, T, t, Z, ...
    cpu: float        # seconds of CPU (user + system) used by the thread so far


def sample_main_thread(pid: int, now: float) -> ThreadSample | None:
    """The main thread of PID (its tid is the pid), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[-1].split()  # after "pid (comm)": state is field 3, utime/stime 14/15
    try:
        return ThreadSample(now, fields[0].decode(), (int(fields[11]) + int(fields[12])) / _TICK)
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Verdict:
    busy: bool
    state: str
    cpu_fraction: float | None   # of the time looked at (None: no sample from then)
    why: str                     # in words


def busy_peer(own_slot: Path, now: float, recent: float) -> str | None:
    """A local peer rank that is busy or beat within RECENT seconds (read from the slots next to OWN_SLOT)."""
    for path in sorted(own_slot.parent.glob("*.slot")):
        if path == own_slot:
            continue
        snap = read_slot(path)
        if snap is None:
            continue
        mark = max(snap.last_hb, snap.auto_hb, snap.last_section_end)
        if snap.hb_count or snap.auto_hb:
            if now - mark < recent:
                return f"{path.stem} beat {now - mark:.3f} s ago"
            peer = sample_main_thread(snap.pid, now) if snap.pid else None
            if peer is not None and peer.state in ("R", "D"):
                return f"{path.stem} (pid {snap.pid}) is {'running' if peer.state == 'R' else 'in disk wait'}"
    return None


_PF_EXITING = 0x4  # the kernel's task flag: the process is being torn down (e.g. a SIGKILL woke it from a stop)


def _exiting(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return bool(int(fh.read().rsplit(b")", 1)[-1].split()[6]) & _PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True


def stopped_peer(own_slot: Path) -> str | None:
    """A local peer rank that is stopped (SIGSTOP, a tracer) or has just ended (killed by its monitor, crashed): the
    rank a silent one may be waiting for in a collective."""
    for path in sorted(own_slot.parent.glob("*.slot")):
        if path == own_slot:
            continue
        snap = read_slot(path)
        if snap is None or not snap.pid:
            continue
        peer = sample_main_thread(snap.pid, 0.0)
        if peer is None or peer.state in ("Z", "X") or _exiting(snap.pid):
            return f"{path.stem} (pid {snap.pid}) has ended"
        if peer.state in ("T", "t"):
            return f"{path.stem} (pid {snap.pid}) is stopped"
    return None


class ActivityWatch:
    """Recent samples of one rank's main thread, taken at the monitor's wake-ups."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: deque[ThreadSample] = deque(maxlen=_SAMPLES)

    def sample(self, now: float) -> None:
        s = sample_main_thread(self.pid, now)
        if s is not None:
            self.samples.append(s)

    def judge(self, since: float, now: float, peers: Callable[[], str | None] = lambda: None) -> Verdict:
        """Busy or stuck since SINCE (the last liveness mark, or the last look)? See the module docstring."""
        cur = sample_main_thread(self.pid, now)
        if cur is None:
            return Verdict(False, "gone", None, "the process is gone")
        if cur.state in ("T", "t", "Z", "X"):
            return Verdict(False, cur.state, None, "stopped" if cur.state in ("T", "t") else "exited")
        ref = next((s for s in reversed(self.samples) if s.t <= since), self.samples[0] if self.samples else None)
        fraction = None
        if ref is not None and now - ref.t > 0:
            fraction = round(max(0.0, cur.cpu - ref.cpu) / (now - ref.t), 3)
        self.samples.append(cur)
        if cur.state in ("R", "D"):
            return Verdict(True, cur.state, fraction, "runnable" if cur.state == "R" else "in disk wait")
        if fraction is not None and fraction >= BUSY_FRACTION:
            return Verdict(True, cur.state, fraction, f"on the CPU {fraction:g} of the time")
        peer = peers()
        if peer is not None:
            return Verdict(True, cur.state, fraction, f"waiting while a local peer works: {peer}")
        return Verdict(False, cur.state, fraction, "asleep, no local peer working")
