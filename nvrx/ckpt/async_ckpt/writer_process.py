"""The training process's handle on its persistent checkpoint writer process.

One writer per training process, started once (by ``nvrx launch --async-ckpt`` through the
bootstrap, or on first use) and reused by every save: a save costs a message, not a fork. The
writer is our own child, reached through a private socketpair; data goes through staging memfds.
If it dies, the jobs it held fail with the reason and the next job starts a new one.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Mapping

from nvrx.common.process import python_module_command
from nvrx.ckpt.async_ckpt import staging
from nvrx.ckpt.async_ckpt.control import Channel, ChannelClosed

log = logging.getLogger("nvrx.ckpt.writer")

_live: "weakref.WeakSet[WriterProcess]" = weakref.WeakSet()
STOPPED = "the checkpoint writer was stopped"


class WriterProcess:
    """Start, feed and watch one writer process. Not thread-safe: used from the training thread."""

    def __init__(self, python: str = sys.executable, nice: int = 10, io_class: int | None = None) -> None:
        self.python = python
        self.nice = nice  # the writer's niceness: training comes first
        self.io_class = io_class  # ionice class 0-3 (None: unchanged)
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.pid: int | None = None
        self.starts = 0
        self._ids = itertools.count(1)
        self._attached: set[int] = set()
        self._pending: set[int] = set()
        self._results: dict[int, dict[str, Any]] = {}
        self._forgotten: set[int] = set()  # aborted jobs whose answers are dropped
        self._death: str | None = None
        staging.add_close_hook(weakref.WeakMethod(self.detach))

    # ------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Start the process (no-op if it runs). Returns at once; it imports torch in the background.

        A process that already imported torch and runs no other thread (a rank at start, forked from the
        launcher's warm template) forks the writer instead: no second interpreter importing torch for
        seconds of CPU while the rank initialises (on a small node, the two cores a restart needs).
        """
        if self.running():
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        args = [str(theirs.fileno()), str(os.getpid()), str(self.nice)]
        cmd = python_module_command(self.python, "nvrx.ckpt.async_ckpt.writer_main", *args)
        # The writer ignores the launcher's stop signals, but only once its main() runs: a spawned writer imports
        # for a while first (seconds on a loaded node), and a SIGTERM to the rank's process group then would kill
        # it and lose the save in flight. Blocked here, the signals stay blocked across fork + exec until the
        # writer has set them to be ignored (a signal pending meanwhile is then discarded).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, writer_main_signals())
        try:
            if _can_fork():
                self.proc = _ForkedWriter(theirs.fileno(), args, cmd[:4])  # type: ignore[assignment]
            else:
                self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                             close_fds=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            theirs.close()
        self.channel = Channel(ours)
        self.pid = self.proc.pid
        self._apply_priority()
        self.starts += 1
        self._attached.clear()
        self._death = None
        _live.add(self)
        log.debug("checkpoint writer started, pid %d", self.pid)

    def set_priority(self, nice: int, io_class: int | None) -> None:
        """Change the writer's CPU niceness and I/O class, now if it runs and at every later start.

        Raising the niceness needs no privilege; lowering it does (a failure is logged, the writer keeps running).
        """
        self.nice, self.io_class = nice, io_class
        if self.running():
            self._apply_priority()

    def _apply_priority(self) -> None:
        """Set the running writer's niceness and I/O class from here, so they hold when ``start`` returns."""
        nice, io_class = self.nice, self.io_class
        try:
            current = os.getpriority(os.PRIO_PROCESS, self.pid)  # type: ignore[arg-type]
            if nice > current:  # only ever lower the writer's priority (raising it needs privilege)
                os.setpriority(os.PRIO_PROCESS, self.pid, nice)  # type: ignore[arg-type]
            elif nice < current:
                log.debug("checkpoint writer keeps nice %d (asked for %d: raising priority needs privilege)", current, nice)
        except OSError as exc:
            log.warning("cannot set the checkpoint writer's nice value to %d: %s", nice, exc)
        if io_class is not None:
            set_io_class(self.pid, io_class)  # type: ignore[arg-type]

    def running(self) -> bool:
        return self.proc is not None and self._death is None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Let the writer finish the job it holds, then end it (killed after TIMEOUT)."""
        if self.proc is None:
            return
        if self.channel is not None and self._death is None:
            try:
                self.channel.send({"op": "exit"})
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("checkpoint writer pid %d did not exit in %.0fs; killing it", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()
        self._close()

    def kill(self) -> None:
        """End the writer now (exit paths: nothing it holds will be published)."""
        if self.proc is None:
            return
        # Stopped, not failed: a detach or save that runs meanwhile (a staging finalizer, another thread at
        # interpreter exit) must see a writer that is not running instead of writing to the closed channel and
        # logging "checkpoint writer failed: ... Bad file descriptor".
        self._death = self._death or STOPPED
        if self.channel is not None:
            self.channel.close()  # end of file: the writer exits at once
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None
        self.proc = None
        self._fail_pending(STOPPED)
        _live.discard(self)

    def _close_in_fork_child(self) -> None:
        """A forked child (e.g. a DataLoader worker) must not keep the writer's channel open."""
        if self.channel is not None:
            try:
                self.channel.sock.close()
            except OSError:
                pass

    # ------------------------------------------------------------ jobs

    def attach(self, buffer: Any) -> None:
        if buffer.id in self._attached:
            return
        self._send({"op": "attach", "buf": buffer.id, "size": buffer.capacity}, (buffer.fd,))
        self._attached.add(buffer.id)

    def detach(self, buffer: Any) -> None:
        if buffer.id in self._attached and self.running():
            try:
                self._send({"op": "detach", "buf": buffer.id})
            except RuntimeError:
                pass
        self._attached.discard(buffer.id)

    def submit(self, job: dict[str, Any], buffer: Any = None, fd: int | None = None) -> int:
        """Hand JOB to the writer; it reads BUFFER (attached once) or FD (sent along). Returns the job id."""
        if not self.running():
            if self.proc is not None and self._death == STOPPED:  # kill() is ending it (interpreter exit)
                raise RuntimeError(f"checkpoint writer process is gone: {STOPPED}")
            if self.proc is not None:
                log.warning("checkpoint writer is gone (%s); starting a new one", self._death or "exited")
                self._close()
            self.start()
        message = dict(job, id=next(self._ids))
        if buffer is not None:
            self.attach(buffer)
            message["buf"] = buffer.id
        self._send(message, (fd,) if fd is not None else ())
        self._pending.add(message["id"])
        return message["id"]

    def staged(self, job_id: int, upto: int) -> None:
        """Tell the writer that bytes [0, UPTO) of a progressive job's buffer hold their data."""
        self._send({"op": "staged", "id": job_id, "upto": upto})

    def abort(self, job_id: int, reason: str, timeout: float = 60.0) -> bool:
        """Stop job JOB_ID (its save is abandoned) and wait until the writer has let go of it; its answer is dropped.

        It waits because the files of an abandoned save are removed right afterwards, and a later save to the
        same path must not have its files truncated by a late write of this one. The writer stops at the next
        item it would write (it checks the abort before each one). False if it did not within TIMEOUT.
        """
        deadline = time.monotonic() + timeout
        try:
            self._send({"op": "abort", "id": job_id, "reason": reason})
            while job_id in self._pending and self.result(job_id) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("checkpoint writer did not stop job %d within %.0fs; its answer will be ignored",
                                job_id, timeout)
                    self._pending.discard(job_id)
                    self._forgotten.add(job_id)
                    return False
                if self.channel is not None:
                    select.select([self.channel], [], [], min(remaining, 0.5))
        except RuntimeError:  # the writer is gone: nothing of this job is written any more
            pass
        self._pending.discard(job_id)
        self._results.pop(job_id, None)
        return True

    def _send(self, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        assert self.channel is not None
        try:
            self.channel.send(message, fds)
        except OSError as exc:  # a writer just killed breaks the pipe before its end of the channel reads closed
            reason = f"cannot reach it ({exc})"
            self._mark_dead(reason if self._death is not None else self._exit_reason(reason))
            raise RuntimeError(f"checkpoint writer process is gone: {self._death}") from None

    def result(self, job_id: int, block: bool = False) -> dict[str, Any] | None:
        """The writer's answer for JOB_ID ({"ok": ..., ...}), or None while it is still running."""
        while job_id not in self._results:
            if job_id not in self._pending:
                raise KeyError(f"unknown checkpoint job {job_id}")
            if not self._read(block):
                return None
        self._pending.discard(job_id)
        return self._results.pop(job_id)

    def _read(self, block: bool) -> bool:
        """Take in messages; False if nothing arrived (non-blocking). Death fails every pending job."""
        if self.channel is None or self._death is not None:
            self._fail_pending(self._death or "the checkpoint writer is not running")
            return True
        try:
            message = self.channel.recv(block=block)
        except (ChannelClosed, ValueError) as exc:
            self._mark_dead(self._exit_reason(str(exc)))
            return True
        if message is None:
            return False
        if message.get("op") == "done":
            job_id = int(message["id"])
            if job_id in self._forgotten:
                self._forgotten.discard(job_id)
            else:
                self._results[job_id] = message
        return True

    def _exit_reason(self, fallback: str) -> str:
        if self.proc is None:
            return fallback
        try:  # its end of the channel closed: it is dying; on a loaded machine reaping it can take over a second
            code = self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return fallback
        if code < 0:
            return f"writer process {self.proc.pid} was killed by {signal.Signals(-code).name}"
        return f"writer process {self.proc.pid} exited with code {code}"

    def _mark_dead(self, reason: str) -> None:
        if self._death is None:
            self._death = reason
            log.warning("checkpoint writer failed: %s", reason)
        self._fail_pending(reason)

    def _fail_pending(self, reason: str) -> None:
        for job_id in list(self._pending):
            self._results.setdefault(job_id, {"op": "done", "id": job_id, "ok": False, "error": reason})


def set_io_class(pid: int, io_class: int) -> None:
    """``ionice -c IO_CLASS -p PID`` (3 = idle: the writer's I/O waits for everyone else's); failures are logged."""
    try:
        subprocess.run(["ionice", "-c", str(io_class), "-p", str(pid)], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cannot set the I/O class of checkpoint writer pid %d to %d: %s", pid, io_class, exc)


def _can_fork() -> bool:
    """torch is imported here already and no other thread runs (a fork then copies no lock held elsewhere)."""
    if "torch" not in sys.modules:
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def writer_main_signals() -> set[signal.Signals]:
    """The stop signals the writer ignores (it ends when its training process goes, not on a signal)."""
    return {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT}


class _ForkedWriter:
    """A writer forked from this process (what ``subprocess.Popen`` offers that ``WriterProcess`` uses)."""

    def __init__(self, fd: int, args: list[str], title: list[str]) -> None:
        pid = os.fork()
        if pid == 0:  # the child: only its end of the socketpair and stdio, then the writer's loop
            try:
                _keep_only_fds((0, 1, 2, fd))
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.close(devnull)
                from nvrx.common.process import set_process_title

                set_process_title(title)
                from nvrx.ckpt.async_ckpt import writer_main

                writer_main.main(args)
            finally:
                os._exit(70)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                done, status = self.pid, 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"writer {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _keep_only_fds(keep: tuple[int, ...]) -> None:
    """Close every inherited fd but KEEP (as ``close_fds=True`` does for a spawned process)."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


# ---------------------------------------------------------------- the process-wide writer

_default: WriterProcess | None = None
_default_lock = threading.Lock()


def default_writer() -> WriterProcess:
    """This process's writer, started on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = WriterProcess()
        if not _default.running() and _default.proc is None:
            _default.start()
        return _default


def start_persistent_writer() -> WriterProcess:
    """Start this process's writer now, so the first save does not wait for it to import torch."""
    return default_writer()


ASYNC_CKPT_ENV = "NVRX_ASYNC_CKPT"  # "1": set for ranks by `nvrx launch --async-ckpt`


def start_if_requested(env: Mapping[str, str]) -> WriterProcess | None:
    """The rank bootstrap's hook: start the persistent writer when the launcher asked for it (ENV)."""
    if env.get(ASYNC_CKPT_ENV) != "1":
        return None
    try:
        return start_persistent_writer()
    except OSError as exc:  # the first save starts it (and reports a real problem) instead
        log.warning("cannot start the checkpoint writer process: %s", exc)
        return None


def _after_fork_in_child() -> None:
    global _default
    for writer in list(_live):
        writer._close_in_fork_child()
        writer.channel = None
        writer.proc = None
    _live.clear()
    _default = None


def _stop_all_at_exit() -> None:
    deadline = time.monotonic() + 5.0
    for writer in list(_live):
        if time.monotonic() < deadline:
            writer.kill()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_stop_all_at_exit)
