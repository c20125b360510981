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
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from nvrx.common import files
from nvrx.common.files import fsync_path
from nvrx.ckpt.errors import CheckpointCleanupError, CheckpointError

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
    """Replace PATH with DATA so readers see the old or the new content, never a mix; durable on return
    (``nvrx.common.files.atomic_write``: file and directory fsynced)."""
    files.atomic_write(path, data, mode=0o644)


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


def cleanup_error(final: Path, step: str, exc: Exception) -> CheckpointCleanupError:
    """The error for checkpoint FINAL, already published, when STEP after it (moving ``latest``, pruning) failed."""
    reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
    return CheckpointCleanupError(f"checkpoint {final} was published and is complete, but {step} failed: {reason}{where}; "
                                  f"check that {final.parent} is writable and has space (the loader still finds the "
                                  "newest complete checkpoint without `latest`)")


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


OWNER_FILE = ".nvrx_owner.json"  # inside a partial directory: which process started that save
STALE_PARTIAL_SECONDS = 3600.0  # a partial nobody can vouch for is stale after this long without a change


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process PID started (clock ticks since boot), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; the name in (...) may hold spaces
    except (ValueError, IndexError):
        return None


def owner_record(pid: int) -> dict:
    """What ``write_owner`` records of process PID: its machine's boot, its pid and when it started."""
    return {"boot_id": _boot_id(), "pid": pid, "start": _start_ticks(pid)}


def write_owner(partial: Path) -> None:
    """Record in PARTIAL which process is writing it (removed before it is published), for ``sweep_stale_partials``."""
    try:
        (partial / OWNER_FILE).write_text(json.dumps(owner_record(os.getpid())))
    except OSError as exc:  # only the sweep loses: it falls back to the idle time
        log.debug("cannot record the owner of %s: %s", partial, exc)


def _owner_alive(partial: Path) -> bool | None:
    """Whether the process that started PARTIAL still runs; None when that cannot be told from here."""
    try:
        owner = json.loads((partial / OWNER_FILE).read_text())
        pid, start, boot = int(owner["pid"]), owner["start"], owner["boot_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if boot is None or start is None or boot != _boot_id():
        return None  # written on another node (or before a reboot we cannot see): use the idle time
    return _start_ticks(pid) == start  # a reused pid has another start time


def _last_change(path: Path) -> float:
    """The newest modification time of PATH and, for a directory, of the entries directly in it."""
    newest = path.lstat().st_mtime
    if path.is_dir():
        for entry in os.scandir(path):
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    return newest


def is_partial_name(name: str) -> bool:
    """True for the ``.NAME.partial`` names this package gives unfinished checkpoints (and only those)."""
    inner = name[1:-len(PARTIAL_SUFFIX)] if name.startswith(".") and name.endswith(PARTIAL_SUFFIX) else ""
    return bool(inner) and not is_hidden(inner) and "/" not in inner and inner != LATEST


def sweep_stale_partials(root: Path, keep: set[str] | frozenset[str] = frozenset(),
                         idle_seconds: float = STALE_PARTIAL_SECONDS) -> list[str]:
    """Remove ``.NAME.partial`` leftovers of saves that died in ROOT; returns the names removed.

    A partial is stale when the process that started it is known to be gone (its owner record names a
    process of this machine that no longer runs), or, when that cannot be told (another node, no record,
    a torch.save-style file), when nothing in it changed for IDLE_SECONDS. Partials of live processes,
    and the names in KEEP (saves this process still has pending), are never touched.
    """
    try:
        names = [n for n in os.listdir(root) if is_partial_name(n) and n not in keep]
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in names:
        path = root / name
        try:
            alive = _owner_alive(path) if path.is_dir() else None
            stale = not alive if alive is not None else now - _last_change(path) > idle_seconds
            if stale:
                discard(path)
                removed.append(name)
        except OSError as exc:
            log.debug("cannot sweep %s: %s", path, exc)
    if removed:
        log.info("removed %d unfinished checkpoint(s) left by crashed saves in %s: %s", len(removed), root,
                 ", ".join(removed))
    return removed


def check_destination(final: Path) -> None:
    """Fail now, with the reason, if a checkpoint cannot be written at FINAL.

    Creates the checkpoint root (FINAL's parent) if needed, but only that last level: if its parent is
    missing too, the file system meant to hold checkpoints is most likely not mounted, and creating the
    path would silently put checkpoints on the node's local disk, where a restarted job never finds them.
    """
    if final.name == LATEST or is_hidden(final.name):
        raise CheckpointError(f"cannot save checkpoint {final}: the name {final.name!r} is reserved (the `latest` "
                              "pointer and dot-names for unfinished ones); choose another name")
    root = final.parent
    if not root.is_dir():
        _refuse_missing_parent(final, root)
        try:
            root.mkdir(mode=0o700)  # private: loading unpickles what is in here (nvrx.ckpt.loader.check_private)
            os.chmod(root, 0o700)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            if not root.is_dir():
                raise CheckpointError(f"cannot save checkpoint {final}: {root} is a file, not a directory; "
                                      "choose another checkpoint path") from None
        except NotADirectoryError:
            raise CheckpointError(f"cannot save checkpoint {final}: a path component of {root} is a file, not a "
                                  "directory; choose another checkpoint path") from None
        except OSError as exc:
            raise CheckpointError(f"cannot save checkpoint {final}: cannot create {root} ({exc.strerror}); "
                                  "check that the file system is mounted and writable") from None
    if not os.access(root, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(root) else "permission denied"
        raise CheckpointError(f"cannot save checkpoint {final}: {root} is not writable ({reason}); "
                              "mount it read-write or choose another checkpoint path")
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"cannot save checkpoint {final}: a file with that name exists; remove it or pick another path")


def _refuse_missing_parent(final: Path, root: Path) -> None:
    """Raise unless ROOT's parent is an existing directory (then creating ROOT alone is safe)."""
    if root.exists() and not root.is_dir():  # another rank may have created it since the caller looked
        raise CheckpointError(f"cannot save checkpoint {final}: {root} is a file, not a directory; "
                              "choose another checkpoint path")
    ancestor = next(a for a in root.parents if a.exists())  # the file system root always does
    if not ancestor.is_dir():
        raise CheckpointError(f"cannot save checkpoint {final}: a path component of {root} ({ancestor}) is a file, "
                              "not a directory; choose another checkpoint path")
    if ancestor != root.parent:
        raise CheckpointError(f"cannot save checkpoint {final}: {root.parent} does not exist (is its file system "
                              f"mounted?); only the last level ({root.name}) is created automatically, so that "
                              f"checkpoints never land on a local disk by mistake: mount the file system or create "
                              f"{root.parent} first")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
