"""The job's node-local checkpoint directory (``nvrx launch --local-ckpt-dir``), removed when the job succeeds.

Ranks keep their local checkpoints (``nvrx.ckpt.local``) under ``<local root>/<run id>`` (the session named by the run
id, ``TORCHELASTIC_RUN_ID``). After a success nothing will restore from them, and node-local space (often
``/dev/shm``, i.e. memory) is scarce, so the agent removes that one directory. After a failure it stays: the next
attempt restores from it. Nothing else under the root is touched (other jobs' sessions, the root itself).

Only what nvrx made is removed, and only what it can prove it made: the agent creates the session directory itself
before the first rank starts and writes a marker into it (``.nvrx-session``: the run id); a directory that existed
before (a user's own ``<root>/<run id>``) gets no marker and is never removed. Removal walks by file descriptor and
never follows a symbolic link; it deletes only the marker, ``rank<N>`` directories and the files the local tier
writes there (checkpoints, their temporaries, damaged copies moved aside, the lineage of rounds). Anything else
stays, with its directories.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path

from nvrx.common.files import private_dir

log = logging.getLogger(__name__)

LOCAL_CKPT_DIR_ENV = "NVRX_LOCAL_CKPT_DIR"  # set for the ranks by --local-ckpt-dir (nvrx.launcher.agent.config)
MARKER = ".nvrx-session"
_RANK_DIR = re.compile(r"rank\d+")
# nvrx.ckpt.local's files in a rank directory: iter_<I>_<owner>_local.nvrxl, a temporary of one (nvrx.common.files
# atomic writes: .<name>.tmp-...), a damaged one moved aside (.corrupt-<name>), the lineage (.nvrx_fence.json)
_CKPT = r"iter_\d+_\d+_local\.nvrxl"
_FENCE = r"\.nvrx_fence\.json"  # the rank directory's lineage of rounds (nvrx/ckpt/fence.py FENCE_FILE)
_KNOWN_FILE = re.compile(rf"{_CKPT}|\.{_CKPT}\.tmp-[^/]*|\.corrupt-{_CKPT}|{_FENCE}|\.{_FENCE}\.tmp-[^/]*")
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def job_session_dir(root: str | os.PathLike, run_id: str) -> Path | None:
    """ROOT/RUN_ID, or None when RUN_ID could name anything but one child of ROOT."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\0" in run_id:
        return None
    return Path(root) / run_id


def claim_job_session(root: str | os.PathLike | None, run_id: str) -> bool:
    """Create this job's session ROOT/RUN_ID (0700) with its marker before any rank runs; True if nvrx made it
    now or in an earlier launch of this job (its marker is there), False for a directory someone else made (it is
    used, never removed) or when there is no root. OSError if the session cannot be made."""
    path = job_session_dir(root, run_id) if root else None
    if path is None:
        return False
    private_dir(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if _marked(path, run_id):
            return True
        log.warning("--local-ckpt-dir: %s existed before this job and was not made by nvrx: local checkpoints go "
                    "there, but it will not be removed when the job succeeds", path)
        return False
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"run_id": run_id, "uid": os.getuid(), "pid": os.getpid()}, fh)
    return True


def _marked(path: Path, run_id: str) -> bool:
    """PATH is a real directory of ours, others cannot write it, and it holds our marker naming RUN_ID."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
        fd = os.open(path / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            mst = os.fstat(fh.fileno())
            if not stat.S_ISREG(mst.st_mode) or mst.st_uid != os.getuid():
                return False
            data = json.loads(fh.read(4096) or b"null")
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("run_id") == run_id


def remove_job_session(root: str | os.PathLike | None, run_id: str) -> Path | None:
    """Remove this job's local checkpoint session under ROOT if nvrx made it (its marker); the path removed, else
    None. Unknown entries are kept (said in one line). Failures are logged: the job's success stands."""
    path = job_session_dir(root, run_id) if root else None
    if path is None or not os.path.lexists(path):
        return None
    if not _marked(path, run_id):
        log.warning("local checkpoint session %s was not made by nvrx for this job; left alone", path)
        return None
    try:
        left = _remove_known(path)
    except OSError as exc:
        log.warning("cannot remove the local checkpoints of this job at %s: %s", path, exc)
        return None
    if left:
        log.warning("job succeeded: removed its local checkpoints from %s but kept what nvrx did not write there: %s",
                    path, ", ".join(sorted(left)[:5]) + (" ..." if len(left) > 5 else ""))
        return None
    log.info("job succeeded: removed its local checkpoints %s", path)
    return path


def _remove_known(path: Path) -> list[str]:
    """Delete the marker, rank directories and local-tier files under PATH (by fd, no symbolic link followed),
    then PATH itself if empty; the entries kept (relative names)."""
    left: list[str] = []
    top = os.open(path, _NOFOLLOW_DIR)
    try:
        for name in os.listdir(top):
            if name == MARKER:
                continue
            if not _RANK_DIR.fullmatch(name) or not _is_own_dir(top, name):
                left.append(name)
                continue
            left += [f"{name}/{x}" for x in _remove_rank_dir(top, name)]
        if not left:
            _unlink(top, MARKER)
    finally:
        os.close(top)
    if not left:
        _rmdir(path.parent, path.name)
    return left


def _remove_rank_dir(parent: int, name: str) -> list[str]:
    try:
        fd = os.open(name, _NOFOLLOW_DIR, dir_fd=parent)
    except FileNotFoundError:  # another agent of this job on the same host removed it first
        return []
    left = []
    try:
        for entry in os.listdir(fd):
            try:
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if _KNOWN_FILE.fullmatch(entry) and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                _unlink(fd, entry)
            else:
                left.append(entry)
    finally:
        os.close(fd)
    if not left:
        try:
            os.rmdir(name, dir_fd=parent)
        except FileNotFoundError:
            pass
    return left


def _is_own_dir(parent: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:  # another agent of this job on the same host removed it first
        pass


def _rmdir(parent: Path, name: str) -> None:
    fd = os.open(parent, _NOFOLLOW_DIR)
    try:
        os.rmdir(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
