"""The ranks of one node: start them (forked from the template or spawned), watch them, stop them.

Exits are noticed without polling: every rank has a pidfd in one selector together with the fork
server's socket (nvrx/launcher/agent/fork_client.py), so :meth:`WorkerGroup.wait` sleeps in the kernel
until something happens. Output goes through one relay thread (nvrx/launcher/agent/output_relay.py),
which also keeps the last lines of each rank for the failure report.

Use a WorkerGroup from one long-lived thread (the agent's main thread): PR_SET_PDEATHSIG fires
when the *thread* that started a process exits, not only the process.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

import psutil

from nvrx.common.process import python_module_command, die_with_parent
from nvrx.common.files import open_private

from nvrx.launcher.agent import fork_server
from nvrx.launcher.agent.config import Std, WorkerSettings
from nvrx.launcher.agent.fork_client import ForkClient, ServerLink, import_time_difference
from nvrx.launcher.agent.output_relay import OutputStream, RankOutput, Relay, binary_console
from nvrx.events import AgentKilledRank, EventLog, RankExit as RankExitEvent, RankStart, RankStuck

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 1.0  # after a rank died, how long grandchildren may keep its pipes open before we report anyway
FORK_WINDOW = 8  # fork requests in flight: the server forks one at a time; more only delays a stop
STATUS_TIMEOUT = 30.0  # a forked rank died; the server's exit message follows (later while the template warms up)


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
    output: RankOutput = field(init=False)  # its pipes and last lines, shared with the relay thread
    reported: bool = False
    abandoned: bool = False
    state: str | None = None
    descendants: dict[int, psutil.Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.output = RankOutput(self.spec.local_rank)

    @property
    def running(self) -> bool:
        return self.pid > 0 and self.dead_at is None and not self.reported


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


def _with_attempt(item: tuple[RankSpec, _Pipes, int, float], attempt: int) -> tuple[Any, ...]:
    """A requested fork (spec, pipes, request id, start time) as _finish_fork's arguments."""
    spec, pipes, rid, started = item
    return spec, attempt, pipes, rid, started


def _close_quietly(*fds: int) -> None:
    fork_server.close_fds(fds)


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


def _spawned_child_setup(parent_pid: int) -> None:
    """preexec_fn of a spawned rank: die with the agent, and start with no blocked signals."""
    die_with_parent(parent_pid)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


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
        self._console = {Std.OUT: binary_console(console_out, sys.stdout), Std.ERR: binary_console(console_err, sys.stderr)}
        self._sel = selectors.DefaultSelector()
        self._notify_r, self._notify_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._notify_r, selectors.EVENT_READ, ("notify", None))
        self._lock = threading.Lock()
        self._relay: Relay | None = None
        self._ranks: list[_Rank] = []
        self._by_pid: dict[int, _Rank] = {}
        self._early_exits: dict[int, dict[str, Any]] = {}  # exit reports that arrived before the fork reply
        self._fork = ForkClient(settings, events, self._sel, self._pump, self._on_forked_exit, self._on_server_lost)
        self._children: list[subprocess.Popen[bytes]] = []  # spawned ranks, reaped at close
        self._asked: tuple[float, str] | None = None  # when and by which signal this attempt's ranks were asked to stop
        self._closed = False

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ public API

    def prepare(self) -> None:
        """Start the fork server now so its `import torch` overlaps with the agent's own work."""
        if self._closed:
            return
        self._fork.start()

    def start(self, specs: list[RankSpec], attempt: int, stop: Callable[[], bool] = lambda: False) -> None:
        """Start every rank of this node for restart attempt ATTEMPT.

        STOP (the agent got a signal) ends the starting early: hundreds of ranks take seconds to start, and a
        SIGTERM must not wait for that. Forks already requested are still registered, so the caller can stop
        every rank that started.
        """
        if self._closed:
            raise RuntimeError("WorkerGroup is closed")
        if any(not r.reported for r in self._ranks):
            raise RuntimeError("ranks of the previous attempt are still live; stop() them first")
        self._ranks, self._by_pid, self._early_exits, self._asked = [], {}, {}, None
        if self._relay is None:
            self._relay = Relay(self._lock, self._on_drained)
        forkable = any(import_time_difference(spec.env, self.settings.base_env) is None for spec in specs)
        use_fork = forkable and self._fork_ready()
        requested: collections.deque[tuple[RankSpec, _Pipes, int, float]] = collections.deque()
        for n, spec in enumerate(specs):
            if stop():
                log.info("stopping: %d of %d ranks not started", len(specs) - n, len(specs))
                break
            pipes, started = _Pipes.open(), time.monotonic()
            rid = self._fork.request(spec.env, spec.global_rank, (pipes.out_w, pipes.err_w)) if use_fork else None
            if rid is None:
                self._spawn_rank(spec, attempt, pipes, started)
                continue
            requested.append((spec, pipes, rid, started))
            if len(requested) >= FORK_WINDOW:  # keeps the server busy, and a stop waits for a few forks at most
                self._finish_fork(*_with_attempt(requested.popleft(), attempt))
        for item in requested:
            self._finish_fork(*_with_attempt(item, attempt))

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

    def running_pids(self) -> list[int]:
        """Pids of the ranks still running, as the agent last saw them (for a thread that cannot wait itself)."""
        return [r.pid for r in list(self._ranks) if r.running]

    def signal_all(self, sig: int) -> None:
        """Forward SIG to the process group of every running rank."""
        self._asked = self._asked or (time.monotonic(), signal.Signals(sig).name)
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
            self._asked = self._asked or (time.monotonic(), "SIGTERM")
            self._signal_running(live, signal.SIGTERM)
            if not self._wait_until(lambda: not any(r.running for r in live), grace):
                self._report_kills(live)
                self._signal_running(live, signal.SIGKILL)
                self._wait_until(lambda: not any(r.running for r in live), self.settings.kill_timeout)
            for rank in live:
                if rank.running:
                    self._abandon(rank)
        self._sweep(self._ranks)
        # a live fork server sends the exit statuses of its ranks, late while its template warms up
        bound = STATUS_TIMEOUT if self._fork.link is not None else DRAIN_TIMEOUT + 0.5
        self._wait_until(lambda: all(r.reported or r.abandoned or self._reportable(r, time.monotonic())[0]
                                     for r in live), bound)
        return [self._report(r) for r in live if not r.reported]

    def close(self) -> None:
        """Stop the ranks and the fork server and kill anything they left; idempotent."""
        if self._closed:
            return
        try:
            self.stop()
        finally:
            self._closed = True
            self._fork.shutdown()
            self._reap_children()
            if self._relay is not None:
                self._relay.stop()
            self._sel.close()
            _close_quietly(self._notify_r, self._notify_w)

    # ------------------------------------------------------------ event loop

    def _pump(self, timeout: float | None) -> bool:
        """Handle what is ready (waiting up to TIMEOUT); True if a caller's wake fd is readable."""
        woken = False
        server_exited: ServerLink | None = None
        for key, _ in self._sel.select(timeout):
            kind, obj = key.data
            if kind == "notify":
                self._drain_notify()
            elif kind == "wake":
                woken = True
            elif kind == "server":
                self._fork.on_readable(obj)
            elif kind == "server_exit":
                server_exited = obj
            elif kind == "rank":
                self._on_rank_pidfd(obj)
        if server_exited is not None:
            self._fork.on_exited(server_exited)
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

    def _on_drained(self, output: RankOutput) -> None:
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
        if rank.output.open_streams > 0:
            due = rank.dead_at + DRAIN_TIMEOUT
            if now < due:
                return False, due
        return True, None

    def _collect(self, now: float) -> tuple[list[RankExit], float | None]:
        """The exits reportable now, in the order the ranks died: when several are reported together (their
        statuses or output arrived late), the first to die is the likely cause and the others its victims."""
        ready_ranks: list[_Rank] = []
        next_due: float | None = None
        for rank in self._ranks:
            ready, due = self._reportable(rank, now)
            if ready:
                ready_ranks.append(rank)
            elif due is not None:
                next_due = due if next_due is None else min(next_due, due)
        ready_ranks.sort(key=lambda r: r.dead_at if r.dead_at is not None else math.inf)
        return [self._report(rank) for rank in ready_ranks], next_due

    def _report(self, rank: _Rank) -> RankExit:
        rank.reported = True
        self._drop_pidfd(rank)
        exitcode, sig = rank.status or (None, None)
        if rank.abandoned:
            exitcode, sig = None, None
        with self._lock:
            tail = rank.output.last_lines()
        exit_ = RankExit(
            local_rank=rank.spec.local_rank,
            global_rank=rank.spec.global_rank,
            pid=rank.pid,
            exitcode=exitcode,
            signal=sig,
            tail=tail,
            abandoned=rank.abandoned,
            state=rank.state,
        )
        self._events.emit(RankExitEvent(
            local_rank=rank.spec.local_rank,
            rank=rank.spec.global_rank,
            pid=rank.pid,
            exitcode=exitcode,
            signal=sig,
            attempt=rank.attempt,
            abandoned=rank.abandoned,
        ))
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
        self._events.emit(RankStuck(
            local_rank=rank.spec.local_rank,
            rank=rank.spec.global_rank,
            pid=rank.pid,
            attempt=rank.attempt,
            state=rank.state,
            status=status,
        ))
        log.warning("rank %d (pid %d) did not die after SIGKILL (state %s); abandoning it", rank.spec.global_rank, rank.pid, rank.state)

    # ------------------------------------------------------------ stopping

    def _report_kills(self, ranks: Sequence[_Rank]) -> None:
        """The ranks about to get SIGKILL: still running when the stop's grace ran out (they ignored the signal)."""
        at, asked = self._asked or (time.monotonic(), "SIGTERM")
        waited = round(time.monotonic() - at, 3)
        for rank in ranks:
            if rank.running:
                log.info("rank %d (pid %d) still running %.1f s after %s; sending SIGKILL", rank.spec.global_rank,
                         rank.pid, waited, asked)
                self._events.emit(AgentKilledRank(local_rank=rank.spec.local_rank, rank=rank.spec.global_rank,
                                                  pid=rank.pid, attempt=rank.attempt, signal="SIGKILL", after=asked,
                                                  waited=waited))

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
            cmd = python_module_command(s.python, "nvrx.launcher.rank.bootstrap", *(["-m"] if s.module else []),
                                        s.entrypoint, *s.args)
            env = dict(spec.env)
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
        rank.output.tail.append(f"nvrx: could not start rank {spec.global_rank}: {exc}")
        self._ranks.append(rank)

    def _register(
        self, spec: RankSpec, attempt: int, how: str, pid: int, pidfd: int, popen: subprocess.Popen[bytes] | None, pipes: _Pipes, seconds: float
    ) -> _Rank:
        rank = _Rank(spec=spec, attempt=attempt, how=how, pid=pid, pidfd=pidfd, popen=popen)
        self._ranks.append(rank)
        self._by_pid[pid] = rank
        self._sel.register(pidfd, selectors.EVENT_READ, ("rank", rank))
        self._attach_output(rank, pipes)
        self._events.emit(RankStart(local_rank=spec.local_rank, rank=spec.global_rank, pid=pid, attempt=attempt, how=how, seconds=round(seconds, 4)))
        early = self._early_exits.pop(pid, None)
        if early is not None:
            self._settle(rank, early.get("exitcode"), early.get("signal"))
        return rank

    def _attach_output(self, rank: _Rank, pipes: _Pipes) -> None:
        for which, fd in ((Std.OUT, pipes.out_r), (Std.ERR, pipes.err_r)):
            os.set_blocking(fd, False)
            file, console, prefix = self._sinks(rank.spec, rank.attempt, which)
            rank.output.streams.append(OutputStream(fd=fd, output=rank.output, file=file, console=console, prefix=prefix))
        rank.output.open_streams = len(rank.output.streams)
        assert self._relay is not None
        self._relay.add(rank.output.streams)

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
                # private (0600 in 0700 directories) whatever the umask: other users must not read a job's output;
                # a new file, never a link or a file planted there (open_private)
                file = open(open_private(path, os.O_WRONLY, fresh=True), "wb", buffering=0)
            except OSError as exc:
                log.warning("cannot open %s (%s); that output goes only to the failure report", path, exc)
        console = self._console[which] if shown and (tee or not redirect) else None
        prefix = f"[{spec.global_rank}]:".encode() if tee and console is not None else None
        return file, console, prefix


    # ------------------------------------------------------------ forked ranks

    def _fork_ready(self) -> bool:
        """Whether ranks can be forked now; waits (bounded) for a server still importing torch."""
        if not self._fork.usable:
            return False
        self.prepare()
        return self._fork.wait_ready()

    def _finish_fork(self, spec: RankSpec, attempt: int, pipes: _Pipes, rid: int, started: float) -> None:
        link = self._fork.link
        reply = self._fork.await_reply(rid)
        if reply is None or reply[0].get("op") != "spawned" or not reply[1]:
            if reply is not None:
                fork_server.close_fds(reply[1])
                self._fork.fall_back(f"the fork server refused: {reply[0].get('reason')}")
            self._spawn_rank(spec, attempt, pipes, started)
            return
        msg, fds = reply
        fork_server.close_fds(fds[1:])
        pipes.close_write()
        rank = self._register(spec, attempt, "fork", int(msg["pid"]), fds[0], None, pipes, time.monotonic() - started)
        if self._fork.link is not link and rank.status is None:  # the server died after forking it
            rank.status, rank.status_at = (None, "SIGKILL"), time.monotonic()

    def _on_forked_exit(self, msg: dict[str, Any]) -> None:
        """The fork server reaped a rank; its exit may arrive before the spawn reply was handled."""
        rank = self._by_pid.get(msg.get("pid"))  # type: ignore[arg-type]
        if rank is None or rank.how != "fork":
            self._early_exits[msg.get("pid")] = msg  # type: ignore[index]
        else:
            self._settle(rank, msg.get("exitcode"), msg.get("signal"))

    def _on_server_lost(self) -> None:
        """The template is gone: the ranks it forked die by pdeathsig, so count them as SIGKILLed."""
        now = time.monotonic()
        for rank in self._ranks:
            if rank.how == "fork" and rank.status is None and not rank.reported:
                rank.status, rank.status_at = (None, "SIGKILL"), now
