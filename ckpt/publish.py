"""Crash-safe publication of checkpoints: temporary names, fsync, atomic rename, fsync of the parent.

A checkpoint is written under a dot-name (``.NAME.partial``) that no loader lists, made durable,
then renamed to NAME in one step and the parent directory is fsynced: at any moment a checkpoint
is either complete under its name or absent. The ``latest`` pointer is replaced the same way.
Older checkpoints are removed only after the new one is durable, and are first renamed to a
dot-name, so a crash during deletion never leaves a half checkpoint under a listed name.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from ckpt.async_ckpt.file_writer import fsync_path
from ckpt.errors import CheckpointError

log = logging.getLogger("nvrx.ckpt.publish")

LATEST = "latest"
PARTIAL_SUFFIX = ".partial"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def partial_path(final: Path) -> Path:
    """Where a checkpoint is written before it is published (same directory: rename stays atomic)."""
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def fsync_dir(path: Path) -> None:
    fsync_path(str(path))


def write_durable(path: Path, data: bytes) -> None:
    """Write DATA to PATH (created or truncated) and fsync it (its directory entry is the caller's business)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    with open(fd, "wb", closefd=True) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes) -> None:
    """Replace PATH with DATA so readers see the old or the new content, never a mix; durable on return."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(partial: Path, final: Path) -> None:
    """Make the complete directory PARTIAL visible as FINAL in one step (replacing an older FINAL)."""
    fsync_dir(partial)
    if final.exists():
        if not final.is_dir():
            raise CheckpointError(f"cannot publish checkpoint {final}: a file with that name exists; remove it or pick another path")
        if _exchange(partial, final):  # FINAL is the new one; PARTIAL now holds the old one
            fsync_dir(final.parent)
            discard(partial)
            return
        aside = final.parent / f".{final.name}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
        os.rename(partial, final)
        fsync_dir(final.parent)
        discard(aside)
        return
    os.rename(partial, final)
    fsync_dir(final.parent)


def publish_file(partial: Path, final: Path) -> None:
    os.replace(partial, final)
    fsync_dir(final.parent)


def update_latest(root: Path, name: str) -> None:
    """Point ROOT/latest at NAME (a checkpoint in ROOT), atomically and durably."""
    atomic_write(root / LATEST, (name + "\n").encode())


def read_latest(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if name and "/" not in name and not is_hidden(name) else None


def discard(path: Path) -> None:
    """Remove a checkpoint (or leftover): rename it to a dot-name first, then delete the files."""
    if not path.exists():
        return
    target = path
    if not is_hidden(path.name) or not path.name.endswith(".deleting"):
        target = path.parent / f".{path.name.lstrip('.')}.{uuid.uuid4().hex[:8]}.deleting"
        os.rename(path, target)
        fsync_dir(path.parent)
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def sweep_leftovers(root: Path) -> None:
    """Finish deletions a crash interrupted (dot-names ending in .deleting); never touches a save in progress."""
    try:
        entries = [e for e in os.listdir(root) if is_hidden(e) and (e.endswith(".deleting") or ".replaced-" in e)]
    except OSError:
        return
    for name in entries:
        try:
            discard(root / name)
        except OSError as exc:
            log.debug("cannot remove leftover %s: %s", root / name, exc)


def check_destination(final: Path) -> None:
    """Fail now, with the reason, if a checkpoint cannot be written at FINAL; creates its parent."""
    if final.name == LATEST or is_hidden(final.name):
        raise CheckpointError(f"cannot save checkpoint {final}: the name {final.name!r} is reserved (the `latest` "
                              "pointer and dot-names for unfinished ones); choose another name")
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"cannot save checkpoint {final}: a path component of {parent} is a file, not a directory; "
                              "choose another checkpoint path") from None
    except OSError as exc:
        raise CheckpointError(f"cannot save checkpoint {final}: cannot create {parent} ({exc.strerror}); "
                              "check that the file system is mounted and writable") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(parent) else "permission denied"
        raise CheckpointError(f"cannot save checkpoint {final}: {parent} is not writable ({reason}); "
                              "mount it read-write or choose another checkpoint path")
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"cannot save checkpoint {final}: a file with that name exists; remove it or pick another path")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
