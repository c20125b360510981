"""Addresses and listening sockets: bind exactly the address asked for, never the wildcard.

Shared by the agent's rendezvous store and the in-process restart's stores (both host a ``TCPStore`` on
a socket we bound ourselves, so the store cannot fall back to listening on every interface).
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)

DEFAULT_OP_TIMEOUT = 300.0  # blocking get/wait on keys that are about to be set


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def free_port_socket(host: str) -> socket.socket:
    """A listening socket on HOST with a kernel-chosen free port (no pick-then-bind race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    return sock


def is_loopback_ip(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def local_addresses() -> set[str]:
    """Every IP address configured on this machine's interfaces."""
    out: set[str] = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.add(a.address.split("%", 1)[0])
    return out


def resolve(host: str) -> list[str]:
    """IP addresses of HOST, IPv4 first (what most clusters route on); [] if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    addrs = list(dict.fromkeys(info[4][0].split("%", 1)[0] for info in infos))
    return sorted(addrs, key=lambda a: ":" in a)


def local_bind_address(host: str) -> str | None:
    """The address of this machine that HOST names, or None when HOST is another machine.

    A non-loopback match wins: a hostname mapped to 127.0.1.1 in /etc/hosts still has to be
    reachable from the other nodes through the real interface.
    """
    mine = local_addresses()
    matches = [a for a in resolve(host) if a in mine or is_loopback_ip(a)]
    if not matches:
        return None
    real = [a for a in matches if not is_loopback_ip(a)]
    if not real and not is_loopback(host):
        log.warning(
            "rendezvous endpoint %s resolves to loopback %s here; other nodes may not reach it", host, matches[0]
        )
    return (real or matches)[0]


def bind_listen(addr: str, port: int) -> socket.socket:
    """A listening socket on exactly ADDR:PORT (never the wildcard address)."""
    if port == 0:
        return free_port_socket(addr)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def port_in_use(port: int) -> str | None:
    """Why PORT cannot be listened on by a server binding every address (as torch's own TCPStore does for
    rank 0 with a fixed MASTER_PORT), or None if it can. SO_REUSEADDR as that server: a port whose last
    user is gone (TIME_WAIT) counts as free; one another listener holds does not."""
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:  # bind only: Linux refuses it while another socket listens there; nothing is ever accepted
                sock.bind((wildcard, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return exc.strerror or "address already in use"
    return None


def serve_store(sock: socket.socket, host: str, timeout: float = DEFAULT_OP_TIMEOUT) -> TCPStore:
    """Run a TCPStore server on an already listening socket.

    The store takes ownership of the descriptor (it closes it when destroyed), so on success
    the Python socket object is detached and can never close a number the store still uses.
    """
    try:
        from torch.distributed import TCPStore  # torch only where a store is hosted

        store = TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            master_listen_fd=sock.fileno(),
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except Exception:
        sock.close()
        raise
    sock.detach()
    return store


def start_store_server(addr: str, timeout: float = DEFAULT_OP_TIMEOUT) -> tuple[TCPStore, int]:
    """A fresh TCPStore server on ADDR and a kernel-chosen free port; returns (store, port)."""
    sock = free_port_socket(addr)
    port = sock.getsockname()[1]
    return serve_store(sock, addr, timeout), port
