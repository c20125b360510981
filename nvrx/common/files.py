"""Small file helpers: atomic, durable writes (a reader sees a file whole-old or whole-new; the one home of
them), durable JSON, and private run files.

A run's files (events, rank output, monitor logs) may hold data and paths other users must not read, so
they are created 0600 in 0700 directories whatever the umask (``private_dir``, ``open_private``).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

from nvrx.common.errors import NvrxError

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


def open_private(path: str | Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND, fresh: bool = False) -> int:
    """Open (creating) PATH as a 0600 file whatever the umask; its directory is made with ``private_dir``.

    A symbolic link at PATH is never followed (ELOOP), and the file opened must be a regular file of ours
    (PermissionError otherwise): a link or a file planted in a run directory must not receive a job's output
    or have its mode changed. FRESH: whatever is at PATH (a file of an earlier launch, a link) is unlinked
    first and a new file is created exclusively (torchrun truncates its output files; this cannot be
    redirected to another file)."""
    path = Path(path)
    private_dir(path.parent)
    flags |= os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    if fresh:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        flags = (flags | os.O_EXCL) & ~os.O_TRUNC
    fd = os.open(path, flags, PRIVATE_FILE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(errno.EPERM, f"not a regular file of user {os.getuid()} (owner uid {st.st_uid}); "
                                  "refusing to write into it", str(path))
        if st.st_mode & 0o777 != PRIVATE_FILE:
            os.fchmod(fd, PRIVATE_FILE)
    except OSError:
        os.close(fd)
        raise
    return fd


class UnsafeDirectoryError(NvrxError, PermissionError):
    """A directory nvrx would write a run's files into, but that another user could have prepared."""


def owned_private_dir(path: str | Path) -> Path:
    """``private_dir(PATH)``, then refuse (UnsafeDirectoryError, one line) a PATH that is a symbolic link, is
    not a directory of this user, or that the group or others can write: nvrx made none of these (it makes
    0700 directories), and in such a directory another user can plant links where the run's files go."""
    path = Path(path)
    private_dir(path)
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        problem = f"can be written by others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        raise UnsafeDirectoryError(errno.EPERM, f"{path} {problem}: nvrx did not make it for this run and another "
                                   "user could plant files there", str(path))
    return path


def _temp_name(path: Path) -> str:
    """A temporary name beside PATH no other writer picks: host, pid and a random part (two nodes of a job may
    share a file system and a pid; the same process may write twice at once from two threads)."""
    host = socket.gethostname().replace("/", "_") or "host"
    return f".{path.name}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def atomic_write(path: str | Path, data: bytes | Callable[[BinaryIO], Any], mode: int = PRIVATE_FILE,
                 durable: bool = True) -> None:
    """Replace PATH with DATA so that a reader sees the old file or the whole new one, never a mix: the one home
    of atomic writes (checkpoint pointers and files, state files, flags).

    A temporary file beside PATH (same directory: the rename stays atomic; name unique per host, process and
    call) is created exclusively, never through a link, with MODE whatever the umask; DATA is written (bytes, or
    a function writing to the open binary file); DURABLE: the file is fsynced before the rename and the
    directory after it, so a crash right after this returns cannot lose it. On any failure the temporary is
    removed and PATH is untouched. The directory must exist.
    """
    path = Path(path)
    tmp = path.parent / _temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)  # the umask filtered os.open's mode
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_path(path.parent)


def save_json_atomic(path: Path, data: Mapping[str, Any], mode: int = 0o600) -> None:
    """Write DATA as JSON to PATH atomically and durably (``atomic_write``), in a directory made private if missing.

    The file is created with MODE (private by default: these files steer our processes).
    """
    path = Path(path)
    private_dir(path.parent)
    atomic_write(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), mode=mode)


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
