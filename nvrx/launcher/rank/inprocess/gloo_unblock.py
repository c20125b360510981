"""Unblock a gloo collective that waits on a peer, by shutting down gloo's TCP connections.

Measured with torch 2.13 (CPU): ``ProcessGroupGloo.abort()``, ``.shutdown()`` and
``destroy_process_group()`` all return at once, yet a rank blocked in ``all_reduce`` on a peer that is
alive but not taking part stays blocked until the gloo timeout (30 min by default). What does end it
at once is ``shutdown(2)`` on the gloo pair connection: the blocked call raises "Connection closed by
peer" within milliseconds, on both ends of the connection.

Which sockets are gloo's: every gloo device runs an epoll loop that watches its listening socket and
all its pair connections (measured: one epoll per device, listener + one socket per peer, both the
connections it accepted and those it opened). So this module looks for epoll instances of this
process that watch a TCP listener created during the current iteration (the Wrapper records the
sockets that existed before it, ``mark_iteration_start``) and shuts down the other TCP sockets that
epoll watches. The Wrapper's own stores predate the iteration and are left alone, as is anything the
program opened earlier; a TCP server started inside the wrapped function would be treated like gloo.
Both ends of every connection fail at once, so one live rank's abort is enough to free its peers.

Never shut down a gloo *listener*: gloo's accept thread treats the error as fatal and aborts the
process (``listener.cc: accept: Invalid argument``, measured).

Fallback where this cannot work (another OS, no /proc): give the gloo group a short timeout,
``init_process_group("gloo", timeout=timedelta(seconds=...))``, so a blocked collective fails on its own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

_lock = threading.Lock()
_baseline: frozenset[int] | None = None


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    fd: int
    listening: bool


def _fd_targets() -> list[tuple[int, str]]:
    """(fd, what it points at) for each descriptor of this process; [] without /proc."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    found = []
    for name in names:
        try:
            found.append((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:
            continue
    return found


def _own_socket_fds() -> dict[int, int]:
    """inode -> one fd of this process for each socket it has open."""
    found: dict[int, int] = {}
    for fd, target in _fd_targets():
        if target.startswith("socket:["):
            found.setdefault(int(target[8:-1]), fd)
    return found


def _reopen(fd: int, inode: int) -> socket.socket | None:
    """A socket object on a duplicate of FD, or None when FD no longer is socket INODE (closed and reused)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino == inode:
            return socket.socket(fileno=dup)  # owns the duplicate from here on
    except OSError:
        pass
    os.close(dup)
    return None


def _tcp_socket(inode: int, fd: int) -> TcpSocket | None:
    """Describe FD if it still is socket INODE and a TCP (IPv4/IPv6 stream) socket, else None."""
    sock = _reopen(fd, inode)
    if sock is None:
        return None
    with sock:
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return None
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        except OSError:
            return None
    return TcpSocket(inode, fd, listening)


def mark_iteration_start() -> None:
    """Remember the sockets open now; only listeners created after this count as gloo's."""
    global _baseline
    inodes = frozenset(_own_socket_fds())
    with _lock:
        _baseline = inodes


def _epoll_watch_lists() -> list[set[int]]:
    """For each epoll instance of this process, the inodes of the files it watches (from fdinfo)."""
    lists: list[set[int]] = []
    for fd, target in _fd_targets():
        if target != "anon_inode:[eventpoll]":
            continue
        try:
            with open(f"/proc/self/fdinfo/{fd}") as fh:
                info = fh.read()
        except OSError:
            continue
        inodes = set()
        for line in info.splitlines():
            if line.startswith("tfd:") and " ino:" in line:
                inodes.add(int(line.split(" ino:", 1)[1].split()[0], 16))
        lists.append(inodes)
    return lists


def gloo_connections() -> list[TcpSocket]:
    """TCP connections watched by an epoll that also watches a listener opened since ``mark_iteration_start``."""
    with _lock:
        baseline = _baseline
    if baseline is None:
        return []
    fds = _own_socket_fds()
    found: dict[int, TcpSocket] = {}
    for watched in _epoll_watch_lists():
        sockets = [s for s in (_tcp_socket(i, fds[i]) for i in watched if i in fds) if s is not None]
        if any(s.listening and s.inode not in baseline for s in sockets):
            found.update((s.inode, s) for s in sockets if not s.listening)
    return list(found.values())


def _shutdown(sock: TcpSocket) -> bool:
    """shutdown(2) the socket behind SOCK.fd, unless that fd now names another socket."""
    handle = _reopen(sock.fd, sock.inode)
    if handle is None:
        return False
    with handle:
        try:
            handle.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def shutdown_gloo_connections() -> int:
    """Shut down this iteration's gloo pair connections; returns how many were shut down."""
    targets = gloo_connections()
    done = sum(_shutdown(s) for s in targets)
    if targets:
        log.debug("shut down %d of %d gloo connection(s)", done, len(targets))
    return done
