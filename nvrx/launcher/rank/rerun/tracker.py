"""The "result rejected" tracker file (Megatron-Core's ``result_rejected_tracker_filename``): one text line per
rejected result and re-run outcome, appended by the rank that saw it, in Megatron's line format

    ts=<time> node=<node> device=<cuda device> jobID=<SLURM_JOBID> rank=<rank> iteration=<step> \
status=<status> result=<result> message='<message>'

so tools that read Megatron's file read ours. ``skipped_iterations`` gives back the steps a job may choose
to skip on its next run (a result rejected twice at the same step and rank, reproduced, and seen on one
rank only within a job: a bad sample rather than bad hardware).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from enum import Enum
from pathlib import Path

log = logging.getLogger("nvrx.launcher.rank.rerun")


class RerunValidationStatus(str, Enum):
    """What a tracker line records."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


# statuses after which the same step and rank failing again means: the input, not the hardware
_REPEATABLE = {RerunValidationStatus.RERUN_DISABLED, RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE,
               RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE}
_LINE = re.compile(r"ts=.+ node=.+ device=.+ jobID=(?P<job>\S+) rank=(?P<rank>\d+) iteration=(?P<it>-?\d+) "
                   r"status=(?P<status>\S+) result=.* message=.*")


class Tracker:
    """Appends to one tracker file; checked writable at start (a typo should fail at once, not at a fault)."""

    def __init__(self, filename: str | os.PathLike[str]) -> None:
        from nvrx.launcher.rank.rerun.modes import RerunError

        self.path = Path(filename)
        try:
            with open(self.path, "a"):
                pass
        except OSError as exc:
            raise RerunError(f"result_rejected_tracker_filename {str(self.path)!r} cannot be appended to "
                             f"({exc.strerror}): give a writable path") from None

    def record(self, status: RerunValidationStatus, *, node: str, device: int | None, rank: int, iteration: int,
               result: str | None, message: str) -> None:
        line = (f"ts={datetime.datetime.now()} node={node} device={device} jobID={os.environ.get('SLURM_JOBID', 'N/A')} "
                f"rank={rank} iteration={iteration} status={status.value} result={result} message='{message}'\n")
        try:
            with open(self.path, "a") as fh:
                fh.write(line)
        except OSError as exc:  # the tracker is a report: a full disk must not stop training
            log.error("cannot append to the result tracker %s: %s", self.path, exc)


def skipped_iterations(filename: str | os.PathLike[str]) -> list[int]:
    """The steps to skip according to the tracker file (see the module docstring); [] if it is unreadable."""
    seen: set[tuple[int, int]] = set()
    twice: set[int] = set()
    ranks_per_job: dict[tuple[str, int], set[int]] = {}
    try:
        lines = Path(filename).read_text(errors="replace").splitlines()
    except OSError as exc:
        log.error("cannot read the result tracker %s: %s", filename, exc)
        return []
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            continue
        status = m["status"].split(".")[-1].lower()   # Megatron writes the enum's repr, we its value
        if status not in {s.value for s in _REPEATABLE}:
            continue
        rank, it = int(m["rank"]), int(m["it"])
        if (rank, it) in seen:
            twice.add(it)
        seen.add((rank, it))
        ranks_per_job.setdefault((m["job"], it), set()).add(rank)
    several = {it for (_, it), ranks in ranks_per_job.items() if len(ranks) > 1}
    skip = sorted(twice - several)
    if skip:
        log.warning("steps to skip according to %s: %s", filename, skip)
    return skip
