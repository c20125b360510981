"""Process-level helpers: die with the parent.

``die_with_parent`` is the one way an nvrx child process ties its life to its parent's (the fork server
and its ranks, the rank monitors, the launch under ``nvrx resume``, the checkpoint writer).
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1

try:  # resolved at import, never in a forked child: ctypes lookups allocate and may take locks
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _PRCTL = _LIBC.prctl
except (OSError, AttributeError):  # not Linux: only the parent check below applies
    _LIBC = _PRCTL = None


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
