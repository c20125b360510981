"""What training code calls to cooperate with nvrx: mark the run finished, stop gracefully.

``mark_finished()`` creates the file named by ``FAULT_TOL_FINISHED_FLAG_FILE`` (set by ``nvrx resume``
or the sbatch script, inherited by every rank); its presence ends an auto-resume chain.
"""

from __future__ import annotations

import os
from pathlib import Path

FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"


def finished_flag_file() -> Path | None:
    """The finished flag file of this run, if one was configured."""
    value = os.environ.get(FINISHED_FLAG_ENV)
    return Path(value) if value else None


def mark_finished() -> Path:
    """Record that training is complete, so no further attempt or job is started."""
    path = finished_flag_file()
    if path is None:
        raise RuntimeError(f"{FINISHED_FLAG_ENV} is not set: run under `nvrx resume` or export it in the sbatch script")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"finished pid={os.getpid()}\n")
    os.replace(tmp, path)
    return path


def is_finished() -> bool:
    """True once some rank (of this or an earlier job) called mark_finished()."""
    path = finished_flag_file()
    return path is not None and path.exists()
