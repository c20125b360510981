"""The control channel between a rank and its monitor: JSON lines over a Unix stream socket.

The socket lives in a private directory (0700, owned by us) and is itself 0600. Every message is one
JSON object on one line (never pickle). Requests carry ``op``; replies carry ``ok`` and either the
op's fields or ``error``. Ops (rank -> monitor):

  ``init``            {token, pid, sections?}  -> {rank, generation, sections: {name: id}, timeouts}
  ``sections``        {names}                  -> {sections}           register more section names
  ``calculate_and_set_timeouts``               -> {updated, timeouts, calculated}  and persisted to the state dir
  ``observed``                                 -> {observed, sections}  observed maxima (for the ranks to agree on)
  ``set_calculated``  {values}                 -> {timeouts, calculated, sections}  learn from the agreed maxima;
                                                  persisted
  ``state_dict``                               -> {state}
  ``load_state_dict`` {state}                  -> {timeouts}
  ``shutdown``                                 -> {}                   the rank's run ends (monitor stays)
  ``workload_control`` {action, description}  -> {forwarded}          passed to the agent (spec 001)
  ``checkpoint``      {step, tier, taken, path} -> {}                  a complete checkpoint: event checkpoint_complete
  ``checkpoint_interval`` {every_steps, why, ...} -> {}               every_steps="auto" chose: event checkpoint_interval
  ``stop_monitor``    {token}                  -> {}                   the monitor exits (agent use)

Only ``init``/``stop_monitor`` are accepted before a successful ``init``; a wrong token gets an error
reply and the connection is closed.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from nvrx.common.errors import NvrxError
MAX_LINE = 1 << 20


class MonitorProtocolError(NvrxError):
    """A peer sent something that is not a JSON-object line, or a line that is too long."""


class MonitorError(NvrxError, RuntimeError):
    """The monitor refused a request (the reply's ``error``)."""


def ensure_private_dir(path: Path) -> Path:
    """Create PATH (mode 0700) if needed; refuse a directory owned by someone else; tighten to 0700."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":"), allow_nan=False) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise MonitorProtocolError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MonitorProtocolError("a message must be a JSON object")
    return obj


class LineBuffer:
    """Splits a byte stream into decoded JSON-object lines."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any] | MonitorProtocolError]:
        self._buf += data
        out: list[dict[str, Any] | MonitorProtocolError] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > MAX_LINE:
                    raise MonitorProtocolError("message too long")
                return out
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            try:
                out.append(decode(line))
            except MonitorProtocolError as exc:
                out.append(exc)


def listen(path: Path) -> socket.socket:
    """Bind a listening Unix socket at PATH (mode 0600) inside a private dir; replaces a stale socket."""
    path = Path(path)
    ensure_private_dir(path.parent)
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(16)
    sock.setblocking(False)
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected SOCK (SO_PEERCRED)."""
    import struct

    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class Channel:
    """Client side: blocking request/response over one connection."""

    def __init__(self, sock: socket.socket, timeout: float = 30.0) -> None:
        self.sock = sock
        self.timeout = timeout
        self._lines = LineBuffer()
        self._pending: list[dict[str, Any] | MonitorProtocolError] = []

    @classmethod
    def connect(cls, path: Path, connect_timeout: float = 30.0, timeout: float = 30.0) -> "Channel":
        """Connect to PATH, retrying while the monitor is not listening yet."""
        deadline = time.monotonic() + connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                return cls(sock, timeout)
            except OSError as exc:
                sock.close()
                retry = exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN)
                if not retry or time.monotonic() >= deadline:
                    raise ConnectionError(f"cannot reach the rank monitor at {path}: {exc}") from exc
                time.sleep(0.05)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request, return the reply's fields; MonitorError if the monitor refused it."""
        self.sock.settimeout(self.timeout)
        self.sock.sendall(encode({"op": op, **fields}))
        reply = self._read()
        if not reply.get("ok"):
            raise MonitorError(str(reply.get("error") or f"the monitor refused {op!r}"))
        return reply

    def _read(self) -> dict[str, Any]:
        while not self._pending:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the rank monitor closed the connection")
            self._pending.extend(self._lines.feed(data))
        item = self._pending.pop(0)
        if isinstance(item, MonitorProtocolError):
            raise item
        return item

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
