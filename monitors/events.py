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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

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


MAX_TIME = 253402300800.0  # 10000-01-01: later "times" cannot be shown as dates and are corrupt
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
    if not 0 <= t < MAX_TIME:
        raise ValueError(f"event time 't' out of range ({t:g})")
    return record


# ---------------------------------------------------------------- field types
#
# The fields a reader interprets, by event. A field that is absent or null is fine (readers default it);
# one that is present with another type makes the whole record unusable: readers skip it as corrupt
# (`field_problem`) instead of tripping over it later. Fields not listed here are free-form.
# Values are decoded JSON, so a type is checked by the value's exact class (bool is not an int).

_WRONG = object()


@dataclass(frozen=True, eq=False)
class Kind:
    """A field type: its name in messages and, per accepted class, None (any value of it) or a further check."""

    name: str
    by_class: Mapping[type, Callable[[Any], bool] | None]

    def accepts(self, value: Any) -> bool:
        check = self.by_class.get(value.__class__, _WRONG)
        return check is None or (check is not _WRONG and check(value))


INT = Kind("an integer", {int: None})
NUM = Kind("a finite number", {int: None, float: math.isfinite})
STR = Kind("a string", {str: None})
BOOL = Kind("true or false", {bool: None})
SCALAR = Kind("a string or a number", {str: None, int: None, float: math.isfinite})
STRS = Kind("a list of strings", {list: lambda v: all(x.__class__ is str for x in v)})
NUM_MAP = Kind("an object of numbers", {dict: lambda v: all(x is None or NUM.accepts(x) for x in v.values())})
Spec = Mapping[str, "Kind | Mapping[str, Any]"]  # a nested Mapping: the field is an object with these fields

TIMEOUTS: Spec = {"initial_heartbeat": NUM, "heartbeat": NUM, "sections": NUM_MAP, "out_of_section": NUM}
HANG: Spec = {"t": NUM, "rank": INT, "global_rank": INT, "pid": INT, "reason": STR, "section": STR,
              "elapsed": NUM, "timeout": NUM, "signal": STR, "timeouts": TIMEOUTS, "stalled_first": INT}
STOP_DETAIL: Spec = {"rank": INT, "local_rank": INT, "group_rank": INT, "pid": INT, "exitcode": INT,
                     "signal": STR, "signum": INT, "abandoned": BOOL, "tail": STRS, "describe": STR,
                     "round": INT, "hang": HANG, "steer": INT, "no_restart": BOOL, "node": STR}
FT_CONFIG: Spec = {"initial_rank_heartbeat_timeout": NUM, "rank_heartbeat_timeout": NUM,
                   "rank_section_timeouts": NUM_MAP, "rank_out_of_section_timeout": NUM,
                   "workload_check_interval": NUM, "safety_factor": NUM, "rank_termination_signal": STR}
_RANK = {"rank": INT, "local_rank": INT, "global_rank": INT, "pid": INT}

EVENT_FIELDS: dict[str, Spec] = {
    # agent
    "agent_start": {"pid": INT, "nproc": INT, "nnodes": SCALAR, "max_restarts": INT, "run_id": STR},
    "ft_config": {"config": FT_CONFIG},
    "monitor_spawned": {"local_rank": INT, "pid": INT},
    "rdzv_join": {"round": INT, "node_id": STR},
    "rdzv_round": {"round": INT, "group_rank": INT, "nodes": STRS, "world_size": INT, "restart_count": INT,
                   "waited": NUM},
    "rdzv_standby": {"round": INT, "node_id": STR, "nodes": INT, "reason": STR},
    "rank_start": _RANK,
    "rank_exit": {**_RANK, "exitcode": INT, "signal": STR, "abandoned": BOOL},
    "rank_stuck": {**_RANK, "state": STR},
    "rdzv_stop": {"round": INT, "kind": STR, "by_node": STR, "detail": STOP_DETAIL, "restart_count": INT,
                  "give_up": BOOL},
    "agent_signal": {"signal": STR, "phase": STR, "round": INT},
    "monitor_died": {"local_rank": INT, "pid": INT, "returncode": INT},
    "monitor_stuck": {"pid": INT},
    "job_end": {"status": STR, "exit_code": INT, "seconds": NUM},
    # rank monitor
    "monitor_start": {**_RANK, "timeouts": TIMEOUTS},
    "monitor_exit": {"rank": INT},
    "monitor_attach": {**_RANK, "timeouts": TIMEOUTS},
    "monitor_connect": {**_RANK, "timeouts": TIMEOUTS},
    "monitor_disconnect": {**_RANK},
    "first_heartbeat": {**_RANK, "delay": NUM},
    "heartbeat_stats": {**_RANK, "count": INT, "max_interval": NUM, "since_last": NUM},
    "section_open": {**_RANK, "section": STR, "open_for": NUM},
    "section_close": {**_RANK, "section": STR, "closes": INT, "last_duration": NUM, "max_duration": NUM,
                      "total": NUM},
    "hang_detected": HANG,
    "rank_terminated": {**_RANK, "signal": STR},
    "timeouts_set": {"rank": INT, "timeouts": TIMEOUTS},
    "timeouts_loaded": {"rank": INT, "timeouts": TIMEOUTS},
}


def field_problem(record: Mapping[str, Any], spec: Spec | None = None, prefix: str = "") -> str | None:
    """What is wrong with the field types of RECORD, a decoded event (SPEC: its entry in EVENT_FIELDS), or None.

    Runs on every event `nvrx inspect` folds: no per-field allocation unless a field is wrong.
    """
    if spec is None:
        spec = EVENT_FIELDS.get(record.get("ev"))
        if spec is None:
            return None
    for name, kind in spec.items():
        value = record.get(name)
        if value is None:
            continue
        if kind.__class__ is Kind:
            check = kind.by_class.get(value.__class__, _WRONG)  # Kind.accepts, inlined: the hot path
            if check is None or (check is not _WRONG and check(value)):
                continue
            return f"field {prefix + name!r} should be {kind.name}, not {shown(value)}"
        if value.__class__ is not dict:
            return f"field {prefix + name!r} should be an object, not {shown(value)}"
        inner = field_problem(value, kind, f"{prefix}{name}.")
        if inner is not None:
            return inner
    return None


def shown(value: Any) -> str:
    """VALUE as JSON for a message, cut to 40 characters."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def read_events(path: Path) -> Iterator[dict[str, Any] | str]:
    """Yield each parsed event, or an error string for a line that is not a valid event."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield decode_event(raw)
            except ValueError as exc:
                yield f"{path}:{lineno}: skipped a corrupt line ({exc})"
