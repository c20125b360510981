"""torchrun's error files: where each rank may record its exception, and reading them back after a failure.

A rank whose entry point is decorated with ``torch.distributed.elastic.multiprocessing.errors.record``
writes its exception as JSON to ``$TORCHELASTIC_ERROR_FILE`` before it dies. The agent gives every rank
its own path per attempt, inside a directory only this user can open (the file holds a traceback, which
may quote data), and reads the file back when the rank fails so the failure report can show the rank's
exception and traceback the way torchrun's ``ChildFailedError`` summary does.

The file is written by user code: it is read as untrusted input (bounded size, JSON only, every field
type-checked); anything unusable is ignored with one log line and the report falls back to the exit code.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvrx.common.files import private_dir

log = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
MAX_ERROR_FILE_BYTES = 1 << 20  # a traceback is kilobytes; more than this is not an error file
MAX_TRACEBACK_CHARS = 32_000  # kept for the event log and the terminal: the end of a traceback matters most


@dataclass(frozen=True)
class RankError:
    """What a rank's error file says: torchrun's ``ProcessFailure`` fields that the report shows."""

    file: str
    message: str  # "<ExceptionType>: <str(exception)>"
    traceback: str | None  # the rank's formatted traceback (py_callstack), possibly cut at its start
    timestamp: int | None  # unix seconds when the rank recorded it
    error_code: int | None = None  # set by a @record parent that copied its child's error file

    @property
    def exc_type(self) -> str:
        """The exception's class name, from the message's "<Type>: <text>" form."""
        head, sep, _ = self.message.partition(":")
        return head.strip() if sep and head.strip().isidentifier() else ""

    def to_fields(self) -> dict[str, Any]:
        """The form the stop record and the event log carry (``nvrx.events.RankErrorInfo``)."""
        out = {"file": self.file, "message": self.message, "exc_type": self.exc_type or None,
               "traceback": self.traceback, "timestamp": self.timestamp, "error_code": self.error_code}
        return {k: v for k, v in out.items() if v is not None}


class ErrorFiles:
    """One private directory per agent under the run's log directory, one error file path per rank and attempt.

    Layout: ``<run log dir>/errors-<node>-<agent pid>/attempt_<N>/<local rank>/error.json`` (torchrun's
    ``attempt_<N>/<local rank>/error.json``); the top directory is 0700. The agent's pid keeps two agents
    on one node (or a shared log directory) apart.
    """

    def __init__(self, run_log_dir: Path, node_name: str) -> None:
        self.root = Path(run_log_dir) / f"errors-{node_name}-{os.getpid()}"

    def path_for(self, attempt: int, local_rank: int) -> str:
        """The error file path of LOCAL_RANK in ATTEMPT, with its directory made and no stale file in it.

        torch's ``record`` opens the path for writing and fails if the directory is missing, so the
        directory exists before the rank starts. A file left from an earlier round with the same
        restart count (a scale-up round) is removed: it would be read back as this rank's error.
        """
        self._make_root()
        rank_dir = self.root / f"attempt_{attempt}" / str(local_rank)
        private_dir(rank_dir)
        path = rank_dir / "error.json"
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return str(path)

    def remove(self) -> None:
        """Delete the directory if no rank left an error file in it (nothing worth keeping)."""
        if self.root.is_dir() and not any(self.root.rglob("error.json")):
            shutil.rmtree(self.root, ignore_errors=True)

    def _make_root(self) -> None:
        private_dir(self.root.parent)
        self.root.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)  # mkdir's mode is filtered by the umask; this one is not


def read_error_file(path: str | os.PathLike[str] | None) -> RankError | None:
    """The rank's recorded error, or None: no file (the rank did not use ``record``) or an unusable one.

    torch writes ``{"message": {"message": "T: text", "extraInfo": {"py_callstack": ..., "timestamp": "..."}}}``;
    a plain string message with a top-level ``timestamp`` is the other form torch reads. An unusable file
    (too big, not JSON, wrong shape) gets one warning naming it and why.
    """
    if not path:
        return None
    try:
        # never through a link: the file is the rank's, and what it holds goes into the job's events
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fh:
            raw = fh.read(MAX_ERROR_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the rank's error file %s (%s); reporting the exit code only", path, exc.strerror)
        return None
    if len(raw) > MAX_ERROR_FILE_BYTES:
        return _unusable(path, f"larger than {MAX_ERROR_FILE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return _unusable(path, f"not JSON: {exc}")
    parsed = _parse(data)
    if isinstance(parsed, str):
        return _unusable(path, parsed)
    message, traceback, timestamp, code = parsed
    return RankError(str(path), message, _cut(traceback), timestamp, code)


def _parse(data: Any) -> tuple[str, str | None, int | None, int | None] | str:
    """(message, traceback, timestamp, error code) from the decoded file, or what is wrong with it."""
    if not isinstance(data, dict) or "message" not in data:
        return "no 'message' field"
    msg = data["message"]
    if isinstance(msg, str):
        return msg, None, _timestamp(data.get("timestamp")), None
    if not isinstance(msg, dict) or not isinstance(msg.get("message"), str):
        return "'message' is neither a string nor an object with a string 'message'"
    extra = msg.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    stack = extra.get("py_callstack")
    return (msg["message"], stack if isinstance(stack, str) else None, _timestamp(extra.get("timestamp")),
            _int_or_none(msg.get("errorCode")))


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _timestamp(value: Any) -> int | None:
    """Unix seconds, or None for anything no clock shows (the report formats it as a date)."""
    stamp = _int_or_none(value)
    return stamp if stamp is not None and 0 < stamp < 1 << 36 else None


def _cut(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_TRACEBACK_CHARS:
        return text
    return "...\n" + text[-MAX_TRACEBACK_CHARS:]


def _unusable(path: str | os.PathLike[str], why: str) -> None:
    log.warning("ignoring the rank's error file %s: %s; reporting the exit code only", path, why)
    return None


def report_lines(failure: dict[str, Any]) -> list[str]:
    """torchrun's ``ChildFailedError`` fields of one failed rank: rank, exit code, error file, traceback.

    FAILURE is a stop detail (``nvrx.events.StopDetail`` fields); its ``error`` object
    (``RankError.to_fields``) gives the file and the traceback, or the message when there is no traceback.
    """
    error = failure.get("error") or {}
    code = failure.get("exitcode")
    sig = failure.get("signal")
    exit_text = f"{code}" if sig is None else f"-{_signum(sig)} ({sig})"
    stamp = error.get("timestamp")
    lines = [f"time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(stamp))}"] if stamp else []
    lines += [f"rank      : {failure.get('rank')} (local_rank: {failure.get('local_rank')})",
             f"exitcode  : {exit_text} (pid: {failure.get('pid')})",
             f"error_file: {error.get('file') or '<N/A>'}"]
    text = str(error.get("traceback") or error.get("message") or "").rstrip("\n")
    if not text:
        return lines + ["traceback : <N/A>"]
    return lines + ["traceback :"] + [f"  {line}" for line in text.splitlines()]


def _signum(name: str) -> str:
    try:
        return str(int(signal.Signals[name]))
    except KeyError:
        return "?"
