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


def _own_socket_fds() -> dict[int, int]:
    """inode -> one fd of this process for each socket it has open."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.setdefault(int(target[8:-1]), int(name))
    return found


def _tcp_socket(inode: int, fd: int) -> TcpSocket | None:
    """Describe FD if it still is socket INODE and a TCP (IPv4/IPv6 stream) socket, else None."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:
            return None  # closed and reused since we listed it
        sock = socket.socket(fileno=dup)  # owns the duplicate from here on
        dup = -1
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return None
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        return TcpSocket(inode, fd, listening)
    except OSError:
        return None
    finally:
        if dup >= 0:
            os.close(dup)


def mark_iteration_start() -> None:
    """Remember the sockets open now; only listeners created after this count as gloo's."""
    global _baseline
    inodes = frozenset(_own_socket_fds())
    with _lock:
        _baseline = inodes


def _epoll_watch_lists() -> list[set[int]]:
    """For each epoll instance of this process, the inodes of the files it watches (from fdinfo)."""
    lists: list[set[int]] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return lists
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as fh:
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
    try:
        dup = os.dup(sock.fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != sock.inode:
            return False  # closed and reused since we listed it
        handle = socket.socket(fileno=dup)
        dup = -1
        with handle:
            handle.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        if dup >= 0:
            os.close(dup)


def shutdown_gloo_connections() -> int:
    """Shut down this iteration's gloo pair connections; returns how many were shut down."""
    targets = gloo_connections()
    done = sum(_shutdown(s) for s in targets)
    if targets:
        log.debug("shut down %d of %d gloo connection(s)", done, len(targets))
    return done
