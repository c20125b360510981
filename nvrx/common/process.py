"""Process-level helpers: die with the parent, and the process title.

``die_with_parent`` is the one way an nvrx child process ties its life to its parent's (the fork server
and its ranks, the rank monitors, the launch under ``nvrx resume``, the checkpoint writer).
``set_process_title`` gives a rank the command line and name it would have under torchrun, whether it
was forked from the template process or spawned through the bootstrap.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import signal
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
COMM_MAX = 15  # bytes of a process name (the kernel's TASK_COMM_LEN less the NUL)

try:  # resolved at import, never in a forked child: ctypes lookups allocate and may take locks
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _PRCTL = _LIBC.prctl
    _STRDUP = _LIBC.strdup
    _STRDUP.restype = ctypes.c_void_p
    _STRDUP.argtypes = [ctypes.c_void_p]
except (OSError, AttributeError):  # not Linux: only the parent check below applies
    _LIBC = _PRCTL = _STRDUP = None


def python_module_command(python: str, module: str, *args: str) -> list[str]:
    """``python -P -m MODULE ARGS``: one of our own processes, started from any working directory.

    ``-P`` keeps the current directory off sys.path, so a user's file named like a module we import
    (``torch.py``, ``yaml.py``, ...) in the directory nvrx was started from cannot replace it.
    """
    return [python, "-P", "-m", module, *args]


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Get SIG when the process PARENT_PID dies; if it already died, exit now with status 128 + SIG.

    The check after ``prctl`` closes the race where the parent died between our fork and this call (we
    would have been re-parented and the death signal never sent). Exiting (not ``kill(self)``) behaves
    the same whatever the caller's signal mask and handlers are. Safe in a ``preexec_fn`` and right after
    ``fork`` in a threaded parent: no allocation, no Python-level locks.

    Linux sends the signal when the *thread* that forked us exits, not the process: start such children
    from a thread that lives as long as the parent (the main thread).
    """
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(128 + int(sig))


# ---------------------------------------------------------------- the process title


@dataclass(frozen=True)
class _ArgArea:
    """Where the kernel took this process's command line and environment from (``/proc/PID/stat``).

    ``/proc/PID/cmdline`` shows the bytes in [arg_start, arg_end); when the last of them is no longer
    NUL it shows one string from arg_start on, running into the environment strings if they follow
    (what setproctitle(3) relies on), at most a page of it.
    """

    arg_start: int
    arg_end: int
    env_start: int
    env_end: int

    @classmethod
    def of_this_process(cls) -> "_ArgArea":
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
        area = cls(*(int(f) for f in fields[45:49]))  # fields 48-51 of proc(5); fields[0] is field 3
        if not 0 < area.arg_start < area.arg_end <= area.env_start <= area.env_end:
            raise ValueError(f"implausible argument area {area}")
        return area

    def room(self) -> int:
        """Bytes a title may take, NUL included: the environment's too when it follows the arguments."""
        if self.env_start != self.arg_end:
            return self.arg_end - self.arg_start
        return min(self.env_end - self.arg_start, mmap.PAGESIZE)


def set_process_title(argv: Sequence[str]) -> bool:
    """Show ARGV as this process's command line and ``basename(ARGV[0])`` as its name.

    Tools find processes by what ``/proc/PID/cmdline`` and ``/proc/PID/comm`` say (``ps``, ``top``,
    ``pgrep -f train.py``, GPU process lists); a rank forked from the template process would
    otherwise show the template's command line. The strings are rewritten in place, in the memory
    the kernel reads them from: the environment strings the C library still points into are copied
    out first (``getenv``, ``os.environ`` and ``sys.argv`` see no change). ARGV joined by NULs
    replaces the arguments, the rest of their area zero-filled; when it does not fit, it is written
    as one space-joined string overflowing into the environment area (shown whole by the kernel, as
    setproctitle(3) does; ``/proc/PID/environ`` then starts with that string). Call it from the main
    thread (the name is the calling thread's) before other threads read the environment.

    Returns False, after one debug line, when this is not possible here (no ``/proc``, not Linux).
    """
    encoded = [os.fsencode(a) for a in argv]
    if _PRCTL is None or not encoded:
        log.debug("process title not set: no prctl here or an empty command line")
        return False
    _PRCTL(PR_SET_NAME, ctypes.c_char_p(os.path.basename(encoded[0])[:COMM_MAX]), 0, 0, 0)
    try:
        area = _ArgArea.of_this_process()
    except (OSError, ValueError, IndexError) as exc:
        log.debug("process title not set: cannot read /proc/self/stat (%s)", exc)
        return False
    try:
        _relocate_environ(area)
    except (ValueError, MemoryError) as exc:  # no C `environ` symbol, or out of memory: leave the area alone
        log.debug("process title not set: cannot move the environment out of the way (%s)", exc)
        return False
    _write_title(area, encoded)
    return True


def _relocate_environ(area: _ArgArea) -> None:
    """Point the C environment and glibc's program name at copies of the strings inside AREA, so that
    overwriting AREA changes nothing anyone reads through them. The copies are never freed: the C
    library may hand them out (``getenv``) for the rest of the process."""
    lo, hi = area.arg_start, area.env_end
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(_LIBC, "environ")
    i = 0
    while environ[i]:
        if lo <= environ[i] < hi:
            environ[i] = _strdup(environ[i])
        i += 1
    for name in ("program_invocation_name", "program_invocation_short_name"):
        try:
            pointer = ctypes.c_void_p.in_dll(_LIBC, name)
        except ValueError:  # not glibc
            continue
        if pointer.value is not None and lo <= pointer.value < hi:
            pointer.value = _strdup(pointer.value)


def _strdup(address: int) -> int:
    copy = _STRDUP(address)
    if not copy:
        raise MemoryError("strdup failed while moving the environment out of the argument area")
    return copy


def _write_title(area: _ArgArea, argv: list[bytes]) -> None:
    size = area.arg_end - area.arg_start
    title = b"\0".join(argv) + b"\0"
    if len(title) > size:  # does not fit: one string into the environment area, as setproctitle(3)
        title = b" ".join(argv)[:area.room() - 1] + b"\0"
        size = max(size, _end_of_string_at(area.arg_start + len(title) - 1, area.env_end) - area.arg_start)
    ctypes.memmove(area.arg_start, title, len(title))
    ctypes.memset(area.arg_start + len(title), 0, size - len(title))


def _end_of_string_at(address: int, limit: int) -> int:
    """The address just past the NUL that ends the string ADDRESS points into (at most LIMIT): a title
    overflowing into the environment blanks the rest of the variable it cut, leaving no half entries."""
    while address < limit and ctypes.c_char.from_address(address).value != b"\0":
        address += 1
    return min(address + 1, limit)
