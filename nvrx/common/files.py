"""Small file helpers: durable JSON (a reader sees a file whole-old or whole-new), and private run files.

A run's files (events, rank output, monitor logs) may hold data and paths other users must not read, so
they are created 0600 in 0700 directories whatever the umask (``private_dir``, ``open_private``).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Mapping

from nvrx.common.errors import NvrxError


def fsync_path(path: str | Path) -> None:
    """fsync a file or directory by name (a directory: makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: str | Path) -> Path:
    """``mkdir -p PATH`` where every directory this creates is 0700, whatever the umask.

    Directories that exist are left alone (a home directory, a shared scratch space, a directory the user
    made for the run on purpose). OSError (e.g. NotADirectoryError, PermissionError) if it cannot be made.
    """
    path = Path(path)
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR)
        except FileExistsError:  # another agent of the job made it meanwhile
            continue
        os.chmod(d, PRIVATE_DIR)  # mkdir's mode is filtered by the umask; chmod's is not
    if not path.is_dir():
        raise NotADirectoryError(20, "Not a directory", str(path))
    return path


def open_private(path: str | Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """Open (creating) PATH as a 0600 file whatever the umask; its directory is made with ``private_dir``."""
    path = Path(path)
    private_dir(path.parent)
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        if os.fstat(fd).st_mode & 0o777 != PRIVATE_FILE:
            os.fchmod(fd, PRIVATE_FILE)
    except OSError:
        os.close(fd)
        raise
    return fd


def save_json_atomic(path: Path, data: Mapping[str, Any], mode: int = 0o600) -> None:
    """Write DATA as JSON to PATH atomically: temp file in the same dir, fsync, rename, fsync dir.

    The file is created with MODE (private by default: these files steer our processes).
    """
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_path(path.parent)


def load_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at PATH, or None if the file does not exist. ValueError if it is not an object."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# ---------------------------------------------------------------- reading input files the user names


class NotRegularFile(NvrxError, OSError):
    """The path names a fifo, device, socket or directory: reading it could block forever or never end."""


class FileTooLarge(NvrxError, OSError):
    """The file holds more than the reader's bound: it is not the small input file it should be."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a fifo (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """'a fifo (named pipe)', 'a directory', ... for a stat mode (messages say what the path is instead)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> int:
    """A read-only fd of PATH, only if it is a regular file (NotRegularFile otherwise).

    Opened with O_NONBLOCK, so a fifo cannot block the open until some writer appears; a regular file
    ignores the flag. FOLLOW_SYMLINKS False refuses a symlink as the last component (ELOOP).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"is {file_kind(mode)}, not a regular file", str(path))
    return fd


def read_regular(path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of PATH, a regular file of at most LIMIT bytes (NotRegularFile, FileTooLarge, other OSError).

    Config, secret and progress files are small: a bound keeps a wrong path (a log, a data set, /dev/zero
    behind a symlink) from being read for minutes or filling the memory. The bound is checked on the bytes
    read, not only on st_size, which is 0 for /proc files and can grow while we read.
    """
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        if os.fstat(fd).st_size > limit:
            raise FileTooLarge(errno.EFBIG, f"is larger than {limit} bytes", str(path))
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > limit:
        raise FileTooLarge(errno.EFBIG, f"is larger than {limit} bytes", str(path))
    return b"".join(chunks)
