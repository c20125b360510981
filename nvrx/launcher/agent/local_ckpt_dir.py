"""The job's node-local checkpoint directory (``nvrx launch --local-ckpt-dir``), removed when the job succeeds.

Ranks keep their local checkpoints (``nvrx.ckpt.local``) under ``<local root>/<run id>`` (the session named by the run
id, ``TORCHELASTIC_RUN_ID``). After a success nothing will restore from them, and node-local space (often
``/dev/shm``, i.e. memory) is scarce, so the agent removes that one directory. After a failure it stays: the next
attempt restores from it. Nothing else under the root is touched (other jobs' sessions, the root itself).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

LOCAL_CKPT_DIR_ENV = "NVRX_LOCAL_CKPT_DIR"  # set for the ranks by --local-ckpt-dir (nvrx.launcher.agent.config)


def job_session_dir(root: str | os.PathLike, run_id: str) -> Path | None:
    """ROOT/RUN_ID, or None when RUN_ID could name anything but one child of ROOT."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\0" in run_id:
        return None
    return Path(root) / run_id


def remove_job_session(root: str | os.PathLike | None, run_id: str) -> Path | None:
    """Remove this job's local checkpoint session under ROOT (no-op without a root or a session); the path
    removed, else None. A symbolic link is not followed. Failures are logged: the job's success stands."""
    path = job_session_dir(root, run_id) if root else None
    if path is None or not (path.exists() or path.is_symlink()):
        return None
    try:
        if path.is_symlink() or not path.is_dir():
            log.warning("local checkpoint session %s is not a directory; left alone", path)
            return None
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("cannot remove the local checkpoints of this job at %s: %s", path, exc)
        return None
    log.info("job succeeded: removed its local checkpoints %s", path)
    return path
