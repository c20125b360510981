"""Aborted process groups, kept referenced until their gloo worker threads are idle.

Why (measured with torch 2.13, CPU): ``~ProcessGroupGloo`` waits for its work queue to drain and joins its
worker threads, and it runs in whichever thread drops the last reference, holding the GIL when that is a
Python thread (a DDP model freed while the restart unwinds, a garbage collection). A worker that is still
finishing an all-reduce started inside ``backward()`` needs the GIL for a moment: ``backward()`` stashes a
Python object (``contextvars.Context``) in the thread-local state every such work captures, and freeing the
work frees that object. The joining thread waits for the worker, the worker waits for the GIL: the rank hangs
for good (seen in the goodput benchmark's hang runs, one restart in ~30, gdb: main thread in
``std::thread::join`` under ``~ProcessGroupGloo``, a ``pt_gloo_runloop`` thread in ``gil_scoped_acquire``
under ``~AsyncAllreduceWork``).

So the abort keeps every group it aborts here (``keep``), and they are let go only when no gloo worker thread
of this process is busy (``release_if_idle``, at the start of the next iteration, waiting with the GIL
released). A worker is idle when it sleeps in its queue's untimed condition wait; one that waits for the GIL
(a timed wait), runs, or waits in a collective (timed) is not. Where that cannot be read (no /proc), the
groups stay referenced until exit; at exit, groups still busy are pinned for good (never freed), so the
interpreter's teardown cannot hang on them either.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

WORKER_NAME = "pt_gloo_runloop"  # the name ProcessGroupGloo gives its worker threads
_lock = threading.Lock()
_kept: list[Any] = []


def keep(groups: list[Any]) -> None:
    """Hold references to GROUPS (process groups about to be aborted) until their workers are idle."""
    with _lock:
        _kept.extend(groups)


def kept() -> int:
    with _lock:
        return len(_kept)


def _worker_tids() -> list[str] | None:
    """Thread ids of this process's gloo worker threads; None without /proc."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().strip() == WORKER_NAME:
                    found.append(tid)
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _idle(tid: str) -> bool | None:
    """True when thread TID sleeps in an untimed wait (its queue's condition variable); None if unreadable.

    /proc/<tid>/syscall: "running", or the syscall number followed by its six arguments; a futex wait's fourth
    argument is its timeout (0: none). The GIL and a collective wait with a timeout."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as fh:
            fields = fh.read().split()
    except FileNotFoundError:
        return True  # ended: nothing left to join
    except OSError:
        return None
    if len(fields) < 5 or fields[0] in ("running", "-1"):
        return False
    return int(fields[4], 16) == 0


def workers_idle() -> bool | None:
    """True when every gloo worker thread of this process is idle; None when this cannot be read here."""
    tids = _worker_tids()
    if tids is None:
        return None
    states = [_idle(t) for t in tids]
    if any(s is None for s in states):
        return None
    return all(states)


def release_if_idle(wait: float) -> int:
    """Let the kept groups go once the gloo workers are idle (polling up to WAIT s, GIL released); how many."""
    if not kept():
        return 0
    deadline = time.monotonic() + wait
    while True:
        idle = workers_idle()
        if idle:
            break
        if idle is None or time.monotonic() >= deadline:
            log.debug("keeping %d aborted process group(s): gloo workers %s", kept(),
                      "busy" if idle is False else "cannot be inspected here")
            return 0
        time.sleep(0.005)  # lets a worker that waits for the GIL take it
    with _lock:
        groups = list(_kept)
        _kept.clear()
    count = len(groups)
    del groups  # the destructors join idle workers: quick
    log.debug("released %d aborted process group(s)", count)
    return count


@atexit.register
def _at_exit() -> None:
    """Free idle groups; pin busy ones so the interpreter's teardown never joins a worker waiting for the GIL."""
    if release_if_idle(wait=1.0):
        return
    with _lock:
        for group in _kept:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
        _kept.clear()
