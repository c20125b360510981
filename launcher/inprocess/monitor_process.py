"""The monitor process: a small daemon per rank that keeps watch when the rank itself cannot.

It is started by the Wrapper as ``python -m launcher.inprocess.monitor_process`` and talks to it over
pipes in JSON lines (configuration in, ``ready`` out, then ``watch``/``stop`` commands in). It opens its
own connection to the store and every ``monitor_process_interval``:

* beats for its rank in the store, and watches the other ranks' beats: a rank silent for
  ``heartbeat_timeout`` (its node or both its processes are gone) is recorded as terminated and as a fault;
* notices at once when its rank's process ends (pidfd) and records it the same way;
* enforces the hard timeout: when the rank's main thread made no progress for ``hard_timeout`` it records
  the rank as terminated, then sends SIGCONT+SIGTERM, and after ``termination_grace_time``
  SIGCONT+SIGTERM+SIGKILL. A rank that holds the GIL cannot be rescued by its own threads; this is the
  only way out, and such a rank does not rejoin.

It logs only to ``monitor_process_logfile`` (nothing when that is not set) and exits with its rank.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("launcher.inprocess.monitor_process")

READY_TIMEOUT = 120.0  # importing torch on a loaded machine can take a while
_LAUNCHER_ROOT = str(Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------- the rank's side


class MonitorProcess:
    """Start, command and stop the monitor process of this rank."""

    def __init__(self, config: dict[str, Any], logfile: str | None) -> None:
        self.config = config
        self.logfile = logfile
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "MonitorProcess":
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_LAUNCHER_ROOT, env.get("PYTHONPATH")) if p)
        stderr: Any = subprocess.DEVNULL
        if self.logfile:
            stderr = open(self.logfile, "ab")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "launcher.inprocess.monitor_process"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, env=env, close_fds=True)
        finally:
            if stderr is not subprocess.DEVNULL:
                stderr.close()
        self.send(self.config)
        return self

    def send(self, message: dict[str, Any]) -> None:
        if self.proc is None or self.proc.stdin is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Block until the monitor process connected to the store; RuntimeError with its reason if it failed."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the in-process monitor process did not start within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the in-process monitor process exited during start-up "
                                       f"(code {self.proc.wait()}){self._see_log()}")
                reply = json.loads(line)
                if reply.get("ready"):
                    return
                raise RuntimeError(f"the in-process monitor process failed: {reply.get('error')}{self._see_log()}")

    def _see_log(self) -> str:
        return f"; see {self.logfile}" if self.logfile else ""

    def stop(self, timeout: float = 2.0) -> None:
        if self.proc is None:
            return
        self.send({"cmd": "stop"})
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


# ---------------------------------------------------------------- the monitor process itself


class _Monitor:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from launcher.inprocess.progress import read_progress  # noqa: F401  (imported before torch: fast failure)
        from launcher.inprocess.store import store_from_spec
        from monitors.heartbeat import Slot

        self.cfg = cfg
        self.rank = int(cfg["rank"])
        self.world_size = int(cfg["world_size"])
        self.pid = int(cfg["pid"])
        self.interval = float(cfg["interval"])
        self.heartbeat_timeout = float(cfg["heartbeat_timeout"])
        self.hard_timeout = float(cfg["hard_timeout"])
        self.grace = float(cfg["termination_grace_time"])
        self.pidfd = os.pidfd_open(self.pid)
        self.slot = Slot.attach(Path(cfg["slot"]))
        self.store = store_from_spec(cfg["store"])
        self.watching = False
        self.stopping = False
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last changed)

    def run(self, commands: "_Lines") -> int:
        self.store.heartbeat(self.rank)
        _reply({"ready": True})
        log.info("monitoring pid %d (interval %g s, heartbeat timeout %g s, hard timeout %g s)",
                 self.pid, self.interval, self.heartbeat_timeout, self.hard_timeout)
        next_tick = time.monotonic()
        for line in commands.pending():
            if self._command(json.loads(line)):
                return 0
        while True:
            wait = max(0.0, next_tick - time.monotonic())
            readable, _, _ = select.select([commands.fd, self.pidfd], [], [], wait)
            if self.pidfd in readable:
                return self._rank_ended()
            if commands.fd in readable:
                lines = commands.read()
                if lines is None:
                    return self._rank_ended_or_stopped()
                for line in lines:
                    if self._command(json.loads(line)):
                        return 0
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.interval
                if self._tick():
                    return 0

    def _command(self, msg: dict[str, Any]) -> bool:
        cmd = msg.get("cmd")
        if cmd == "stop":
            log.info("stopped by the rank")
            self.stopping = True
            return True
        if cmd == "watch":
            self.watching = True
            now = time.monotonic()
            self.seen = {r: (-1, now) for r in range(self.world_size) if r != self.rank}
        return False

    def _tick(self) -> bool:
        """One round of beating and watching; True when this process should end."""
        try:
            self.store.heartbeat(self.rank)
            if self._hard_timeout_expired():
                return True
            if self.watching:
                self._watch_peers()
        except Exception as exc:
            log.warning("store unreachable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False

    def _hard_timeout_expired(self) -> bool:
        from launcher.inprocess.progress import read_progress

        progress = read_progress(self.slot)
        if not progress.running:
            return False
        stalled = progress.stalled_for(time.monotonic())
        if stalled <= self.hard_timeout:
            return False
        reason = f"hard timeout: no progress for {stalled:.1f} s (hard_timeout={self.hard_timeout:g} s); terminated"
        log.error("%s", reason)
        self._record(self.rank, reason)
        self._terminate()
        return True

    def _terminate(self) -> None:
        """SIGCONT+SIGTERM, then after the grace time SIGCONT+SIGTERM+SIGKILL."""
        for sig in (signal.SIGCONT, signal.SIGTERM):
            _signal(self.pidfd, sig)
        if self._exited_within(self.grace):
            log.info("rank process ended after SIGTERM")
            return
        for sig in (signal.SIGCONT, signal.SIGTERM, signal.SIGKILL):
            _signal(self.pidfd, sig)
        self._exited_within(5.0)
        log.info("rank process killed")

    def _exited_within(self, seconds: float) -> bool:
        readable, _, _ = select.select([self.pidfd], [], [], max(0.0, seconds))
        return bool(readable)

    def _watch_peers(self) -> None:
        if self.store.is_done():
            self.watching = False
            return
        gone = self.store.terminated()
        peers = [r for r in self.seen if r not in gone]
        beats = self.store.heartbeats(peers)
        now = time.monotonic()
        for rank in peers:
            count = beats.get(rank, -1)
            last, since = self.seen[rank]
            if count != last:
                self.seen[rank] = (count, now)
            elif now - since > self.heartbeat_timeout:
                reason = f"heartbeat timeout: no heartbeat for {now - since:.1f} s (heartbeat_timeout={self.heartbeat_timeout:g} s)"
                log.error("rank %d: %s", rank, reason)
                self._record(rank, reason)
                del self.seen[rank]

    def _record(self, rank: int, reason: str) -> None:
        self.store.mark_terminated([rank], reason)
        self.store.record_fault(rank, -1, reason)

    def _rank_ended(self) -> int:
        if not self.stopping:
            try:
                gone = self.store.terminated()
                if self.rank not in gone and not self.store.is_done():
                    reason = "the rank's process ended"
                    log.error("%s", reason)
                    self._record(self.rank, reason)
            except Exception:
                log.warning("could not record the end of the rank's process", exc_info=True)
        return 0

    def _rank_ended_or_stopped(self) -> int:
        """The command pipe closed: a stop without the message, or the rank died (the pidfd tells)."""
        if self._exited_within(0.5):
            return self._rank_ended()
        log.info("command pipe closed; stopping")
        return 0


class _Lines:
    """JSON lines from a pipe, read with os.read (no hidden buffering between select() calls)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""

    def first(self) -> bytes | None:
        """Block for the first line (the configuration)."""
        while b"\n" not in self._buffer:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def pending(self) -> list[bytes]:
        return self._split()

    def read(self) -> list[bytes] | None:
        """Lines completed by one read; None at end of file."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self._buffer += chunk
        return self._split()

    def _split(self) -> list[bytes]:
        *lines, self._buffer = self._buffer.split(b"\n")
        return [line for line in lines if line.strip()]


def _signal(pidfd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except (ProcessLookupError, OSError):
        pass


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    commands = _Lines(sys.stdin.fileno())
    line = commands.first()
    if not line:
        return 0
    cfg = json.loads(line)
    from launcher.inprocess.log_setup import set_context, setup_file_logging

    setup_file_logging(cfg.get("logfile"))
    set_context(initial_rank=cfg.get("rank"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank; we end when it ends
    try:
        monitor = _Monitor(cfg)
    except Exception as exc:
        log.exception("start-up failed")
        _reply({"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__})
        return 1
    return monitor.run(commands)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)  # skip the interpreter teardown of torch (0.5 s+): nothing is left to flush
