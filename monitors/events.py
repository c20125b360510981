"""The JSON-lines event schema shared by agents, rank monitors and `nvrx inspect`.

One file per writer (``agent-<node>.jsonl``, later ``monitor-<rank>.jsonl``) in the run's log
dir. Every line is one JSON object with at least ``v`` (schema version), ``t`` (unix time),
``src`` (writer), ``ev`` (event name). Lines are written whole and flushed at once so a reader
following a live run never sees a torn line except at a crash, which readers skip.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

SCHEMA_VERSION = 1

Listener = Callable[[dict[str, Any]], None]


class EventLog:
    """Append-only JSON-lines writer that also fans each event out to listeners (e.g. the terminal)."""

    def __init__(self, path: Path | None, source: str) -> None:
        self.path = path
        self.source = source
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def emit(self, ev: str, **fields: Any) -> dict[str, Any]:
        record = {"v": SCHEMA_VERSION, "t": round(time.time(), 6), "src": self.source, "ev": ev, **fields}
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)  # one write per line: O_APPEND keeps lines whole
            for listener in self._listeners:
                try:
                    listener(record)
                except Exception:  # a broken display must never stop the agent
                    pass
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


_scan_once = json.JSONDecoder().scan_once  # the C scanner: no encoding sniffing, no whitespace regex


def decode_event(raw: bytes | str) -> dict[str, Any]:
    """One line -> one event; ValueError (with a short reason) if it is not a valid event."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode()
        except UnicodeDecodeError:
            raise ValueError("not UTF-8 text") from None
    raw = raw.strip()
    try:
        record, end = _scan_once(raw, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if end != len(raw):
        raise ValueError(f"extra data after the JSON value at column {end + 1}")
    if not isinstance(record, dict) or not isinstance(record.get("ev"), str):
        raise ValueError("not an event object")
    t = record.get("t")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError("event without a valid time 't'")
    return record


def read_events(path: Path) -> Iterator[dict[str, Any] | str]:
    """Yield each parsed event, or an error string for a line that is not a valid event."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield decode_event(raw)
            except ValueError as exc:
                yield f"{path}:{lineno}: skipped a corrupt line ({exc})"
