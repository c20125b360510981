"""The in-process monitor process: a small daemon per rank that keeps watch when the rank itself cannot.

Not the rank monitor of ``nvrx launch`` (``nvrx/monitors/rank_monitor.py``): this one belongs to the in-process
restart Wrapper and lives only while a wrapped call runs.

The Wrapper starts it as a fresh interpreter (``python -P -m nvrx.launcher.rank.inprocess.monitor_process``),
never as a fork of the rank: a rank already runs threads when the Wrapper starts (``import torch`` starts one,
a data loader more), and a forked child inherits every lock such a thread held at that moment, with no thread
left to release it. A fresh interpreter holds no lock it did not take. The start costs an interpreter and an
``import torch`` (seconds), paid while the rank opens its store, before the initial barrier; the rank waits for
it only before that barrier, because the other ranks watch its heartbeats from then on.

It inherits only its two pipes and sends its output to ``monitor_process_logfile`` (or nowhere). It talks
to the rank only in JSON lines (``config`` first, then ``watch``/``rendezvous``/``stop`` in; ``ready`` or
``error`` out): nothing is pickled. It opens its own connection to the store and every
``monitor_process_interval``:

* beats for its rank in the store, and watches the other ranks' beats: a rank silent for
  ``heartbeat_timeout`` (its node or both its processes are gone) is recorded as terminated and as a fault;
* notices at once when its rank's process ends (pidfd) and records it the same way;
* enforces the hard timeout: when the rank's main thread made no progress for ``hard_timeout`` it records
  the rank as terminated, then sends SIGCONT+SIGTERM, and after ``termination_grace_time``
  SIGCONT+SIGTERM+SIGKILL. A rank that holds the GIL cannot be rescued by its own threads; this is the
  only way out, and such a rank does not rejoin. While the rank's monitor thread reports that the main
  thread waits in ``init_process_group`` for its peers (``rendezvous`` notes, sent only by a thread that
  can run, so the GIL is not held), the hard timeout counts from the last note. The hard timeout needs no
  store: a rank stuck because the store's host died is ended all the same.

It exits when its rank ends or tells it to stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from nvrx.common.errors import NvrxError
from nvrx.common.process import python_module_command
from nvrx.launcher.rank.inprocess.progress import SLOT_DIR_PREFIX
from nvrx.launcher.rank.inprocess.store import first_line
from nvrx.monitors.control import LineBuffer, MonitorProtocolError, encode

log = logging.getLogger("nvrx.launcher.rank.inprocess.monitor_process")

MODULE = "nvrx.launcher.rank.inprocess.monitor_process"
READY_TIMEOUT = 60.0  # a fresh interpreter importing torch on a loaded node


class MonitorNotReady(NvrxError, RuntimeError):
    """The monitor process did not report ready in time."""


_RESET_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")


# ---------------------------------------------------------------- the rank's side


class InprocessMonitorProcess:
    """Start, configure, command and stop the in-process monitor process of this rank (one per Wrapper call).

    ``start()`` launches the interpreter at once; ``configure()`` sends what it needs once the rank's store
    exists (the two overlap); ``wait_ready()`` waits until it is connected to the store and beating."""

    def __init__(self, logfile: str | None) -> None:
        self.logfile = logfile
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pidfd = -1
        self._cmd = -1
        self._replies: _Messages | None = None

    def start(self) -> "InprocessMonitorProcess":
        cmd_r, cmd_w = os.pipe2(os.O_CLOEXEC)
        rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
        out = (os.open(self.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
               if self.logfile else subprocess.DEVNULL)
        argv = python_module_command(sys.executable, MODULE, "--commands-fd", str(cmd_r), "--reply-fd", str(rep_w))
        try:  # fork+exec in C (no Python code, no lock taken between them): safe in a threaded rank
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                          pass_fds=(cmd_r, rep_w), close_fds=True)
        finally:
            for fd in (cmd_r, rep_w) + ((out,) if isinstance(out, int) and out >= 0 else ()):
                os.close(fd)
        self.pid, self._cmd, self._replies = self._proc.pid, cmd_w, _Messages(rep_r)
        self._pidfd = os.pidfd_open(self.pid)
        return self

    def configure(self, config: dict[str, Any]) -> None:
        """Tell the monitor process whom to watch and how (its first message)."""
        self.send({"cmd": "config", "config": dict(config, logfile=self.logfile, sys_path=list(sys.path))})

    def send(self, message: dict[str, Any]) -> None:
        if self._cmd >= 0:
            _send(self._cmd, message)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Block until the monitor process connected to the store; RuntimeError with its reason if it failed
        (MonitorNotReady if it only did not answer in time)."""
        assert self._replies is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MonitorNotReady(f"the in-process monitor process did not start within {timeout:g} s"
                                      f"{self._see_log()}")
            ready, _, _ = select.select([self._replies.fd], [], [], min(left, 1.0))
            if not ready:
                continue
            replies = self._replies.read()
            if replies is None:
                raise RuntimeError(f"the in-process monitor process exited during start-up{self._see_log()}")
            for reply in replies:
                if reply.get("ready"):
                    return
                raise RuntimeError(f"the in-process monitor process failed: {reply.get('error')}{self._see_log()}")

    def _see_log(self) -> str:
        return f"; see {self.logfile}" if self.logfile else ""

    def stop(self, timeout: float = 2.0) -> None:
        """Tell it to stop and reap it (killed if it does not go within TIMEOUT)."""
        if self._proc is None:
            return
        self.send({"cmd": "stop"})
        for fd in (self._cmd, self._replies.fd if self._replies else -1):
            if fd >= 0:
                os.close(fd)
        self._cmd, self._replies = -1, None
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        if not ready:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self._proc.wait()
        os.close(self._pidfd)
        self.pid, self._pidfd, self._proc = None, -1, None


# ---------------------------------------------------------------- the monitor process's entry point


def main(argv: Sequence[str] | None = None) -> int:
    """``python -P -m nvrx.launcher.rank.inprocess.monitor_process --commands-fd N --reply-fd M``."""
    parser = argparse.ArgumentParser(prog=MODULE, description="the in-process monitor process (started by the Wrapper)")
    parser.add_argument("--commands-fd", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank; we end when it ends
    for name in _RESET_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    commands = _Messages(args.commands_fd)
    first = commands.next_message()
    if first is None or first.get("cmd") != "config":  # the rank went away (or stopped us) before configuring
        return 0
    return _serve(first["config"], commands, args.reply_fd)


def _serve(cfg: dict[str, Any], commands: "_Messages", reply_fd: int) -> int:
    """Set up logging, connect to the store, say ready, and watch until told to stop or the rank ends."""
    from nvrx.launcher.rank.inprocess.log_setup import set_context, setup_file_logging

    setup_file_logging(cfg.get("logfile"))
    set_context(initial_rank=cfg.get("rank"))
    sys.path.extend(p for p in cfg.get("sys_path", []) if p not in sys.path)  # where the rank found its store class
    try:
        monitor = _Monitor(cfg, reply_fd)
    except Exception as exc:
        log.exception("start-up failed")
        _send(reply_fd, {"error": first_line(exc)})
        return 1
    code = monitor.run(commands)
    logging.shutdown()
    return code


# ---------------------------------------------------------------- the monitor process itself


class _Monitor:
    def __init__(self, cfg: dict[str, Any], reply_fd: int) -> None:
        from nvrx.launcher.rank.inprocess.store import store_from_spec
        from nvrx.monitors.heartbeat import Slot

        self.cfg = cfg
        self.reply_fd = reply_fd
        self.rank = int(cfg["rank"])
        self.world_size = int(cfg["world_size"])
        self.pid = int(cfg["pid"])
        self.interval = float(cfg["interval"])
        self.heartbeat_interval = float(cfg.get("heartbeat_interval", self.interval))
        self._next_beat = 0.0
        self.heartbeat_timeout = float(cfg["heartbeat_timeout"])
        self.hard_timeout = float(cfg["hard_timeout"])
        self.grace = float(cfg["termination_grace_time"])
        self.pidfd = os.pidfd_open(self.pid)
        self.slot = Slot.attach(Path(cfg["slot"]))
        self.store = store_from_spec(cfg["store"])
        self.watching = False
        self.stopping = False
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last changed)
        self.rendezvous_at = 0.0  # when the rank last said its main thread waits in init_process_group

    def run(self, commands: "_Messages") -> int:
        self.store.heartbeat(self.rank)
        _send(self.reply_fd, {"ready": True})
        log.info("monitoring pid %d (interval %g s, heartbeat timeout %g s, hard timeout %g s)",
                 self.pid, self.interval, self.heartbeat_timeout, self.hard_timeout)
        next_tick = time.monotonic()
        for msg in commands.take_pending():  # sent together with the configuration
            if self._command(msg):
                return 0
        while True:
            wait = max(0.0, next_tick - time.monotonic())
            readable, _, _ = select.select([commands.fd, self.pidfd], [], [], wait)
            if self.pidfd in readable:
                return self._rank_ended()
            if commands.fd in readable:
                messages = commands.read()
                if messages is None:
                    return self._rank_ended_or_stopped()
                for msg in messages:
                    if self._command(msg):
                        return 0
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + min(self.interval, self.heartbeat_interval)
                if self._tick():
                    return 0

    def _command(self, msg: dict[str, Any]) -> bool:
        cmd = msg.get("cmd")
        if cmd == "stop":
            log.info("stopped by the rank")
            self.stopping = True
            return True
        if cmd == "rendezvous":
            self.rendezvous_at = time.monotonic()
            return False
        if cmd == "watch":
            self.watching = True
            now = time.monotonic()
            self.seen = {r: (-1, now) for r in range(self.world_size) if r != self.rank}
        return False

    def _tick(self) -> bool:
        """One round of beating and watching; True when this process should end.

        The hard timeout comes first and needs no store: a rank stuck because the store's host died must
        still be ended."""
        if self._hard_timeout_expired():
            return True
        try:
            now = time.monotonic()
            if now >= self._next_beat:  # heartbeat_interval and monitor_process_interval may differ
                self._next_beat = now + self.heartbeat_interval
                self.store.heartbeat(self.rank)
            if self.watching:
                self._watch_peers()
        except Exception as exc:
            log.warning("store unreachable: %s", first_line(exc))
        return False

    def _hard_timeout_expired(self) -> bool:
        from nvrx.launcher.rank.inprocess.progress import read_progress

        progress = read_progress(self.slot)
        if not progress.running:
            return False
        now = time.monotonic()
        stalled = min(progress.stalled_for(now), now - self.rendezvous_at)
        if stalled <= self.hard_timeout:
            return False
        reason = f"hard timeout: no progress for {stalled:.1f} s (hard_timeout={self.hard_timeout:g} s); terminated"
        log.error("%s", reason)
        try:
            self._record(self.rank, reason)
        except Exception as exc:  # the store's host died (the case the hard timeout exists for): terminate anyway
            log.warning("could not record the hard timeout in the store (%s)", first_line(exc))
        self._terminate()
        self._remove_slot()
        return True

    def _remove_slot(self) -> None:
        """The rank cannot clean up after a kill: remove its progress slot's private directory."""
        directory = Path(self.cfg["slot"]).parent
        if directory.name.startswith(SLOT_DIR_PREFIX) and not _alive(self.pidfd):
            shutil.rmtree(directory, ignore_errors=True)

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
                reason = (f"heartbeat timeout: no heartbeat for {now - since:.1f} s "
                          f"(heartbeat_timeout={self.heartbeat_timeout:g} s)")
                log.error("rank %d: %s", rank, reason)
                self._record(rank, reason)
                del self.seen[rank]

    def _record(self, rank: int, reason: str) -> None:
        self.store.mark_terminated([rank], reason)
        self.store.record_fault(rank, -1, reason)

    def _rank_ended(self) -> int:
        self._remove_slot()
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


class _Messages:
    """JSON-object lines from a pipe, read with os.read (no hidden buffering between select() calls)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = LineBuffer()
        self._pending: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]] | None:
        """Messages completed by one read (after any left by ``next_message``); None at end of file.
        Only our own code writes these pipes."""
        if self._pending:
            pending, self._pending = self._pending, []
            return pending
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        messages = self._buffer.feed(chunk)
        for bad in messages:
            if isinstance(bad, MonitorProtocolError):
                raise bad
        return messages  # type: ignore[return-value]

    def take_pending(self) -> list[dict[str, Any]]:
        pending, self._pending = self._pending, []
        return pending

    def next_message(self) -> dict[str, Any] | None:
        """Block for one message (the rest are kept for ``read``); None at end of file."""
        while not self._pending:
            messages = self.read()
            if messages is None:
                return None
            self._pending = messages
        return self._pending.pop(0)


def _alive(pidfd: int) -> bool:
    readable, _, _ = select.select([pidfd], [], [], 0)
    return not readable


def _signal(pidfd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except (ProcessLookupError, OSError):
        pass


def _send(fd: int, message: dict[str, Any]) -> None:
    """One JSON line to the other end; a closed pipe is not an error (that end is gone or stopping)."""
    try:
        os.write(fd, encode(message))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
