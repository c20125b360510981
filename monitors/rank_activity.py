"""Is a silent rank busy or stuck? Its main thread's scheduler state and CPU time, from /proc.

The automatic heartbeat timeout is tight, so before it declares a hang the monitor looks at what the rank's
main thread did since its last beat: stopped (SIGSTOP, a tracer) or asleep without using the CPU means stuck
(a hung collective waits asleep); running, in uninterruptible disk wait, or asleep after having used the CPU
for most of the gap means busy (a long save, a garbage collection, a slow step), which only the configured
timeout may end. A GPU job whose main thread spins while it waits for a hung kernel looks busy here: it is
then caught by the configured timeout, as without the automatic one.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

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
    cpu_fraction: float | None   # of the gap since the last liveness mark (None: no sample from then)


class ActivityWatch:
    """Recent samples of one rank's main thread, taken at the monitor's wake-ups."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: deque[ThreadSample] = deque(maxlen=_SAMPLES)

    def sample(self, now: float) -> None:
        s = sample_main_thread(self.pid, now)
        if s is not None:
            self.samples.append(s)

    def judge(self, since: float, now: float) -> Verdict:
        """Busy or stuck since SINCE (the last liveness mark)? See the module docstring."""
        cur = sample_main_thread(self.pid, now)
        if cur is None:
            return Verdict(False, "gone", None)
        if cur.state in ("T", "t", "Z", "X"):
            return Verdict(False, cur.state, None)
        ref = next((s for s in reversed(self.samples) if s.t <= since), self.samples[0] if self.samples else None)
        fraction = None
        if ref is not None and now - ref.t > 0:
            fraction = round(max(0.0, cur.cpu - ref.cpu) / (now - ref.t), 3)
        busy = cur.state in ("R", "D") or (fraction is not None and fraction >= BUSY_FRACTION)
        self.samples.append(cur)
        return Verdict(busy, cur.state, fraction)
