"""The control channel between a training process and its checkpoint writer: JSON lines over a socketpair.

Only JSON crosses the process boundary (no pickle). A message may carry file descriptors
(SCM_RIGHTS): the staging buffers are memfds handed over this way, so no shared-memory name
is ever visible in the file system. The socketpair has no name either: only the two processes
that hold its ends can use it.
"""

from __future__ import annotations

import array
import json
import os
import socket
from collections import deque
from typing import Any

from nvrx.common.errors import NvrxError
_MAX_FDS = 16
_CHUNK = 1 << 16


class ChannelClosed(NvrxError, EOFError):
    """The other end of the channel is gone (the process exited or was killed)."""


class Channel:
    """One end of the socketpair: send and receive JSON objects, optionally with file descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self._closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        if fds:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            sent = self.sock.sendmsg([data], anc)
            data = data[sent:]
        if data:
            self.sock.sendall(data)

    def _fill(self, block: bool) -> bool:
        """Read what is available (or wait for something when BLOCK); False when nothing came."""
        self.sock.setblocking(block)
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(_CHUNK, socket.CMSG_SPACE(_MAX_FDS * 4))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        finally:
            self.sock.setblocking(True)
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if not data:
            self._closed = True
            raise ChannelClosed("the other end closed the channel")
        self._buf += data
        return True

    def _pop_line(self) -> dict[str, Any] | None:
        end = self._buf.find(b"\n")
        if end < 0:
            return None
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError(f"control message is not a JSON object: {line[:80]!r}")
        return message

    def recv(self, block: bool = True) -> dict[str, Any] | None:
        """The next message; None if BLOCK is false and no whole message has arrived yet."""
        while True:
            message = self._pop_line()
            if message is not None:
                return message
            if self._closed:
                raise ChannelClosed("the other end closed the channel")
            if not self._fill(block) and not block:
                return None

    def take_fd(self) -> int:
        """The next file descriptor that arrived with a message (in send order)."""
        if not self._fds:
            raise ValueError("a message announced a file descriptor that did not arrive")
        return self._fds.popleft()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        while self._fds:
            try:
                os.close(self._fds.popleft())
            except OSError:
                pass
