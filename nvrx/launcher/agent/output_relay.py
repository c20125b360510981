"""Rank output: one thread moves every rank's stdout/stderr to its log file and/or the console and
keeps the last lines of each rank for the failure report.

One thread with a selector, not a thread per pipe: a node may run many ranks, and a rank that
writes a partial line (a progress bar) must still reach the console promptly (PARTIAL_FLUSH).
The relay tells the worker group when all of a rank's pipes hit EOF, so an exit is reported with
the rank's complete last words.
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Sequence

log = logging.getLogger(__name__)

TAIL_LINES = 20
MAX_TAIL_CHARS = 2000
PARTIAL_FLUSH = 0.2  # an unterminated line reaches the console after this long without a newline
MAX_PENDING = 1 << 16


@dataclass(eq=False)
class RankOutput:
    """One rank's output as the relay sees it: its pipes, its last lines, how many pipes are open.

    ``tail`` and ``open_streams`` are shared between the relay thread and the worker group: touch them
    under the relay's lock.
    """

    local_rank: int
    streams: list[OutputStream] = field(default_factory=list)
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    open_streams: int = 0

    def last_lines(self) -> tuple[str, ...]:
        """The tail plus any unterminated last line; call with the relay's lock held."""
        lines = list(self.tail) + [_decode(s.line) for s in self.streams if s.line]
        return tuple(lines[-TAIL_LINES:])


@dataclass(eq=False)
class OutputStream:
    """One pipe (stdout or stderr) of one rank, as the relay thread sees it."""

    fd: int
    output: RankOutput
    file: BinaryIO | None
    console: BinaryIO | None
    prefix: bytes | None
    line: bytearray = field(default_factory=bytearray)  # incomplete line, for the tail
    pending: bytearray = field(default_factory=bytearray)  # bytes not yet shown on the console
    pending_since: float = 0.0
    at_line_start: bool = True


def _close_quietly(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _decode(raw: bytes | bytearray) -> str:
    text = bytes(raw).decode("utf-8", "replace").rstrip("\r")
    return text if len(text) <= MAX_TAIL_CHARS else text[:MAX_TAIL_CHARS] + "..."


class _TextAsBinary:
    """Lets the relay write bytes to a text-only stream (e.g. a replaced sys.stdout)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.write(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


def binary_console(stream: BinaryIO | None, default: Any) -> BinaryIO:
    """STREAM, else DEFAULT's binary buffer, else DEFAULT wrapped to accept bytes."""
    if stream is not None:
        return stream
    return getattr(default, "buffer", None) or _TextAsBinary(default)  # type: ignore[return-value]


class Relay:
    """One thread moving every rank's output to its file / the console / its tail ring."""

    def __init__(self, lock: threading.Lock, on_drained: Callable[[RankOutput], None]) -> None:
        self._lock = lock  # guards outputs' tails and open_streams, and _incoming
        self._on_drained = on_drained
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._incoming: list[OutputStream] = []
        self._streams: list[OutputStream] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nvrx-output-relay", daemon=True)
        self._thread.start()

    def add(self, streams: Sequence[OutputStream]) -> None:
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

    def _read(self, stream: OutputStream) -> bool:
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

    def _deliver(self, stream: OutputStream, data: bytes) -> None:
        if stream.file is not None:
            try:
                stream.file.write(data)
            except (OSError, ValueError) as exc:
                log.warning("cannot write rank %d output to its log file: %s", stream.output.local_rank, exc)
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

    def _add_to_tail(self, stream: OutputStream, data: bytes) -> None:
        stream.line += data
        if b"\n" not in data and len(stream.line) <= MAX_PENDING:
            return
        *lines, rest = stream.line.split(b"\n")
        with self._lock:
            stream.output.tail.extend(_decode(line) for line in lines[-TAIL_LINES:])
            if len(rest) > MAX_PENDING:
                stream.output.tail.append(_decode(rest))
                rest = bytearray()
        stream.line = bytearray(rest)

    def _show(self, stream: OutputStream, chunk: bytes) -> None:
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
    def _prefixed(stream: OutputStream, chunk: bytes) -> bytes:
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

    def _close(self, stream: OutputStream) -> None:
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
                stream.output.tail.append(_decode(stream.line))
                stream.line = bytearray()
            stream.output.open_streams -= 1
            drained = stream.output.open_streams == 0
        if drained:
            self._on_drained(stream.output)

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
