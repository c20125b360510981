"""The agent's side of rank monitoring: one monitor process per local rank, started once.

Monitors outlive rank restarts. Each gets a secret token (in its environment, never argv), a
private 0700 directory for its control socket and heartbeat slot, an event file (whose
``hang_detected`` events the agent reads back to explain a rank it killed), and the job's shared
timeouts dir, where learned timeouts are kept per global rank (so a continuation job of an
auto-resume chain finds them even when it runs on other nodes).

A monitor that dies is restarted, with a growing delay (:data:`RESTART_DELAYS`); one that dies more
than :data:`MAX_RESTARTS` times within :data:`RESTART_WINDOW` seconds is broken (a bad environment,
a bug), and restarting it forever would leave its rank unwatched while the job looks healthy, so
the group gives up and the agent fails the job with the monitor's last words.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nvrx.common.process import python_module_command
from nvrx.monitors.client import ENV_AUTO_HEARTBEAT, ENV_SHM, ENV_SOCKET, ENV_TOKEN
from nvrx.events import (EventLog, HangDetected, MonitorAttach, MonitorConnect, MonitorDied, MonitorGaveUp,
                             MonitorSpawned, MonitorStuck, RankTiming, last_event)
from nvrx.monitors.heartbeat import read_slot
from nvrx.monitors.progress_watchdog import watchdog_interval
from nvrx.common.files import open_private, private_dir

log = logging.getLogger(__name__)

TOKEN_ENV = ENV_TOKEN  # the monitor reads its token from here too (never argv)
MAX_RESTARTS = 5  # restarts of one monitor allowed within RESTART_WINDOW before the job fails
RESTART_WINDOW = 60.0  # seconds
RESTART_DELAYS = (0.0, 0.5, 1.0, 2.0, 4.0)  # delay before the n-th restart within the window (then the last)
TIMEOUTS_SUBDIR = "timeouts"  # under the state dir: <state_dir>/timeouts/rank<GLOBAL>.timeouts.json


@dataclass
class _Restarts:
    """One monitor's recent deaths and its pending restart."""

    deaths: deque[float] = field(default_factory=deque)
    due: float | None = None  # monotonic time of the scheduled restart


class RankMonitorGroup:
    """Starts, watches (pidfds), restarts and stops the rank monitors of one node."""

    def __init__(self, ft: Any, nproc: int, run_log_dir: Path, events: EventLog, base_env: dict[str, str],
                 state_dir: Path, node_name: str, term_grace: float = 5.0) -> None:
        self.ft = ft
        self.nproc = nproc
        self.events = events
        self.base_env = dict(base_env)
        self.timeouts_dir = Path(state_dir) / TIMEOUTS_SUBDIR  # job-wide, by global rank: survives node changes
        self.state_dir = Path(state_dir) / node_name  # this node's (the monitors' --state-dir)
        self.term_grace = term_grace  # a hung rank ignoring a non-SIGKILL termination signal is killed after this
        self.events_dir = run_log_dir
        self.node = f"{node_name}-{os.getpid()}"
        # Named here (the ranks' environment needs it), made 0700 by the monitors themselves: an agent killed
        # before it started them leaves nothing behind, and after that the last monitor out removes it.
        # The name is unguessable, and a monitor refuses a directory another user made (ensure_private_dir).
        self.private = Path(tempfile.gettempdir()) / f"nvrx-mon-{secrets.token_hex(8)}"
        self.tokens = [secrets.token_hex(16) for _ in range(nproc)]
        self.procs: list[subprocess.Popen | None] = [None] * nproc
        self.pidfds: dict[int, int] = {}  # pidfd -> local rank
        self.restarts = [_Restarts() for _ in range(nproc)]
        self.failure: dict[str, Any] | None = None  # set once a monitor keeps dying: the job must fail
        self.started = False
        # Workload control requests of the ranks (spec 001), one JSON line per request, monitors -> agent.
        self._ctl_r, self._ctl_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._ctl_r, False)
        self._ctl_buf = b""

    def paths(self, local_rank: int) -> tuple[Path, Path]:
        return self.private / f"rank{local_rank}.sock", self.private / f"rank{local_rank}.slot"

    def start(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Start one monitor per local rank; STOP (the agent got a signal) ends it early (each start is a
        process spawn: ~0.1 s on a loaded node, so hundreds of them would hold up a SIGTERM)."""
        self.started = True
        private_dir(self.state_dir)
        private_dir(self.events_dir)
        for lr in range(self.nproc):
            if stop():
                break
            self._start_one(lr)

    def _start_one(self, lr: int) -> None:
        sock, shm = self.paths(lr)
        env = dict(self.base_env, **{TOKEN_ENV: self.tokens[lr]})
        cmd = [*python_module_command(sys.executable, "nvrx.monitors.rank_monitor"), "--rank", str(lr), "--state-dir", str(self.state_dir),
               "--timeouts-dir", str(self.timeouts_dir), "--term-grace", f"{self.term_grace:g}",
               "--socket", str(sock), "--shm", str(shm), "--token-env", TOKEN_ENV,
               "--config-json", json.dumps(self.ft.to_dict()), "--parent-pid", str(os.getpid()),
               "--events", str(self.events_file(lr)), "--control-fd", str(self._ctl_w)]
        # the monitor's own log, off the terminal; private (0600) like every file of the run
        with open(open_private(self.log_file(lr), os.O_WRONLY | os.O_APPEND), "ab") as err:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    start_new_session=True, pass_fds=(self._ctl_w,))
        self.procs[lr] = proc
        self.pidfds[os.pidfd_open(proc.pid)] = lr
        self.events.emit(MonitorSpawned(local_rank=lr, pid=proc.pid))

    def events_file(self, local_rank: int) -> Path:
        return self.events_dir / f"monitor-{self.node}-{local_rank}.jsonl"

    def log_file(self, local_rank: int) -> Path:
        return self.events_dir / f"monitor-{self.node}-{local_rank}.log"

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """What the rank's RankMonitorClient needs to find its monitor."""
        sock, shm = self.paths(local_rank)
        env = {ENV_SOCKET: str(sock), ENV_SHM: str(shm), ENV_TOKEN: self.tokens[local_rank]}
        if self.ft.auto_heartbeat:
            auto_floor = self.ft.heartbeat_timeout_auto_min if self.ft.heartbeat_timeout_auto != "off" else None
            env[ENV_AUTO_HEARTBEAT] = f"{watchdog_interval(self.ft.rank_heartbeat_timeout, auto_floor):g}"
        return env

    def fds(self) -> list[int]:
        """What the agent waits on for its monitors: their pidfds and the workload control pipe."""
        return [*self.pidfds, self._ctl_r]

    def workload_requests(self) -> list[dict[str, Any]]:
        """The ranks' workload control requests that arrived since the last call (complete JSON lines only)."""
        while True:
            try:
                chunk = os.read(self._ctl_r, 65536)
            except OSError:  # BlockingIOError: nothing more for now
                break
            if not chunk:
                break
            self._ctl_buf += chunk
        *lines, self._ctl_buf = self._ctl_buf.split(b"\n")
        out = []
        for line in lines:
            try:
                req = json.loads(line)
            except ValueError:
                continue
            if isinstance(req, dict) and isinstance(req.get("local_rank"), int) and isinstance(req.get("action"), str):
                out.append(req)
        return out

    def latest_timing(self, local_rank: int, newer_than: float) -> dict[str, Any] | None:
        """The monitor's newest ``rank_timing`` summary written after NEWER_THAN (unix time), or None."""
        return last_event(self.events_file(local_rank), (RankTiming,), lambda e: e["t"] > newer_than, limit=1 << 16)

    def restart_dead(self, now: float | None = None) -> list[int]:
        """Notice monitors that exited and (re)start those whose restart is due; returns the restarted ranks.

        A monitor that died more than MAX_RESTARTS times within RESTART_WINDOW is not restarted again:
        :attr:`failure` says why, and the agent fails the job.
        """
        now = time.monotonic() if now is None else now
        for fd, lr in list(self.pidfds.items()):
            proc = self.procs[lr]
            if proc is None or proc.poll() is None:
                continue
            os.close(fd)
            del self.pidfds[fd]
            self._on_death(lr, proc, now)
        restarted = []
        for lr, r in enumerate(self.restarts):
            if r.due is not None and r.due <= now and self.failure is None:
                r.due = None
                self._start_one(lr)
                restarted.append(lr)
        return restarted

    def _on_death(self, lr: int, proc: subprocess.Popen, now: float) -> None:
        """Record a death; schedule the restart with backoff, or give up on a monitor that keeps dying."""
        r = self.restarts[lr]
        while r.deaths and now - r.deaths[0] > RESTART_WINDOW:
            r.deaths.popleft()
        r.deaths.append(now)
        self.events.emit(MonitorDied(local_rank=lr, pid=proc.pid, returncode=proc.returncode))
        if len(r.deaths) > MAX_RESTARTS:
            self._give_up(lr, proc, len(r.deaths))
            return
        delay = RESTART_DELAYS[min(len(r.deaths), len(RESTART_DELAYS)) - 1]
        r.due = now + delay
        log.warning("rank monitor %d (pid %d) exited with %s; restarting it%s", lr, proc.pid, proc.returncode,
                    f" in {delay:g} s" if delay else "")

    def _give_up(self, lr: int, proc: subprocess.Popen, deaths: int) -> None:
        last = _last_line(self.log_file(lr))
        reason = (f"the rank monitor of local rank {lr} died {deaths} times within {RESTART_WINDOW:g} s "
                  f"(last exit code {proc.returncode}{': ' + last if last else ''}); not restarting it, so the "
                  f"rank would run unwatched - see {self.log_file(lr)}")
        log.error("%s", reason)
        self.events.emit(MonitorGaveUp(local_rank=lr, pid=proc.pid, returncode=proc.returncode, deaths=deaths,
                                       window=RESTART_WINDOW, last_line=last, log=str(self.log_file(lr))))
        if self.failure is None:
            self.failure = {"local_rank": lr, "describe": reason, "returncode": proc.returncode}

    def wake_in(self, now: float | None = None) -> float | None:
        """Seconds until the next scheduled monitor restart (None: nothing scheduled)."""
        dues = [r.due for r in self.restarts if r.due is not None]
        if not dues or self.failure is not None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, min(dues) - now)

    def last_progress(self) -> dict[int, float]:
        """Each local rank's last heartbeat, manual or automatic (monotonic time), peeked from its slot.

        When one rank hangs, its peers soon block in a collective waiting for it and stop beating too;
        comparing last beats tells which rank stalled first.
        """
        found: dict[int, float] = {}
        for lr in range(self.nproc):
            snap = read_slot(self.paths(lr)[1])
            if snap is None:
                continue
            last = max(snap.last_hb, snap.auto_hb)
            if last > 0 and not snap.open_mask:  # a rank inside a section is not stalled, it is busy
                found[lr] = last
        return found

    def hang_reason(self, local_rank: int, pid: int) -> dict[str, Any] | None:
        """Why the monitor killed this rank process, if it did: its ``hang_detected`` event, with the event's time.

        The monitor's event is the one record of a hang's cause (it is written before the rank is signalled,
        so it is there by the time the rank's exit is seen); the agent copies it into the stop record. A
        session the monitor opened for PID after the hang (a reused pid) means the hang was not this process.
        """
        e = last_event(self.events_file(local_rank), (HangDetected, MonitorAttach, MonitorConnect),
                       lambda e: e.get(HangDetected.F.pid) == pid)
        if e is None or e["ev"] != HangDetected.EV:
            return None
        return {k: v for k, v in e.items() if k not in ("v", "src", "ev")}

    def close(self, timeout: float = 5.0) -> None:
        for r in self.restarts:
            r.due = None
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:  # stuck in the kernel: report, never wait forever
                    self.events.emit(MonitorStuck(pid=proc.pid))
        for fd in self.pidfds:
            os.close(fd)
        self.pidfds.clear()
        for fd in (self._ctl_r, self._ctl_w):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.private, ignore_errors=True)


def _last_line(path: Path, limit: int = 4096) -> str:
    """The last non-empty line of a (log) file, shortened; '' if there is none."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
