"""The ranks of one node: start them (forked from the template or spawned), watch them, stop them,
and relay their output.

Exits are noticed without polling: every rank has a pidfd in one selector together with the fork
server's socket, so :meth:`WorkerGroup.wait` sleeps in the kernel until something happens. One
relay thread moves all ranks' stdout/stderr to files / the console and keeps the last lines of
each rank for the failure report.

Use a WorkerGroup from one long-lived thread (the agent's main thread): PR_SET_PDEATHSIG fires
when the *thread* that started a process exits, not only the process.
"""

from __future__ import annotations

import collections
import errno
import functools
import itertools
import json
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

import psutil

from launcher.rank import bootstrap
from nvrx_common.process import die_with_parent

from launcher.agent import fork_server
from launcher.agent.config import Std, WorkerSettings
from monitors.events import EventLog

log = logging.getLogger(__name__)

TAIL_LINES = 20
MAX_TAIL_CHARS = 2000
DRAIN_TIMEOUT = 1.0  # after a rank died, how long grandchildren may keep its pipes open before we report anyway
STATUS_TIMEOUT = 5.0  # a forked rank died; the server's exit message should follow within this
READY_TIMEOUT = 60.0  # the fork server is importing torch already: waiting beats a second import
REPLY_TIMEOUT = 30.0
PARTIAL_FLUSH = 0.2  # an unterminated line reaches the console after this long without a newline
MAX_PENDING = 1 << 16
LAUNCHER_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding our packages
# Read when the interpreter / torch's native libraries load, so a forked rank would keep the
# template's values: a rank whose environment differs in these is spawned instead.
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_")


@dataclass(frozen=True)
class RankSpec:
    local_rank: int
    global_rank: int
    env: dict[str, str]  # the complete environment of the rank


@dataclass(frozen=True)
class RankExit:
    local_rank: int
    global_rank: int
    pid: int
    exitcode: int | None  # None if killed by a signal or abandoned
    signal: str | None  # e.g. "SIGKILL"
    tail: tuple[str, ...]  # last lines of the rank's combined stdout/stderr
    abandoned: bool = False  # survived SIGKILL for kill_timeout; reported, not waited on
    state: str | None = None  # process state letter when abandoned (e.g. "D")

    @property
    def failed(self) -> bool:
        return self.exitcode != 0

    def describe(self) -> str:
        who = f"rank {self.global_rank} (local {self.local_rank})"
        if self.abandoned:
            return f"{who} stuck (state {self.state or '?'}) and abandoned"
        if self.signal is not None:
            return f"{who} was killed by {self.signal}"
        if self.exitcode is not None:
            return f"{who} exited with code {self.exitcode}"
        return f"{who} is gone (exit status unknown)"


# ---------------------------------------------------------------- internal state


@dataclass(eq=False)
class _Stream:
    """One pipe (stdout or stderr) of one rank, as the relay thread sees it."""

    fd: int
    rank: _Rank
    file: BinaryIO | None
    console: BinaryIO | None
    prefix: bytes | None
    line: bytearray = field(default_factory=bytearray)  # incomplete line, for the tail
    pending: bytearray = field(default_factory=bytearray)  # bytes not yet shown on the console
    pending_since: float = 0.0
    at_line_start: bool = True


@dataclass(eq=False)
class _Rank:
    spec: RankSpec
    attempt: int
    how: str
    pid: int
    pidfd: int | None = None
    popen: subprocess.Popen[bytes] | None = None
    status: tuple[int | None, str | None] | None = None
    status_at: float | None = None  # status settled before death was seen (fork server lost)
    dead_at: float | None = None
    open_streams: int = 0
    streams: list[_Stream] = field(default_factory=list)
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reported: bool = False
    abandoned: bool = False
    state: str | None = None
    descendants: dict[int, psutil.Process] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.pid > 0 and self.dead_at is None and not self.reported


@dataclass(eq=False)
class _ServerLink:
    popen: subprocess.Popen[bytes]
    sock: socket.socket
    pidfd: int
    started: float  # wall clock, comparable with the server's own "t"
    ready: bool = False


@dataclass
class _Pipes:
    out_r: int
    out_w: int
    err_r: int
    err_w: int

    @classmethod
    def open(cls) -> _Pipes:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        return cls(out_r, out_w, err_r, err_w)

    def close_write(self) -> None:
        _close_quietly(self.out_w, self.err_w)

    def close_all(self) -> None:
        _close_quietly(self.out_r, self.out_w, self.err_r, self.err_w)


def _close_quietly(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _decode(raw: bytes | bytearray) -> str:
    text = bytes(raw).decode("utf-8", "replace").rstrip("\r")
    return text if len(text) <= MAX_TAIL_CHARS else text[:MAX_TAIL_CHARS] + "..."


def _status_from_returncode(code: int | None) -> tuple[int | None, str | None]:
    fields = fork_server.exit_fields(code)
    return fields["exitcode"], fields["signal"]


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _proc_state(pid: int) -> tuple[str | None, str | None]:
    """(state letter from /proc, psutil status) of a process that would not die."""
    letter = status = None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            letter = fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        pass
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        pass
    return letter, status


def _launcher_env(env: dict[str, str] | Any) -> dict[str, str]:
    """ENV plus the launcher's root on PYTHONPATH so `-m launcher.*` works from any cwd.

    The bootstrap undoes this (and restores PYTHONPATH) before user code runs.
    """
    out = dict(env)
    original = out.get("PYTHONPATH")
    out["PYTHONPATH"] = LAUNCHER_ROOT + (os.pathsep + original if original else "")
    out[bootstrap.INJECT_ENV] = json.dumps({"root": LAUNCHER_ROOT, "pythonpath": original})
    return out


def _import_time_difference(env: Any, base: Any) -> str | None:
    """The first variable read at import time whose value differs between ENV and BASE."""
    for key in sorted(set(env) | set(base)):
        if key != "PYTHONPATH" and key.startswith(IMPORT_TIME_ENV) and env.get(key) != base.get(key):
            return key
    return None


def _spawned_child_setup(parent_pid: int) -> None:
    """preexec_fn of a spawned rank: die with the agent, and start with no blocked signals."""
    die_with_parent(parent_pid)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


class _TextAsBinary:
    """Lets the relay write bytes to a text-only stream (e.g. a replaced sys.stdout)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.write(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


def _binary(stream: BinaryIO | None, default: Any) -> BinaryIO:
    if stream is not None:
        return stream
    return getattr(default, "buffer", None) or _TextAsBinary(default)  # type: ignore[return-value]


# ---------------------------------------------------------------- output relay


class _Relay:
    """One thread moving every rank's output to its file / the console / its tail ring."""

    def __init__(self, lock: threading.Lock, on_drained: Callable[[_Rank], None]) -> None:
        self._lock = lock  # guards ranks' tails and open_streams, and _incoming
        self._on_drained = on_drained
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: list[_Stream] = []
        self._streams: list[_Stream] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nvrx-output-relay", daemon=True)
        self._thread.start()

    def add(self, streams: Sequence[_Stream]) -> None:
        with self._lock:
            self._incoming.extend(streams)
        self._wake()

    def stop(self, timeout: float = 5.0) -> None:
        """Read what is already in the pipes, then close everything."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # full pipe: the thread is due to wake anyway

    def _run(self) -> None:
        try:
            while True:
                timeout = self._flush_stale_partials()
                for key, _ in self._sel.select(timeout):
                    if key.data is None:
                        self._take_incoming()
                    else:
                        self._read(key.data)
                if self._stopping:
                    break
        except Exception:
            log.exception("output relay failed; rank output is no longer shown")
        finally:
            self._finish()

    def _take_incoming(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass
        with self._lock:
            new, self._incoming = self._incoming, []
        for stream in new:
            self._sel.register(stream.fd, selectors.EVENT_READ, stream)
            self._streams.append(stream)

    def _read(self, stream: _Stream) -> bool:
        """Move one chunk; False when there is nothing more to read right now."""
        try:
            data = os.read(stream.fd, 65536)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._close(stream)
            return False
        self._deliver(stream, data)
        return True

    def _deliver(self, stream: _Stream, data: bytes) -> None:
        if stream.file is not None:
            try:
                stream.file.write(data)
            except (OSError, ValueError) as exc:
                log.warning("cannot write rank %d output to its log file: %s", stream.rank.spec.local_rank, exc)
                stream.file = None
        self._add_to_tail(stream, data)
        if stream.console is None:
            return
        stream.pending += data
        end = stream.pending.rfind(b"\n") + 1
        if end:
            self._show(stream, bytes(stream.pending[:end]))
            del stream.pending[:end]
        if len(stream.pending) > MAX_PENDING:
            self._show(stream, bytes(stream.pending))
            stream.pending.clear()
        stream.pending_since = time.monotonic() if stream.pending else 0.0

    def _add_to_tail(self, stream: _Stream, data: bytes) -> None:
        stream.line += data
        if b"\n" not in data and len(stream.line) <= MAX_PENDING:
            return
        *lines, rest = stream.line.split(b"\n")
        with self._lock:
            stream.rank.tail.extend(_decode(line) for line in lines[-TAIL_LINES:])
            if len(rest) > MAX_PENDING:
                stream.rank.tail.append(_decode(rest))
                rest = bytearray()
        stream.line = bytearray(rest)

    def _show(self, stream: _Stream, chunk: bytes) -> None:
        if stream.console is None or not chunk:
            return
        out = chunk if stream.prefix is None else self._prefixed(stream, chunk)
        stream.at_line_start = chunk.endswith(b"\n")
        try:
            stream.console.write(out)
            stream.console.flush()
        except (OSError, ValueError):
            stream.console = None  # the console is gone; keep draining into files and tails

    @staticmethod
    def _prefixed(stream: _Stream, chunk: bytes) -> bytes:
        parts = chunk.split(b"\n")
        out = bytearray()
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if last and not part:
                break
            if stream.at_line_start or i > 0:
                out += stream.prefix or b""
            out += part
            if not last:
                out += b"\n"
        return bytes(out)

    def _flush_stale_partials(self) -> float | None:
        now = time.monotonic()
        due: float | None = None
        for stream in self._streams:
            if not stream.pending:
                continue
            left = stream.pending_since + PARTIAL_FLUSH - now
            if left <= 0:
                self._show(stream, bytes(stream.pending))
                stream.pending.clear()
            else:
                due = left if due is None else min(due, left)
        return due

    def _close(self, stream: _Stream) -> None:
        self._sel.unregister(stream.fd)
        _close_quietly(stream.fd)
        self._streams.remove(stream)
        self._show(stream, bytes(stream.pending))
        stream.pending.clear()
        if stream.prefix is not None and not stream.at_line_start:
            self._show(stream, b"\n")
        if stream.file is not None:
            try:
                stream.file.close()
            except OSError:
                pass
        with self._lock:
            if stream.line:
                stream.rank.tail.append(_decode(stream.line))
                stream.line = bytearray()
            stream.rank.open_streams -= 1
            drained = stream.rank.open_streams == 0
        if drained:
            self._on_drained(stream.rank)

    def _finish(self) -> None:
        self._take_incoming()
        for stream in list(self._streams):
            for _ in range(64):  # what is already buffered, not what a live writer keeps adding
                if not self._read(stream):
                    break
            if stream in self._streams:
                self._close(stream)
        self._sel.close()
        _close_quietly(self._wake_r, self._wake_w)


# ---------------------------------------------------------------- the group


class WorkerGroup:
    """Starts, watches, signals and stops the ranks of one node, one attempt at a time."""

    def __init__(
        self,
        settings: WorkerSettings,
        events: EventLog,
        run_log_dir: Path,
        console_out: BinaryIO | None = None,
        console_err: BinaryIO | None = None,
    ) -> None:
        self.settings = settings
        self._events = events
        self._run_log_dir = Path(run_log_dir)
        self._console = {Std.OUT: _binary(console_out, sys.stdout), Std.ERR: _binary(console_err, sys.stderr)}
        self._sel = selectors.DefaultSelector()
        self._notify_r, self._notify_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._notify_r, selectors.EVENT_READ, ("notify", None))
        self._lock = threading.Lock()
        self._relay: _Relay | None = None
        self._ranks: list[_Rank] = []
        self._by_pid: dict[int, _Rank] = {}
        self._early_exits: dict[int, dict[str, Any]] = {}
        self._replies: dict[int, tuple[dict[str, Any], list[int]]] = {}
        self._ids = itertools.count(1)
        self._server: _ServerLink | None = None
        self._fork_off: str | None = None if settings.fork_server and not settings.no_python else "disabled"
        self._children: list[subprocess.Popen[bytes]] = []  # spawned ranks, reaped at close
        self._closed = False

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ public API

    def prepare(self) -> None:
        """Start the fork server now so its `import torch` overlaps with the agent's own work."""
        if self._closed or self._fork_off is not None or self._server is not None:
            return
        self._start_server()

    def start(self, specs: list[RankSpec], attempt: int) -> None:
        """Start every rank of this node for restart attempt ATTEMPT."""
        if self._closed:
            raise RuntimeError("WorkerGroup is closed")
        if any(not r.reported for r in self._ranks):
            raise RuntimeError("ranks of the previous attempt are still live; stop() them first")
        self._ranks, self._by_pid, self._early_exits = [], {}, {}
        if self._relay is None:
            self._relay = _Relay(self._lock, self._on_drained)
        forkable = any(_import_time_difference(spec.env, self.settings.base_env) is None for spec in specs)
        use_fork = forkable and self._fork_ready()
        requested: list[tuple[RankSpec, _Pipes, int, float]] = []
        for spec in specs:
            pipes, started = _Pipes.open(), time.monotonic()
            rid = self._request_fork(spec, pipes) if use_fork else None
            if rid is None:
                self._spawn_rank(spec, attempt, pipes, started)
            else:
                requested.append((spec, pipes, rid, started))
        for spec, pipes, rid, started in requested:
            self._finish_fork(spec, attempt, pipes, rid, started)

    def wait(self, wake_fds: Sequence[int] = (), timeout: float | None = None) -> list[RankExit]:
        """Block until a rank exited (its exits), a wake fd is readable or TIMEOUT passed ([])."""
        if self._closed:
            return []
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        wake = self._register_wake_fds(wake_fds)
        looked = False  # even timeout=0 looks at the fds once
        try:
            while True:
                now = time.monotonic()
                exits, due = self._collect(now)
                if exits or not any(not r.reported for r in self._ranks):
                    return exits
                if deadline is not None and now >= deadline and looked:
                    return []
                limits = [t for t in (deadline, due) if t is not None]
                looked = True
                if self._pump(max(0.0, min(limits) - now) if limits else None):
                    return self._collect(time.monotonic())[0]
        finally:
            for fd in wake:
                self._sel.unregister(fd)

    def alive(self) -> list[int]:
        """Local ranks whose process is still running."""
        if not self._closed:
            self._pump(0)
        return [r.spec.local_rank for r in self._ranks if r.running]

    def unreported(self) -> list[int]:
        """Local ranks whose exit has not been returned by wait() yet (running, or dead and draining output).
        A job may only count as succeeded once this is empty: a dead rank's failure is reported a moment later."""
        if not self._closed:
            self._pump(0)
        return [r.spec.local_rank for r in self._ranks if not r.reported]

    def signal_all(self, sig: int) -> None:
        """Forward SIG to the process group of every running rank."""
        for rank in self._ranks:
            if rank.running:
                _killpg(rank.pid, sig)

    def stop(self, grace: float | None = None) -> list[RankExit]:
        """SIGTERM, then SIGKILL after GRACE, then abandon survivors; bounded. Exits of live ranks."""
        if self._closed:
            return []
        grace = self.settings.term_timeout if grace is None else max(0.0, grace)
        live = [r for r in self._ranks if not r.reported]
        if live:
            self._pump(0)
            self._signal_running(live, signal.SIGTERM)
            if not self._wait_until(lambda: not any(r.running for r in live), grace):
                self._signal_running(live, signal.SIGKILL)
                self._wait_until(lambda: not any(r.running for r in live), self.settings.kill_timeout)
            for rank in live:
                if rank.running:
                    self._abandon(rank)
        self._sweep(self._ranks)
        self._wait_until(lambda: all(r.reported or r.abandoned or self._reportable(r, time.monotonic())[0] for r in live), DRAIN_TIMEOUT + 0.5)
        return [self._report(r) for r in live if not r.reported]

    def close(self) -> None:
        """Stop the ranks and the fork server and kill anything they left; idempotent."""
        if self._closed:
            return
        try:
            self.stop()
        finally:
            self._closed = True
            self._shutdown_server()
            self._reap_children()
            if self._relay is not None:
                self._relay.stop()
            self._sel.close()
            _close_quietly(self._notify_r, self._notify_w)

    # ------------------------------------------------------------ event loop

    def _pump(self, timeout: float | None) -> bool:
        """Handle what is ready (waiting up to TIMEOUT); True if a caller's wake fd is readable."""
        woken = False
        server_exited: _ServerLink | None = None
        for key, _ in self._sel.select(timeout):
            kind, obj = key.data
            if kind == "notify":
                self._drain_notify()
            elif kind == "wake":
                woken = True
            elif kind == "server" and obj is self._server:
                self._read_server()
            elif kind == "server_exit":
                server_exited = obj
            elif kind == "rank":
                self._on_rank_pidfd(obj)
        if server_exited is not None and server_exited is self._server:
            self._read_server()  # exit messages it sent before dying
            if server_exited is self._server:
                self._server_lost("the fork server exited")
        return woken

    def _wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._pump(left)
        return True

    def _register_wake_fds(self, fds: Sequence[int]) -> list[int]:
        registered = []
        for fd in dict.fromkeys(fds):
            try:
                self._sel.register(fd, selectors.EVENT_READ, ("wake", fd))
                registered.append(fd)
            except (KeyError, ValueError):
                pass
        return registered

    def _drain_notify(self) -> None:
        try:
            while os.read(self._notify_r, 4096):
                pass
        except OSError:
            pass

    def _on_drained(self, rank: _Rank) -> None:
        """Relay thread: a rank's pipes hit EOF; wake whoever waits for its exit."""
        try:
            os.write(self._notify_w, b"\0")
        except OSError:
            pass

    def _on_rank_pidfd(self, rank: _Rank) -> None:
        self._drop_pidfd(rank)
        if rank.dead_at is None:
            rank.dead_at = time.monotonic()
        if rank.popen is not None and rank.status is None:
            try:
                code = rank.popen.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None
            rank.status = _status_from_returncode(code)

    def _drop_pidfd(self, rank: _Rank) -> None:
        if rank.pidfd is None:
            return
        try:
            self._sel.unregister(rank.pidfd)
        except (KeyError, ValueError):
            pass
        _close_quietly(rank.pidfd)
        rank.pidfd = None

    # ------------------------------------------------------------ exits

    def _reportable(self, rank: _Rank, now: float) -> tuple[bool, float | None]:
        """(can its RankExit be returned now, else when to look again)."""
        if rank.reported:
            return False, None
        if rank.dead_at is None:
            if rank.status_at is None:
                return False, None
            due = rank.status_at + self.settings.kill_timeout  # fork server lost: it dies by pdeathsig
            if now < due:
                return False, due
            self._abandon(rank)
            return True, None
        if rank.status is None:
            due = rank.dead_at + STATUS_TIMEOUT
            if now < due:
                return False, due
            rank.status = (None, None)
        if rank.open_streams > 0:
            due = rank.dead_at + DRAIN_TIMEOUT
            if now < due:
                return False, due
        return True, None

    def _collect(self, now: float) -> tuple[list[RankExit], float | None]:
        exits: list[RankExit] = []
        next_due: float | None = None
        for rank in self._ranks:
            ready, due = self._reportable(rank, now)
            if ready:
                exits.append(self._report(rank))
            elif due is not None:
                next_due = due if next_due is None else min(next_due, due)
        return exits, next_due

    def _report(self, rank: _Rank) -> RankExit:
        rank.reported = True
        self._drop_pidfd(rank)
        exitcode, sig = rank.status or (None, None)
        if rank.abandoned:
            exitcode, sig = None, None
        with self._lock:
            lines = list(rank.tail) + [_decode(s.line) for s in rank.streams if s.line]
        exit_ = RankExit(
            local_rank=rank.spec.local_rank,
            global_rank=rank.spec.global_rank,
            pid=rank.pid,
            exitcode=exitcode,
            signal=sig,
            tail=tuple(lines[-TAIL_LINES:]),
            abandoned=rank.abandoned,
            state=rank.state,
        )
        self._events.emit(
            "rank_exit",
            local_rank=rank.spec.local_rank,
            rank=rank.spec.global_rank,
            pid=rank.pid,
            exitcode=exitcode,
            signal=sig,
            attempt=rank.attempt,
            abandoned=rank.abandoned,
        )
        return exit_

    def _settle(self, rank: _Rank, exitcode: int | None, sig: str | None) -> None:
        """A forked rank was reaped by the server: it is dead and this is its status."""
        if rank.status is None or rank.status_at is not None:
            rank.status, rank.status_at = (exitcode, sig), None
        if rank.dead_at is None:
            rank.dead_at = time.monotonic()
        self._drop_pidfd(rank)

    def _abandon(self, rank: _Rank) -> None:
        rank.abandoned = True
        rank.state, status = _proc_state(rank.pid)
        self._events.emit(
            "rank_stuck",
            local_rank=rank.spec.local_rank,
            rank=rank.spec.global_rank,
            pid=rank.pid,
            attempt=rank.attempt,
            state=rank.state,
            status=status,
        )
        log.warning("rank %d (pid %d) did not die after SIGKILL (state %s); abandoning it", rank.spec.global_rank, rank.pid, rank.state)

    # ------------------------------------------------------------ stopping

    def _signal_running(self, ranks: Sequence[_Rank], sig: int) -> None:
        for rank in ranks:
            if rank.running:
                self._remember_descendants(rank)
                _killpg(rank.pid, sig)

    @staticmethod
    def _remember_descendants(rank: _Rank) -> None:
        """Note the rank's children now: once it dies they are reparented and untraceable."""
        try:
            for child in psutil.Process(rank.pid).children(recursive=True):
                rank.descendants.setdefault(child.pid, child)
        except psutil.Error:
            pass

    @staticmethod
    def _sweep(ranks: Sequence[_Rank]) -> None:
        """Kill what the ranks left behind: members of their process groups and known descendants."""
        for rank in ranks:
            if rank.pid > 0:
                _killpg(rank.pid, signal.SIGKILL)
            for proc in rank.descendants.values():
                try:
                    proc.kill()  # psutil refuses if the pid now belongs to another process
                except psutil.Error:
                    pass

    def _reap_children(self) -> None:
        for popen in self._children:
            if popen.poll() is None:
                try:
                    popen.kill()
                    popen.wait(timeout=0.5)
                except (OSError, subprocess.TimeoutExpired):
                    log.warning("rank pid %d could not be reaped; leaving it", popen.pid)
        self._children = [p for p in self._children if p.returncode is None]

    # ------------------------------------------------------------ starting

    def _spawn_rank(self, spec: RankSpec, attempt: int, pipes: _Pipes, started: float) -> None:
        try:
            popen = self._popen(spec, pipes)
            pidfd = os.pidfd_open(popen.pid)
        except (OSError, subprocess.SubprocessError) as exc:
            pipes.close_all()
            self._register_failed(spec, attempt, exc)
            return
        pipes.close_write()
        self._children.append(popen)
        self._register(spec, attempt, "spawn", popen.pid, pidfd, popen, pipes, time.monotonic() - started)

    def _popen(self, spec: RankSpec, pipes: _Pipes) -> subprocess.Popen[bytes]:
        s = self.settings
        if s.no_python:
            cmd, env = [s.entrypoint, *s.args], dict(spec.env)
        else:
            cmd = [s.python, "-m", "launcher.rank.bootstrap", *(["-m"] if s.module else []), s.entrypoint, *s.args]
            env = _launcher_env(spec.env)
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=pipes.out_w,
            stderr=pipes.err_w,
            process_group=0,
            preexec_fn=functools.partial(_spawned_child_setup, os.getpid()),
        )

    def _register_failed(self, spec: RankSpec, attempt: int, exc: BaseException) -> None:
        """A rank that could not even start is reported like a shell does: exit code 127."""
        log.error("could not start rank %d: %s", spec.global_rank, exc)
        rank = _Rank(spec=spec, attempt=attempt, how="spawn", pid=-1, status=(127, None), dead_at=time.monotonic())
        rank.tail.append(f"nvrx: could not start rank {spec.global_rank}: {exc}")
        self._ranks.append(rank)

    def _register(
        self, spec: RankSpec, attempt: int, how: str, pid: int, pidfd: int, popen: subprocess.Popen[bytes] | None, pipes: _Pipes, seconds: float
    ) -> _Rank:
        rank = _Rank(spec=spec, attempt=attempt, how=how, pid=pid, pidfd=pidfd, popen=popen)
        self._ranks.append(rank)
        self._by_pid[pid] = rank
        self._sel.register(pidfd, selectors.EVENT_READ, ("rank", rank))
        self._attach_output(rank, pipes)
        self._events.emit("rank_start", local_rank=spec.local_rank, rank=spec.global_rank, pid=pid, attempt=attempt, how=how, seconds=round(seconds, 4))
        early = self._early_exits.pop(pid, None)
        if early is not None:
            self._settle(rank, early.get("exitcode"), early.get("signal"))
        return rank

    def _attach_output(self, rank: _Rank, pipes: _Pipes) -> None:
        for which, fd in ((Std.OUT, pipes.out_r), (Std.ERR, pipes.err_r)):
            os.set_blocking(fd, False)
            file, console, prefix = self._sinks(rank.spec, rank.attempt, which)
            rank.streams.append(_Stream(fd=fd, rank=rank, file=file, console=console, prefix=prefix))
        rank.open_streams = len(rank.streams)
        assert self._relay is not None
        self._relay.add(rank.streams)

    def _sinks(self, spec: RankSpec, attempt: int, which: Std) -> tuple[BinaryIO | None, BinaryIO | None, bytes | None]:
        """torchrun semantics: redirect = file only; tee = file + prefixed console; else console."""
        lr = spec.local_rank
        redirect = which in Std(int(self.settings.redirects.get(lr, 0)))
        tee = which in Std(int(self.settings.tee.get(lr, 0)))
        flt = self.settings.local_ranks_filter
        shown = flt is None or lr in flt
        file: BinaryIO | None = None
        if redirect or tee:
            path = self._run_log_dir / f"attempt_{attempt}" / str(lr) / ("stdout.log" if which == Std.OUT else "stderr.log")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                file = open(path, "wb", buffering=0)
            except OSError as exc:
                log.warning("cannot open %s (%s); that output goes only to the failure report", path, exc)
        console = self._console[which] if shown and (tee or not redirect) else None
        prefix = f"[{spec.global_rank}]:".encode() if tee and console is not None else None
        return file, console, prefix

    # ------------------------------------------------------------ fork server

    def _start_server(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock in (ours, theirs):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, fork_server.MAX_MESSAGE)
            except OSError:
                pass
        cmd = [self.settings.python, "-m", "launcher.agent.fork_server", "--fd", str(theirs.fileno()), "--parent", str(os.getpid())]
        started = time.time()
        try:
            popen = subprocess.Popen(cmd, env=_launcher_env(self.settings.base_env), pass_fds=(theirs.fileno(),), process_group=0)
        except (OSError, subprocess.SubprocessError) as exc:
            ours.close()
            self._fall_back(f"could not start the fork server: {exc}")
            return
        finally:
            theirs.close()
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError as exc:
            popen.kill()
            popen.wait()
            ours.close()
            self._fall_back(f"cannot watch the fork server: {exc}")
            return
        ours.setblocking(False)
        link = _ServerLink(popen=popen, sock=ours, pidfd=pidfd, started=started)
        self._server = link
        self._sel.register(ours, selectors.EVENT_READ, ("server", link))
        self._sel.register(pidfd, selectors.EVENT_READ, ("server_exit", link))

    def _fork_ready(self) -> bool:
        """Whether ranks can be forked now; waits (bounded) for a server still importing torch."""
        if self._fork_off is not None:
            return False
        self.prepare()
        deadline = time.monotonic() + READY_TIMEOUT
        while self._server is not None and not self._server.ready:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill_server(f"not ready after {READY_TIMEOUT:.0f} s")
                break
            self._pump(left)
        return self._server is not None and self._fork_off is None

    def _request_fork(self, spec: RankSpec, pipes: _Pipes) -> int | None:
        """Send a spawn request; its id, or None if this rank must be spawned instead."""
        link = self._server
        if link is None or self._fork_off is not None:
            return None
        differing = _import_time_difference(spec.env, self.settings.base_env)
        if differing is not None:
            log.info("rank %d sets %s differently from the fork server; spawning it", spec.global_rank, differing)
            return None
        rid = next(self._ids)
        s = self.settings
        msg = {"op": "spawn", "id": rid, "entry": s.entrypoint, "args": list(s.args), "module": s.module, "env": dict(spec.env)}
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            try:
                fork_server.send_msg(link.sock, msg, [pipes.out_w, pipes.err_w])
                return rid
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._kill_server("its request queue is stuck")
                    return None
                select.select([], [link.sock], [], left)
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE:
                    log.warning("rank %d's environment is too large for the fork server; spawning it", spec.global_rank)
                else:
                    self._server_lost(f"cannot reach the fork server: {exc}")
                return None

    def _finish_fork(self, spec: RankSpec, attempt: int, pipes: _Pipes, rid: int, started: float) -> None:
        link = self._server
        reply = self._await_reply(rid)
        if reply is None or reply[0].get("op") != "spawned" or not reply[1]:
            if reply is not None:
                fork_server.close_fds(reply[1])
                self._fall_back(f"the fork server refused: {reply[0].get('reason')}")
            self._spawn_rank(spec, attempt, pipes, started)
            return
        msg, fds = reply
        fork_server.close_fds(fds[1:])
        pipes.close_write()
        rank = self._register(spec, attempt, "fork", int(msg["pid"]), fds[0], None, pipes, time.monotonic() - started)
        if self._server is not link and rank.status is None:  # the server died after forking it
            rank.status, rank.status_at = (None, "SIGKILL"), time.monotonic()

    def _await_reply(self, rid: int) -> tuple[dict[str, Any], list[int]] | None:
        deadline = time.monotonic() + REPLY_TIMEOUT
        while rid not in self._replies:
            if self._server is None:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill_server("no answer to a spawn request")
                return None
            self._pump(left)
        return self._replies.pop(rid)

    def _read_server(self) -> None:
        link = self._server
        while link is not None and link is self._server:
            try:
                msg, fds = fork_server.recv_msg(link.sock, 1, 1 << 16)  # replies are small
            except BlockingIOError:
                return
            except fork_server.ProtocolError as exc:
                log.warning("fork server: %s", exc)
                continue
            except OSError as exc:
                self._server_lost(f"lost the connection to the fork server: {exc}")
                return
            if msg is None:
                self._server_lost("the fork server closed its connection")
                return
            self._on_server_msg(link, msg, fds)

    def _on_server_msg(self, link: _ServerLink, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op in ("spawned", "refused"):
            self._replies[msg.get("id")] = (msg, fds)  # type: ignore[index]
            return
        fork_server.close_fds(fds)
        if op == "ready":
            link.ready = True
            seconds = round(float(msg.get("t", time.time())) - link.started, 3)
            threads = msg.get("threads")
            self._events.emit("fork_server_ready", seconds=seconds, pid=msg.get("pid"), import_seconds=msg.get("import_seconds"), threads=threads)
            if isinstance(threads, int) and threads > 1:
                log.info("the fork server has %d threads after importing torch (e.g. a BLAS pool); forking anyway", threads)
        elif op == "failed":
            self._kill_server(str(msg.get("reason")))
        elif op == "exit":
            rank = self._by_pid.get(msg.get("pid"))  # type: ignore[arg-type]
            if rank is None or rank.how != "fork":
                self._early_exits[msg.get("pid")] = msg  # type: ignore[index]
            else:
                self._settle(rank, msg.get("exitcode"), msg.get("signal"))

    def _kill_server(self, reason: str) -> None:
        if self._server is not None:
            try:
                self._server.popen.kill()
            except OSError:
                pass
            self._server_lost(reason)

    def _server_lost(self, reason: str) -> None:
        """The template is gone: its ranks die by pdeathsig; later ranks are spawned."""
        link, self._server = self._server, None
        if link is None:
            return
        self._unlink_server(link)
        code = self._reap_server(link)
        now = time.monotonic()
        for rank in self._ranks:
            if rank.how == "fork" and rank.status is None and not rank.reported:
                rank.status, rank.status_at = (None, "SIGKILL"), now
        self._fall_back(f"{reason} (exit status {code})")

    def _unlink_server(self, link: _ServerLink) -> None:
        for fileobj in (link.sock, link.pidfd):
            try:
                self._sel.unregister(fileobj)
            except (KeyError, ValueError):
                pass
        link.sock.close()
        _close_quietly(link.pidfd)

    @staticmethod
    def _reap_server(link: _ServerLink, timeout: float = 2.0) -> int | None:
        try:
            return link.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            link.popen.kill()
            try:
                return link.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("the fork server (pid %d) would not die; leaving it", link.popen.pid)
                return None

    def _shutdown_server(self) -> None:
        """Close the socket (the server exits at EOF), reap it, kill anything it left."""
        link, self._server = self._server, None
        if link is None:
            return
        try:
            leftovers = psutil.Process(link.popen.pid).children(recursive=True)
        except psutil.Error:
            leftovers = []
        self._unlink_server(link)
        self._reap_server(link)
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.Error:
                pass

    def _fall_back(self, reason: str) -> None:
        if self._fork_off is not None:
            return
        self._fork_off = reason
        self._events.emit("fork_server_fallback", reason=reason)
        log.warning("fork server unavailable (%s); starting ranks as new processes", reason)
