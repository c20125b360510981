"""The one way to write events: ``EventLog.emit(record)`` appends one JSON line per event record."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nvrx.events.records import SCHEMA_VERSION, Event

Listener = Callable[[dict[str, Any]], None]


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
    """Append-only JSON-lines writer of event records; also fans each event out to listeners (the terminal)."""

    def __init__(self, path: Path | None, source: str) -> None:
        self.path = path
        self.source = source
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is not None:
            self._fd = _open_private(path)

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
            if self._fd is not None:
                os.write(self._fd, line)  # one write per line: O_APPEND keeps lines whole
            for listener in self._listeners:
                try:
                    listener(line_fields)
                except Exception:  # a broken display must never stop the agent
                    pass
        return line_fields

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


