"""The one way to write events: ``EventLog.emit(record)`` appends one JSON line per event record."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nvrx.events.records import SCHEMA_VERSION, Event

Listener = Callable[[dict[str, Any]], None]

log = logging.getLogger(__name__)
# a full file system or quota: the event file may be created later, when space returns
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def _open_private(path: Path) -> int:
    """Open PATH for appending as a 0600 file in 0700 directories (those this creates), whatever the umask:
    events name hosts, paths and failures other users must not read. A symbolic link at PATH is not followed
    (ELOOP) and a file that is not a regular file of ours is refused: a link planted in a run directory must
    not receive events or have its mode changed. (This module imports nothing of ours, so it does not use
    nvrx.common.files.open_private, which does the same for the other run files.)"""
    missing = [d for d in (path.parent, *path.parent.parents) if not os.path.lexists(d)]
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(errno.EPERM, f"not a regular file of user {os.getuid()}; refusing to write events "
                                  "into it", str(path))
        if st.st_mode & 0o777 != 0o600:
            os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd


class EventLog:
    """Append-only JSON-lines writer of event records; also fans each event out to listeners (the terminal).

    Events are diagnostics: a full or failing log file system never ends the job. An event that cannot be
    written is dropped and counted; one log line says so when dropping starts, one when writing resumes (space
    came back: the next event is tried each time) or the log is closed, with the count."""

    def __init__(self, path: Path | None, source: str) -> None:
        self.path = path
        self.source = source
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.dropped = 0  # events not written since the last one that was (0: writing works)
        self._torn = False  # a write stopped inside a line: the next line written starts on a fresh one
        self._closed = False
        if path is not None:
            try:
                self._fd = _open_private(path)
            except OSError as exc:
                if exc.errno not in _NO_SPACE:
                    raise
                self._drop(exc)  # created when space returns (the next emit tries again)

    def subscribe(self, listener: Listener) -> None:
        """LISTENER gets every event as its decoded line (a dict) after it is written."""
        self._listeners.append(listener)

    def emit(self, record: Event, t: float | None = None) -> dict[str, Any]:
        """Write RECORD (at time T, default now) as one line; returns the line as a dict."""
        if not isinstance(record, Event):
            raise TypeError(f"EventLog.emit takes an event record of monitors.events, not {type(record).__name__}")
        line_fields = {"v": SCHEMA_VERSION, "t": round(time.time(), 6) if t is None else t, "src": self.source,
                       "ev": record.EV}
        line_fields.update(record.to_fields())
        line = (json.dumps(line_fields, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self.path is not None and not self._closed:
                self._write(line)
            for listener in self._listeners:
                try:
                    listener(line_fields)
                except Exception:  # a broken display must never stop the agent
                    pass
        return line_fields

    def _write(self, line: bytes) -> None:
        """Append LINE (one write: O_APPEND keeps lines whole); on failure drop it and count (lock held)."""
        try:
            if self._fd is None:
                self._fd = _open_private(self.path)  # type: ignore[arg-type]
            data = b"\n" + line if self._torn else line
            while data:
                n = os.write(self._fd, data)
                self._torn = n < len(data)
                data = data[n:]
        except OSError as exc:
            self._drop(exc)
            return
        if self.dropped:
            log.warning("events are written to %s again; %d event(s) were dropped while it could not be written",
                        self.path, self.dropped)
            self.dropped = 0

    def _drop(self, exc: OSError) -> None:
        self.dropped += 1
        if self.dropped == 1:
            log.warning("cannot write events to %s (%s): dropping events (the job goes on) until it can be "
                        "written again", self.path, exc.strerror or exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self.dropped:
                log.warning("%d event(s) could not be written to %s and were dropped", self.dropped, self.path)
                self.dropped = 0
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
