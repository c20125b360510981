"""The agent's side of the fork server (nvrx/launcher/agent/fork_server.py): start it, ask it to fork ranks,
read its replies and exit reports, and fall back to spawning when it is unusable.

The client owns no event loop: it registers the server's socket and pidfd in the worker group's
selector and waits by calling the group's pump, so a rank exit and a server reply wake the same
select(). What the server reports about ranks goes back to the group through two callbacks.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import select
import selectors
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil

from nvrx.common.process import python_module_command
from nvrx.launcher.agent import fork_server
from nvrx.launcher.agent.config import WorkerSettings
from nvrx.launcher.rank import bootstrap
from nvrx.events import EventLog, ForkServerFallback, ForkServerReady

log = logging.getLogger(__name__)

READY_TIMEOUT = 60.0  # the fork server is importing torch already: waiting beats a second import
REPLY_TIMEOUT = 30.0
# Read when the interpreter / torch's native libraries load, so a forked rank would keep the
# template's values: a rank whose environment differs in these is spawned instead.
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_")

Reply = tuple[dict[str, Any], list[int]]


@dataclass(eq=False)
class ServerLink:
    """One running fork server: a new link after every restart, so stale selector keys are told apart."""

    popen: subprocess.Popen[bytes]
    sock: socket.socket
    pidfd: int
    started: float  # wall clock, comparable with the server's own "t"
    ready: bool = False


def import_time_difference(env: Mapping[str, str], base: Mapping[str, str]) -> str | None:
    """The first variable read at import time whose value differs between ENV and BASE."""
    for key in sorted(set(env) | set(base)):
        if key != "PYTHONPATH" and key.startswith(IMPORT_TIME_ENV) and env.get(key) != base.get(key):
            return key
    return None


class ForkClient:
    """Talks to one fork server at a time; once it is lost or refuses, every later rank is spawned."""

    def __init__(
        self,
        settings: WorkerSettings,
        events: EventLog,
        sel: selectors.BaseSelector,
        pump: Callable[[float | None], object],
        on_exit: Callable[[dict[str, Any]], None],
        on_lost: Callable[[], None],
    ) -> None:
        self.settings = settings
        self._events = events
        self._sel = sel
        self._pump = pump  # the group's event loop: handles whatever is ready, up to a timeout
        self._on_exit = on_exit  # the server reaped a rank it forked: {"pid", "exitcode", "signal"}
        self._on_lost = on_lost  # the server is gone; the ranks it forked die by pdeathsig
        self._replies: dict[int, Reply] = {}
        self._ids = itertools.count(1)
        self._server: ServerLink | None = None
        self._fork_off: str | None = None if settings.fork_server and not settings.no_python else "disabled"

    @property
    def link(self) -> ServerLink | None:
        """The running server, if any (compared by identity to notice a restart)."""
        return self._server

    @property
    def usable(self) -> bool:
        """False once forking is off for good (disabled, or the server failed)."""
        return self._fork_off is None

    def start(self) -> None:
        """Start the server unless it runs already or forking is off."""
        if self._fork_off is not None or self._server is not None:
            return
        self._start_server()

    def wait_ready(self) -> bool:
        """Whether ranks can be forked now; waits (bounded) for a server still importing torch."""
        deadline = time.monotonic() + READY_TIMEOUT
        while self._server is not None and not self._server.ready:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill_server(f"not ready after {READY_TIMEOUT:.0f} s")
                break
            self._pump(left)
        return self._server is not None and self._fork_off is None

    def request(self, spec_env: Mapping[str, str], global_rank: int, fds: tuple[int, int]) -> int | None:
        """Send a spawn request with the rank's (stdout, stderr) FDS; its id, or None if this rank must be spawned instead."""
        link = self._server
        if link is None or self._fork_off is not None:
            return None
        differing = import_time_difference(spec_env, self.settings.base_env)
        if differing is not None:
            log.info("rank %d sets %s differently from the fork server; spawning it", global_rank, differing)
            return None
        rid = next(self._ids)
        s = self.settings
        msg = {"op": "spawn", "id": rid, "entry": s.entrypoint, "args": list(s.args), "module": s.module, "env": dict(spec_env)}
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            try:
                fork_server.send_msg(link.sock, msg, list(fds))
                return rid
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._kill_server("its request queue is stuck")
                    return None
                select.select([], [link.sock], [], left)
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE:
                    log.warning("rank %d's environment is too large for the fork server; spawning it", global_rank)
                else:
                    self._server_lost(f"cannot reach the fork server: {exc}")
                return None

    def await_reply(self, rid: int) -> Reply | None:
        """The server's answer to request RID ("spawned" + [pidfd], or "refused"); None if the server is gone."""
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

    def on_readable(self, link: ServerLink) -> None:
        """The pump saw LINK's socket readable."""
        if link is self._server:
            self._read_server()

    def on_exited(self, link: ServerLink) -> None:
        """The pump saw LINK's pidfd readable: read what it sent before dying, then give it up."""
        if link is self._server:
            self._read_server()  # exit messages it sent before dying
            if link is self._server:
                self._server_lost("the fork server exited")

    def fall_back(self, reason: str) -> None:
        """Stop forking for good: every later rank is spawned."""
        if self._fork_off is not None:
            return
        self._fork_off = reason
        self._events.emit(ForkServerFallback(reason=reason))
        log.warning("fork server unavailable (%s); starting ranks as new processes", reason)

    def shutdown(self) -> None:
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

    # ------------------------------------------------------------ internals

    def _start_server(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock in (ours, theirs):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, fork_server.MAX_MESSAGE)
            except OSError:
                pass
        cmd = python_module_command(self.settings.python, "nvrx.launcher.agent.fork_server", "--fd", str(theirs.fileno()),
                                    "--parent", str(os.getpid()))
        started = time.time()
        try:
            popen = subprocess.Popen(cmd, env=dict(self.settings.base_env), pass_fds=(theirs.fileno(),), process_group=0)
        except (OSError, subprocess.SubprocessError) as exc:
            ours.close()
            self.fall_back(f"could not start the fork server: {exc}")
            return
        finally:
            theirs.close()
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError as exc:
            popen.kill()
            popen.wait()
            ours.close()
            self.fall_back(f"cannot watch the fork server: {exc}")
            return
        ours.setblocking(False)
        link = ServerLink(popen=popen, sock=ours, pidfd=pidfd, started=started)
        self._server = link
        self._sel.register(ours, selectors.EVENT_READ, ("server", link))
        self._sel.register(pidfd, selectors.EVENT_READ, ("server_exit", link))

    def _read_server(self) -> None:
        link = self._server
        while link is not None and link is self._server:
            try:
                msg, fds = fork_server.recv_msg(link.sock, 1, 1 << 16)  # replies are small
            except BlockingIOError:
                return
            except fork_server.ForkServerProtocolError as exc:
                log.warning("fork server: %s", exc)
                continue
            except OSError as exc:
                self._server_lost(f"lost the connection to the fork server: {exc}")
                return
            if msg is None:
                self._server_lost("the fork server closed its connection")
                return
            self._on_server_msg(link, msg, fds)

    def _on_server_msg(self, link: ServerLink, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op in ("spawned", "refused"):
            self._replies[msg.get("id")] = (msg, fds)  # type: ignore[index]
            return
        fork_server.close_fds(fds)
        if op == "ready":
            link.ready = True
            seconds = round(float(msg.get("t", time.time())) - link.started, 3)
            threads = msg.get("threads")
            self._events.emit(ForkServerReady(seconds=seconds, pid=msg.get("pid"), import_seconds=msg.get("import_seconds"), threads=threads))
            if isinstance(threads, int) and threads > 1:
                log.info("the fork server has %d threads after importing torch (e.g. a BLAS pool); forking anyway", threads)
        elif op == "failed":
            self._kill_server(str(msg.get("reason")))
        elif op == "exit":
            self._on_exit(msg)

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
        self._on_lost()
        self.fall_back(f"{reason} (exit status {code})")

    def _unlink_server(self, link: ServerLink) -> None:
        for fileobj in (link.sock, link.pidfd):
            try:
                self._sel.unregister(fileobj)
            except (KeyError, ValueError):
                pass
        link.sock.close()
        fork_server.close_fds([link.pidfd])

    @staticmethod
    def _reap_server(link: ServerLink, timeout: float = 2.0) -> int | None:
        try:
            return link.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            link.popen.kill()
            try:
                return link.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("the fork server (pid %d) would not die; leaving it", link.popen.pid)
                return None
