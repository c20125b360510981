"""Automatic heartbeat: beat while the rank's main thread keeps executing Python bytecode.

A daemon thread asks the interpreter to run a tiny C call in the main thread (``Py_AddPendingCall``
with libc's ``sem_post`` on a semaphore of ours) and waits on that semaphore. The interpreter runs
pending calls only between bytecodes of the main thread, so the semaphore is posted only while the
main thread is executing Python code; when it is, the daemon thread calls ``beat()`` and asks again
after ``interval``. A call that blocks the interpreter (a hung collective, even one that released the
GIL) stops the beats, and the monitor's heartbeat timeout fires. A ``while True`` livelock still beats:
that is what manual heartbeats and sections are for.

The pending call is C, not a Python callback: no Python code of ours runs in the main thread, so an
asynchronous exception meant for the user's code (the in-process restart's) can never be raised, and
lost, inside the watchdog. ``beat()`` therefore runs in the watchdog thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("nvrx.progress_watchdog")

_add_pending_call = ctypes.pythonapi.Py_AddPendingCall
_add_pending_call.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_add_pending_call.restype = ctypes.c_int

_libc = ctypes.CDLL(None, use_errno=True)
_SEM_POST = ctypes.cast(_libc.sem_post, ctypes.c_void_p)  # int sem_post(sem_t *): 0 on success, as a pending call must
_sem_init = _libc.sem_init
_sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_sem_timedwait = _libc.sem_timedwait
_sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_SEM_SIZE = 64  # sizeof(sem_t) is 32 on 64-bit Linux; leave room


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# A queued pending call may still run after its watchdog is gone: its semaphore must never be freed.
_semaphores: list[ctypes.Array] = []


class ProgressWatchdog:
    """Every ``interval`` seconds, queue one ``sem_post`` in the main thread; ``beat()`` when it ran."""

    def __init__(self, beat: Callable[[], None], interval: float) -> None:
        self._beat = beat
        self.interval = interval
        self._stop = threading.Event()
        self._sem = ctypes.create_string_buffer(_SEM_SIZE)
        _semaphores.append(self._sem)
        if _sem_init(ctypes.addressof(self._sem), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._thread = threading.Thread(target=self._loop, name="nvrx-progress-watchdog", daemon=True)

    def _ran(self, timeout: float) -> bool:
        """Wait up to TIMEOUT for the main thread to run the queued call."""
        deadline = time.time() + timeout
        spec = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        while True:
            if _sem_timedwait(ctypes.addressof(self._sem), ctypes.byref(spec)) == 0:
                return True
            if ctypes.get_errno() != errno.EINTR:
                return False

    def _loop(self) -> None:
        sem = ctypes.c_void_p(ctypes.addressof(self._sem))
        while not self._stop.is_set():
            if _add_pending_call(_SEM_POST, sem) != 0:  # the interpreter's queue is full: try next time
                self._stop.wait(self.interval)
                continue
            while not self._stop.is_set():  # queued; beat when the main thread gets to it
                if self._ran(self.interval):
                    try:
                        self._beat()
                    except Exception:  # a beat must never end the watchdog
                        log.debug("beat failed", exc_info=True)
                    break
            self._stop.wait(self.interval)

    def start(self) -> "ProgressWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread to end (within about one interval): whoever started the
        watchdog for a bounded time (a Wrapper call) leaves no thread of it behind."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5.0)


def watchdog_interval(heartbeat_timeout: float | None, auto_floor: float | None = None) -> float:
    """Beat often: a live rank never comes near its timeout, and when one rank hangs and its peers then
    block in a collective waiting for it, the hung rank's last beat is clearly the earliest, so its
    monitor fires first and the failure report blames the right rank. AUTO_FLOOR, the floor of the automatic
    timeout (when it is on), counts as a timeout too: its gaps must measure the rank, not the watchdog."""
    shortest = min((t for t in (heartbeat_timeout, auto_floor) if t is not None), default=None)
    if shortest is None:
        return 0.1
    return max(0.01, min(0.1, shortest / 100.0))
