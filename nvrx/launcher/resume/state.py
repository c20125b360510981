"""The per-run state file of `nvrx resume`: counts that must survive jobs, crashes and corruption.

``<state-dir>/state.json`` is rewritten atomically (nvrx.common.files.save_json_atomic; mode 0600) and mirrored to
``state.json.bak``; every decision also appends a snapshot of the counts to ``resume.jsonl``. A corrupt
state file is kept as ``state.json.corrupt-<time>`` and the counts come back from the newest readable
copy (highest ``seq``), so a bad file never resets the attempt or failure budget. One ``nvrx resume``
at a time holds ``<state-dir>/lock`` (flock), so two drivers cannot submit two continuations.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import stat
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from nvrx.events import BOOL, INT, STR, Kind, shown
from nvrx.common.files import save_json_atomic
from nvrx.common.errors import NvrxError

log = logging.getLogger(__name__)

STATE_VERSION = 1
STATE_FILE = "state.json"
BACKUP_FILE = "state.json.bak"
LOCK_FILE = "lock"
EVENTS_FILE = "resume.jsonl"
HISTORY_KEEP = 200  # attempt records kept in the file; the counts are separate and never trimmed


class ResumeError(NvrxError):
    """A user-fixable problem with the state dir or the setup (one line, exit 2)."""


class CorruptState(NvrxError, ValueError):
    """A state file (or snapshot) that cannot be read back into a ResumeState."""


@dataclass(frozen=True)
class ResumeState:
    """Everything `nvrx resume` remembers about one run across attempts and jobs."""

    seq: int = 0  # bumped on every save; the newest readable copy wins on recovery
    created: float = 0.0
    updated: float = 0.0
    attempts: int = 0  # launches that ended (any cause)
    failures: int = 0  # launches that ended in a failure
    no_progress: int = 0  # consecutive attempts whose progress did not advance
    last_progress: int | None = None  # newest iteration seen after an attempt
    last_exit_code: int | None = None
    last_cause: str | None = None
    stopped: str | None = None  # a rank asked to stop for good (exit 17/93...): needs --reset
    finished: bool = False
    excluded_nodes: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()  # Slurm jobs that ran this driver
    submitted: tuple[dict[str, Any], ...] = ()  # continuations submitted (job id, from job, method)
    running: dict[str, Any] | None = None  # the attempt in progress (left set if the driver was killed)
    history: tuple[dict[str, Any], ...] = ()

    _COUNTS = ("seq", "attempts", "failures", "no_progress")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["version"] = STATE_VERSION
        for key in ("excluded_nodes", "jobs", "submitted", "history"):
            out[key] = list(out[key])
        return out

    def counts(self) -> dict[str, Any]:
        """The part of the state a snapshot event carries (small; enough to recover the budget)."""
        out = self.to_dict()
        out.pop("history")
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> "ResumeState":
        """Validate a parsed state, every field and list item; raise CorruptState on anything that is not
        a state we wrote (a wrong type would otherwise fail later, after the file was rewritten)."""
        if not isinstance(raw, dict):
            raise CorruptState("not a JSON object")
        if raw.get("version") != STATE_VERSION:
            raise CorruptState(f"unknown version {raw.get('version')!r}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in raw.items() if k in names}
        for key in cls._COUNTS:
            _check(key, kw.get(key, 0), _COUNT)  # null is not a count either
        for key, kind in _FIELD_KINDS.items():
            if kw.get(key) is not None:
                _check(key, kw[key], kind)
        for key, kind in _LIST_KINDS.items():
            value = kw.get(key, [])
            if not isinstance(value, list):
                raise CorruptState(f"{key} is {shown(value)}, not a list")
            for item in value:
                if not kind.accepts(item):
                    raise CorruptState(f"{key} holds {shown(item)}, not {kind.name}")
            kw[key] = tuple(value)
        running = kw.get("running") or {}
        for key, kind in _RUNNING_KINDS.items():
            if running.get(key) is not None:
                _check(f"running.{key}", running[key], kind)
        return cls(**kw)

    def with_attempt(self, record: dict[str, Any]) -> "ResumeState":
        """Append one attempt record, keeping the history bounded."""
        return replace(self, history=(*self.history, record)[-HISTORY_KEEP:])


@dataclass
class Loaded:
    """What load() found: the state to use, and a one-line note when it had to be recovered."""

    state: ResumeState
    note: str | None = None
    source: str = STATE_FILE
    corrupt_copy: Path | None = None
    fresh: bool = False


@dataclass
class StateStore:
    """The state dir: checks it, locks it, loads (with recovery) and saves the state."""

    state_dir: Path
    _lock_fd: int | None = field(default=None, repr=False)

    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def backup_path(self) -> Path:
        return self.state_dir / BACKUP_FILE

    @property
    def events_path(self) -> Path:
        return self.state_dir / EVENTS_FILE

    # ---------------------------------------------------------------- dir and lock

    def open(self, lock: bool = True) -> None:
        """Check the dir exists and is writable, and take the lock (unless only reading). Raises ResumeError."""
        d = self.state_dir
        if not d.exists():
            raise ResumeError(f"state dir {d} does not exist: create it for a new run (mkdir -p {d}), "
                              "or fix the path of an existing one")
        if not d.is_dir():
            raise ResumeError(f"state dir {d} is not a directory: pass a directory to --state-dir")
        self._check_files()
        if not lock:
            return
        try:
            fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ResumeError(f"state dir {d} is not writable ({exc.strerror}): "
                              "use a directory you can write, on storage every job sees") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_text(d / LOCK_FILE).strip() or "?"
            os.close(fd)
            raise ResumeError(f"another `nvrx resume` (pid {holder}) is using state dir {d}: "
                              "run one driver per run (on the batch node only)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self._check_writable()

    def _check_files(self) -> None:
        """The state file and its backup, where they exist, are regular files: a directory (or a FIFO, which
        would block the read) in their place is a broken state dir the user must fix, not a corrupt file."""
        for path in (self.state_path, self.backup_path):
            try:
                mode = path.stat().st_mode
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise ResumeError(f"cannot read state file {path} ({exc.strerror}): fix its permissions") from None
            if not stat.S_ISREG(mode):
                what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
                raise ResumeError(f"state file {path} is {what}: move it away (the run's counts are in "
                                  f"{self.events_path.name} and the backup), or use another --state-dir")

    def _check_writable(self) -> None:
        probe = self.state_dir / f".probe.{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
            probe.unlink()
        except OSError as exc:
            self.close()
            raise ResumeError(f"state dir {self.state_dir} is not writable ({exc.strerror}): "
                              "use a directory you can write, on storage every job sees") from None

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # ---------------------------------------------------------------- load / save

    def load(self, snapshots: Callable[[], Iterable[dict[str, Any]]] = lambda: ()) -> Loaded:
        """The newest readable state. A corrupt state file is kept aside and the counts recovered from
        the backup copy or the newest snapshot in the events file; if nothing is readable, ResumeError."""
        primary, primary_err = self._read(self.state_path)
        backup, _ = self._read(self.backup_path)
        if primary is not None:
            best = backup if backup is not None and backup.seq > primary.seq else primary
            return Loaded(best, source=STATE_FILE if best is primary else BACKUP_FILE)
        candidates = [(backup, BACKUP_FILE)] if backup is not None else []
        snap = _newest_snapshot(snapshots())
        if snap is not None:
            candidates.append((snap, EVENTS_FILE))
        recovered = max(candidates, key=lambda c: c[0].seq) if candidates else None
        if primary_err is None:  # no state file at all
            if recovered is None:
                now = time.time()
                return Loaded(ResumeState(created=now, updated=now), fresh=True)
            state, src = recovered
            return Loaded(state, source=src, note=f"state file {self.state_path} is missing: recovered counts "
                                                  f"from {self.state_dir / src} ({_summary(state)})")
        copy = self._keep_corrupt()
        if recovered is None:
            raise ResumeError(f"state file {self.state_path} is corrupt ({primary_err}) and no backup is readable: "
                              f"kept it as {copy.name}; repair it, or pass --reset to start counting from zero")
        state, src = recovered
        return Loaded(state, source=src, corrupt_copy=copy,
                      note=f"state file {self.state_path} is corrupt ({primary_err}): kept it as {copy.name}, "
                           f"recovered counts from {src} ({_summary(state)})")

    def save(self, state: ResumeState) -> ResumeState:
        """Write the state atomically to the state file and its backup; returns it with seq bumped."""
        state = replace(state, seq=state.seq + 1, updated=round(time.time(), 6))
        data = state.to_dict()
        for path in (self.state_path, self.backup_path):
            save_json_atomic(path, data)
        return state

    def _read(self, path: Path) -> tuple[ResumeState | None, str | None]:
        """(state, None) if readable; (None, None) if missing; (None, why) if corrupt."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            return None, exc.strerror or str(exc)
        try:
            return ResumeState.from_dict(json.loads(raw)), None
        except (ValueError, TypeError) as exc:  # JSONDecodeError and CorruptState are ValueErrors
            return None, _short(exc)

    def _keep_corrupt(self) -> Path:
        """Copy the corrupt file aside (once per distinct content); the original stays until a good
        state replaces it, so a run that cannot recover reports the same problem again next time."""
        data = self.state_path.read_bytes()
        for old in sorted(self.state_dir.glob(f"{STATE_FILE}.corrupt-*")):
            if _read_bytes(old) == data:
                return old
        stamp = time.strftime("%Y%m%dT%H%M%S")
        names = (f"{STATE_FILE}.corrupt-{stamp}" + (f".{n}" if n > 1 else "") for n in itertools.count(1))
        for name in names:
            try:
                fd = os.open(self.state_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            try:  # need not be atomic: the original stays until a good state replaces it
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            return self.state_dir / name
        raise AssertionError("unreachable: the names never run out")


# Optional fields (null allowed) and their types; list fields and the type of their items (nvrx.events'
# field types: exact JSON types, so true is not an integer).
_COUNT = Kind("a count", {int: lambda v: v >= 0})
_NUMBER = Kind("a number", {int: None, float: None})
_OBJECT = Kind("an object", {dict: None})
_FIELD_KINDS = {"created": _NUMBER, "updated": _NUMBER, "last_progress": INT, "last_exit_code": INT,
                "last_cause": STR, "stopped": STR, "finished": BOOL, "running": _OBJECT}
_LIST_KINDS = {"excluded_nodes": STR, "jobs": STR, "submitted": _OBJECT, "history": _OBJECT}
_RUNNING_KINDS = {"attempt": INT, "start": _NUMBER, "job_id": STR, "node": STR}


def _check(where: str, value: Any, kind: Kind) -> None:
    if not kind.accepts(value):
        raise CorruptState(f"{where} is {shown(value)}, not {kind.name}")


def _newest_snapshot(snapshots: Iterable[dict[str, Any]]) -> ResumeState | None:
    best: ResumeState | None = None
    for raw in snapshots:
        try:
            state = ResumeState.from_dict(raw)
        except (ValueError, TypeError):
            continue
        if best is None or state.seq >= best.seq:
            best = state
    return best


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


def _summary(state: ResumeState) -> str:
    return f"attempts {state.attempts}, failures {state.failures}, no progress {state.no_progress}"
