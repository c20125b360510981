"""Where the machine's decisions go: the log, the run's event file (for `nvrx inspect`), and the resume
state dir (for `nvrx resume`).

Events: ``<run log dir>/rerun-<node>-<rank>.jsonl`` (source ``rerun``), written by rank 0 only: each
event already holds every suspect rank, gathered from all ranks. The run log dir is ``NVRX_RUN_LOG_DIR``
under `nvrx launch`, or ``event_dir`` given to the machine.

Resume record: ``<NVRX_RESUME_STATE_DIR>/rerun.json`` (0600, atomic), rewritten by rank 0 whenever the
machine exits the job for a re-run or reaches a verdict: which step, which node and rank were suspected,
which result, the diagnosis and the exit code, tagged with the resume attempt. `nvrx resume` reads it
after the attempt (launcher.resume.driver) so that a re-run is not taken for a restart storm.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from nvrx.events import EventLog, RerunSuspect
from nvrx.common.files import save_json_atomic

log = logging.getLogger("nvrx.launcher.rank.rerun")

RESUME_RECORD = "rerun.json"   # in the resume state dir; nvrx.launcher.resume.driver reads it


def node_name() -> str:
    """This rank's node, named as its agent names it (SLURMD_NODENAME: emulated nodes share a host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def suspect_records(suspects: list[Mapping[str, Any]]) -> list[RerunSuspect]:
    """The machine's suspect dicts as event records."""
    return [RerunSuspect(rank=s["rank"], node=s["node"], device=s.get("device"), message=s["message"],
                         call=s.get("call"), result=s["result"], rerun_result=s.get("rerun_result"),
                         rerun_node=s.get("rerun_node")) for s in suspects]


class Reporter:
    """Writes the machine's events and resume record on rank 0; other ranks only log."""

    def __init__(self, rank: int, event_dir: str | os.PathLike | None, resume_dir: str | os.PathLike | None) -> None:
        self.rank = rank
        env_dir = os.environ.get("NVRX_RUN_LOG_DIR")
        self.event_dir = Path(event_dir) if event_dir is not None else Path(env_dir) if env_dir else None
        env_resume = os.environ.get("NVRX_RESUME_STATE_DIR")
        self.resume_dir = Path(resume_dir) if resume_dir is not None else Path(env_resume) if env_resume else None
        self._log: EventLog | None = None

    def events(self) -> "EventLog | _NoLog":
        """The run's rerun event file (rank 0 under `nvrx launch`; opened on first use), else a log that
        drops events: callers write ``reporter.events().emit(RerunVerdict(...))``."""
        if self.rank != 0 or self.event_dir is None:
            return _NO_LOG
        if self._log is None:
            try:
                self._log = EventLog(self.event_dir / f"rerun-{node_name()}-{self.rank}.jsonl", source="rerun")
            except OSError as exc:  # an unwritable log dir must not stop training: the log lines still say it
                log.warning("cannot write re-run events to %s: %s", self.event_dir, exc)
                self.event_dir = None
                return _NO_LOG
        return self._log

    def resume_record(self, fields: Mapping[str, Any]) -> None:
        """Rewrite the resume state dir's rerun.json with FIELDS (rank 0; nothing outside `nvrx resume`)."""
        if self.rank != 0 or self.resume_dir is None:
            return
        data = {"id": uuid.uuid4().hex, "t": round(time.time(), 3),
                "attempt": _int(os.environ.get("NVRX_RESUME_ATTEMPT")), **fields}
        try:
            save_json_atomic(self.resume_dir / RESUME_RECORD, data)
        except OSError as exc:
            log.warning("cannot write %s in %s: %s", RESUME_RECORD, self.resume_dir, exc)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class _NoLog:
    """Where events go on ranks other than 0, or without a run log dir: nowhere."""

    def emit(self, record: object) -> None:
        return None


_NO_LOG = _NoLog()


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None
