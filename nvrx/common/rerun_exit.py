"""The note a rank leaves its agent when it exits 16 for the re-run state machine: which node(s) are suspected.

Under the re-run state machine every rank exits 16 together (the decision is collective), but only the
suspected node should leave the job; the others can go on with a standby in its place. The agent cannot
tell them apart from the exit codes, so each rank writes this note (the path is ``$NVRX_RERUN_EXIT_FILE``,
one per rank and round, in the agent's private 0700 directory) before it exits. A rank exit 16 without a
note is a plain request: its own node leaves.

The note is written by user-side code: the agent reads it as untrusted input (bounded, JSON, typed).
Torch-free: the agent reads it, the rank writes it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from nvrx.common.files import save_json_atomic

log = logging.getLogger(__name__)

ENV = "NVRX_RERUN_EXIT_FILE"
MAX_NOTE_BYTES = 64 << 10
MAX_NODES = 1024


@dataclass(frozen=True)
class RerunExitNote:
    """Why a rank exits 16: the step to re-run elsewhere and the suspected nodes (Slurm node names)."""

    step: int
    nodes: tuple[str, ...]


def write_note(step: int, nodes: list[str], env: dict[str, str] | None = None) -> None:
    """Write the note where the agent looks (nothing outside `nvrx launch`); a failure is only logged:
    without the note the agent treats the exit as this node's own request, which is the safe side."""
    path = (env if env is not None else os.environ).get(ENV)
    if not path:
        return
    try:
        save_json_atomic(Path(path), {"step": int(step), "nodes": sorted(set(nodes))})
    except OSError as exc:
        log.warning("cannot write the re-run exit note %s: %s", path, exc)


def read_note(path: str | os.PathLike[str] | None) -> RerunExitNote | None:
    """The rank's note, or None (no note, or an unusable one: logged)."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_NOTE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the re-run exit note %s (%s)", path, exc.strerror)
        return None
    try:
        data = json.loads(raw) if len(raw) <= MAX_NOTE_BYTES else None
        step, nodes = data["step"], data["nodes"]
        ok = (isinstance(step, int) and not isinstance(step, bool) and isinstance(nodes, list)
              and 0 < len(nodes) <= MAX_NODES and all(isinstance(n, str) and 0 < len(n) <= 512 for n in nodes))
    except (ValueError, UnicodeDecodeError, TypeError, KeyError):
        ok = False
    if not ok:
        log.warning("ignoring the re-run exit note %s: not a note nvrx wrote", path)
        return None
    return RerunExitNote(step, tuple(nodes))


def remove_note(path: str | os.PathLike[str] | None) -> None:
    """Drop a note left by an earlier round with the same path (a standby swap keeps the restart count)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
