"""Find a run's JSON-lines event files and read them incrementally, tolerating damage.

A log dir holds one run (``<log-dir>/<run-id>/``) or several (a resume chain: one run dir per job,
plus the resume driver's ``resume.jsonl``). Files are read in bounded chunks from a remembered
offset, so the same reader serves a one-shot report and ``--follow`` on a live run. Lines that are
not valid events (torn by a crash, truncated, binary garbage) are counted and described, never raised.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from nvrx.events import decode_event
from nvrx.common.errors import NvrxError
from nvrx.common.files import file_kind, open_regular

_AGENT_RE = re.compile(r"^agent-(?P<node>.+)\.jsonl$")
_MONITOR_RE = re.compile(r"^monitor-(?P<node>.+)-(?P<lr>\d+)\.jsonl$")
_RESUME_RE = re.compile(r"^resume.*\.jsonl$")
MAX_DEPTH = 4            # a chain dir -> run dirs -> (attempt_N/...): event files are never deeper
CHUNK = 1 << 20          # bytes read per call; bounds memory and the time one --follow poll takes
MAX_LINE = 1 << 20       # a "line" longer than this without a newline is garbage, not an event
_EV_KEY = b'"ev":"'


class NotARun(NvrxError):
    """The given path holds nothing `nvrx inspect` can read; the message says what to pass instead."""


@dataclass
class EventFile:
    """One event file and how far it has been read."""

    path: Path
    kind: str                  # agent | monitor | resume | other
    node: str | None = None    # "<host>-<agent pid>": ties a monitor file to its agent file
    local_rank: int | None = None
    offset: int = 0
    lineno: int = 0
    pending: bytes = b""       # a trailing line without its newline yet (a live writer mid-line)
    size: int = 0
    error: str | None = None   # why the file could not be read (reported once)
    said: str | None = None    # the last such reason reported: a --follow poll does not repeat it

    @property
    def run_dir(self) -> Path:
        return self.path.parent


def classify(path: Path) -> EventFile | None:
    """An EventFile for PATH if its name is one of ours (agent-*, monitor-*-N, resume*), else None."""
    name = path.name
    m = _AGENT_RE.match(name)
    if m:
        return EventFile(path, "agent", node=m["node"])
    m = _MONITOR_RE.match(name)
    if m:
        return EventFile(path, "monitor", node=m["node"], local_rank=int(m["lr"]))
    if _RESUME_RE.match(name):
        return EventFile(path, "resume")
    return None


def _walk(root: Path) -> Iterator[Path]:
    base_depth = len(root.parts)
    for dirpath, dirnames, filenames in os.walk(root):
        if len(Path(dirpath).parts) - base_depth >= MAX_DEPTH:
            dirnames[:] = []
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".jsonl"):
                yield Path(dirpath) / name


def _event_file(path: Path) -> EventFile | None:
    """PATH as an EventFile: by its name, else ("other") if its first line is an event with a ``src``."""
    ef = classify(path)
    if ef is not None:
        return ef
    try:
        with _open(path) as fh:
            rec = decode_event(fh.readline(MAX_LINE))
    except (OSError, ValueError):
        return None
    return EventFile(path, "other") if "src" in rec else None


def _open(path: Path):  # noqa: ANN202 (a binary file object)
    """PATH opened for reading only if it is a regular file: a fifo named like an event file must not block
    `nvrx inspect` forever (NotRegularFile, an OSError, instead)."""
    return os.fdopen(open_regular(path), "rb")


def _identity(path: Path) -> Path:
    """PATH's real path, to count a file reached twice (a symlink) once; a symlink loop is its own identity
    (Path.resolve raises RuntimeError on one before Python 3.13)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def _given_kind(given: Path) -> tuple[int | None, str | None]:
    """(st_mode, None) of a path given on the command line, or (None, why it cannot be inspected)."""
    try:
        return given.stat().st_mode, None
    except FileNotFoundError:
        if given.is_symlink():
            return None, "a symlink to nothing"
        return None, "no such file or directory"
    except OSError as exc:  # ELOOP (a symlink loop), EACCES on a parent, ...
        return None, exc.strerror or str(exc)


def discover(paths: list[Path]) -> list[EventFile]:
    """Every event file under PATHS (dirs are searched a few levels deep). Raises NotARun."""
    found: dict[Path, EventFile] = {}
    for given in paths:
        mode, why = _given_kind(given)
        if mode is None:
            raise NotARun(f"{given}: {why} (give a run's log dir, e.g. nvrx_logs/<run-id>)")
        if stat.S_ISREG(mode):
            ef = _event_file(given)
            if ef is None:
                raise NotARun(f"{given}: not an nvrx event file (expected agent-*.jsonl, monitor-*.jsonl "
                              "or resume*.jsonl)")
            found[_identity(given)] = ef
            continue
        if not stat.S_ISDIR(mode):
            raise NotARun(f"{given}: {file_kind(mode)}, not an event file or a run's log dir (give a run's log "
                          "dir, e.g. nvrx_logs/<run-id>)")
        if not os.access(given, os.R_OK | os.X_OK):
            raise NotARun(f"{given}: cannot read this directory (permission denied or not a directory)")
        if not any(given.iterdir()):
            raise NotARun(f"{given}: empty directory, nothing to inspect (give the --log-dir of a run "
                          "or <log-dir>/<run-id>)")
        for path in _walk(given):
            ef = _event_file(path)
            if ef is not None:
                found.setdefault(_identity(path), ef)
    files = list(found.values())
    if not files:
        shown = ", ".join(str(p) for p in paths)
        raise NotARun(f"{shown}: no nvrx event files here (agent-*.jsonl, monitor-*.jsonl); give the "
                      "--log-dir of a run or <log-dir>/<run-id>")
    return files


def raw_string(raw: bytes, key: bytes) -> bytes | None:
    """The string value after KEY (``b'"name":"'``, as EventLog writes it) in a raw line, without parsing it."""
    i = raw.find(key)
    if i < 0:
        return None
    i += len(key)
    j = raw.find(b'"', i)
    return raw[i:j] if j > 0 else None


def event_name(raw: bytes) -> bytes | None:
    """The ``ev`` value of a raw line without parsing it (None if the key is not where we write it)."""
    return raw_string(raw, _EV_KEY)


def read_chunk(ef: EventFile, final: bool, limit: int = CHUNK) -> tuple[int, list[bytes]]:
    """New complete lines of EF (about LIMIT bytes at most) and the line number before the first one.

    FINAL: the writer is done, so a last line without a newline is returned too (it is usually torn).
    A live writer's unfinished line is kept in ``ef.pending`` until its newline arrives.
    """
    first = ef.lineno
    try:
        with _open(ef.path) as fh:
            st = os.fstat(fh.fileno())
            if st.st_size < ef.offset:  # truncated or replaced under us: start over
                ef.offset, ef.pending, ef.lineno = 0, b"", 0
                first = 0
            ef.size = st.st_size
            fh.seek(ef.offset)
            data = fh.read(limit)
    except OSError as exc:
        why = f"cannot read: {exc.strerror or exc}"  # e.g. a symlink loop or a fifo named like an event file
        if why != ef.said:
            ef.error = ef.said = why
        return first, []
    ef.said = None
    ef.offset += len(data)
    buf = ef.pending + data if ef.pending else data
    lines = buf.split(b"\n")
    rest = lines.pop()
    if len(rest) > MAX_LINE or (rest and final and ef.offset >= ef.size):
        lines.append(rest)
        rest = b""
    ef.pending = rest
    ef.lineno += len(lines)
    return first, lines


def first_event_time(ef: EventFile) -> float | None:
    """The ``t`` of the first valid event in EF (used to order files before reading them whole)."""
    try:
        with _open(ef.path) as fh:
            for _ in range(16):
                raw = fh.readline(MAX_LINE)
                if not raw:
                    return None
                try:
                    return float(decode_event(raw)["t"])
                except ValueError:
                    continue
    except OSError:
        return None
    return None


def iso(t: float | None) -> str | None:
    """An event time as local ISO-8601 with milliseconds (the JSON report's ``time`` fields); None if T is not one."""
    if t is None:
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
    except (OverflowError, ValueError, OSError):
        return None


@dataclass
class Damage:
    """Lines skipped because they were not valid events: a count and the first few, described."""

    count: int = 0
    first: list[str] = field(default_factory=list)
    keep: int = 5

    def add(self, ef: EventFile, lineno: int, why: str) -> None:
        self.count += 1
        if len(self.first) < self.keep:
            self.first.append(f"{ef.path}:{lineno}: {why}")
