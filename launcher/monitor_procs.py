"""The agent's side of rank monitoring: one monitor process per local rank, started once.

Monitors outlive rank restarts. Each gets a secret token (in its environment, never argv), a
private 0700 directory for its control socket and heartbeat slot, and this node's state dir for
learned timeouts and the reason of its last kill (which the agent reads to explain a failure).
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
from pathlib import Path
from typing import Any

from monitors.client import ENV_AUTO_HEARTBEAT, ENV_SHM, ENV_SOCKET, ENV_TOKEN
from monitors.events import EventLog
from monitors.heartbeat import Slot, SlotError
from monitors.progress_watchdog import watchdog_interval
from monitors.timeouts import last_hang_file

log = logging.getLogger(__name__)

TOKEN_ENV = ENV_TOKEN  # the monitor reads its token from here too (never argv)


class MonitorGroup:
    """Starts, watches (pidfds), restarts and stops the rank monitors of one node."""

    def __init__(self, ft: Any, nproc: int, run_log_dir: Path, events: EventLog, base_env: dict[str, str],
                 state_dir: Path, node_name: str) -> None:
        self.ft = ft
        self.nproc = nproc
        self.events = events
        self.base_env = dict(base_env)
        self.state_dir = state_dir  # this node's: learned timeouts survive jobs when it is kept across them
        self.events_dir = run_log_dir
        self.node = f"{node_name}-{os.getpid()}"
        self.private = Path(tempfile.mkdtemp(prefix="nvrx-mon-"))  # 0700 by mkdtemp
        self.tokens = [secrets.token_hex(16) for _ in range(nproc)]
        self.procs: list[subprocess.Popen | None] = [None] * nproc
        self.pidfds: dict[int, int] = {}  # pidfd -> local rank
        self.started = False

    def paths(self, local_rank: int) -> tuple[Path, Path]:
        return self.private / f"rank{local_rank}.sock", self.private / f"rank{local_rank}.slot"

    def start(self) -> None:
        self.started = True
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.events_dir.mkdir(parents=True, exist_ok=True)
        for lr in range(self.nproc):
            self._start_one(lr)

    def _start_one(self, lr: int) -> None:
        sock, shm = self.paths(lr)
        env = dict(self.base_env, **{TOKEN_ENV: self.tokens[lr]})
        cmd = [sys.executable, "-m", "monitors.rank_monitor", "--rank", str(lr), "--state-dir", str(self.state_dir),
               "--socket", str(sock), "--shm", str(shm), "--token-env", TOKEN_ENV,
               "--config-json", json.dumps(self.ft.to_dict()), "--parent-pid", str(os.getpid()),
               "--events", str(self.events_dir / f"monitor-{self.node}-{lr}.jsonl")]
        logfile = self.events_dir / f"monitor-{self.node}-{lr}.log"  # the monitor's own log, off the terminal
        with open(logfile, "ab") as err:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    start_new_session=True)
        self.procs[lr] = proc
        self.pidfds[os.pidfd_open(proc.pid)] = lr
        self.events.emit("monitor_spawned", local_rank=lr, pid=proc.pid)

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """What the rank's RankMonitorClient needs to find its monitor."""
        sock, shm = self.paths(local_rank)
        env = {ENV_SOCKET: str(sock), ENV_SHM: str(shm), ENV_TOKEN: self.tokens[local_rank]}
        if self.ft.auto_heartbeat:
            env[ENV_AUTO_HEARTBEAT] = f"{watchdog_interval(self.ft.rank_heartbeat_timeout):g}"
        return env

    def fds(self) -> list[int]:
        return list(self.pidfds)

    def restart_dead(self) -> list[int]:
        """Restart every monitor that exited; returns their local ranks."""
        restarted = []
        for fd, lr in list(self.pidfds.items()):
            proc = self.procs[lr]
            if proc is None or proc.poll() is None:
                continue
            os.close(fd)
            del self.pidfds[fd]
            self.events.emit("monitor_died", local_rank=lr, pid=proc.pid, returncode=proc.returncode)
            log.warning("rank monitor %d (pid %d) exited with %s; restarting it", lr, proc.pid, proc.returncode)
            self._start_one(lr)
            restarted.append(lr)
        return restarted

    def last_progress(self) -> dict[int, float]:
        """Each local rank's last heartbeat, manual or automatic (monotonic time), peeked from its slot.

        When one rank hangs, its peers soon block in a collective waiting for it and stop beating too;
        comparing last beats tells which rank stalled first.
        """
        found: dict[int, float] = {}
        for lr in range(self.nproc):
            try:
                slot = Slot.attach(self.paths(lr)[1])
            except SlotError:
                continue
            try:
                snap = slot.snapshot()
            except SlotError:
                continue
            finally:
                slot.close()
            last = max(snap.last_hb, snap.auto_hb)
            if last > 0 and not snap.open_mask:  # a rank inside a section is not stalled, it is busy
                found[lr] = last
        return found

    def hang_reason(self, local_rank: int, pid: int) -> dict[str, Any] | None:
        """Why the monitor killed this rank process, if it did."""
        try:
            info = json.loads(last_hang_file(self.state_dir, local_rank).read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("pid") == pid else None

    def close(self, timeout: float = 5.0) -> None:
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
                    self.events.emit("monitor_stuck", pid=proc.pid)
        for fd in self.pidfds:
            os.close(fd)
        self.pidfds.clear()
        shutil.rmtree(self.private, ignore_errors=True)
