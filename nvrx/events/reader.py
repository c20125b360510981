"""Reading events back: decode a line, check its fields against the types the records declare, scan a file."""

from __future__ import annotations

import json
import math
import os
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from nvrx.events.records import RECORDS, Event, Record, _members, _record_class


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
# The type of every field a reader may interpret, by event, derived from the record classes. A field that
# is absent or null is fine (readers default it); one that is present with another type makes the whole
# record unusable: readers skip it as corrupt (`field_problem`) instead of tripping over it later. Fields
# typed Any are free-form. Values are decoded JSON, so a type is checked by the value's exact class (bool
# is not an int).

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
_STR = frozenset({str})
STRS = Kind("a list of strings", {list: lambda v: set(map(type, v)) <= _STR})  # (C loops: lists of 1,000s of nodes)
_INT = frozenset({int})
INTS = Kind("a list of integers", {list: lambda v: set(map(type, v)) <= _INT})  # (ranks: bool is not an int here)
NUM_MAP = Kind("an object of numbers", {dict: lambda v: all(x is None or NUM.accepts(x) for x in v.values())})
OBJECT = Kind("an object", {dict: None})
Spec = Mapping[str, "Kind | Mapping[str, Any]"]  # a nested Mapping: the field is an object with these fields

_SCALARS: dict[Any, Kind] = {int: INT, float: NUM, str: STR, bool: BOOL, frozenset({int, str}): SCALAR,
                             frozenset({float, str}): SCALAR, frozenset({int, float, str}): SCALAR}


def _field_type(tp: Any, where: str) -> Kind | Spec | None:
    """The reader's type of a field annotated TP: a Kind, a nested Spec, or None (free-form)."""
    members = _members(tp)
    if len(members) > 1:
        kind = _SCALARS.get(frozenset(members))
        if kind is None:
            raise TypeError(f"{where}: no reader type for the union {tp}")
        return kind
    (tp,) = members
    if tp is Any:
        return None
    if tp in _SCALARS:
        return _SCALARS[tp]
    sub = _record_class(tp)
    if sub is not None:
        return spec_of(sub)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args == (str,):
        return STRS
    if origin is list and args == (int,):
        return INTS
    if origin is list and _record_class(args[0]):
        item = spec_of(args[0])
        return Kind("a list of objects",
                    {list: lambda v: all(x.__class__ is dict and field_problem(x, item) is None for x in v)})
    if origin is dict and args[0] is str and set(_members(args[1])) <= {float, int}:
        return NUM_MAP
    if origin is dict and args == (str, Any):
        return OBJECT
    raise TypeError(f"{where}: no reader type for {tp}")


def spec_of(cls: type[Record]) -> Spec:
    """The reader's field types of record class CLS (free-form fields are left out)."""
    spec = {}
    for f in fields(cls):
        kind = _field_type(f.type, f"{cls.__name__}.{f.name}")
        if kind is not None:
            spec[f.name] = kind
    return spec


EVENT_FIELDS: dict[str, Spec] = {name: spec_of(cls) for name, cls in RECORDS.items()}


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


def last_event(path: Path, records: Iterable[type[Event]], where: Callable[[dict[str, Any]], bool],
               limit: int = 1 << 20) -> dict[str, Any] | None:
    """The last well-typed event of one of RECORDS in PATH for which WHERE holds, or None.

    Reads at most LIMIT bytes from the end of the file (the events wanted are recent); a missing or
    unreadable file is None. Lines of other events are skipped without being parsed.
    """
    keys = [f'"ev":"{r.EV}"'.encode() for r in records]
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - limit))
            data = fh.read(limit)
    except OSError:
        return None
    lines = data.split(b"\n")
    if size > limit:
        lines = lines[1:]  # the first one is probably cut
    for raw in reversed(lines):
        if not any(k in raw for k in keys):
            continue
        try:
            e = decode_event(raw)
        except ValueError:
            continue
        if field_problem(e) is None and where(e):
            return e
    return None
