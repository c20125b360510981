"""Automatic heartbeat: beat while the rank's main thread keeps executing Python bytecode.

A daemon thread asks the interpreter to run a tiny callback in the main thread
(``Py_AddPendingCall``). The interpreter runs pending calls only between bytecodes of the main
thread, so the callback, which stores the time into the heartbeat slot, runs only while the main
thread is executing Python code. A call that blocks the interpreter (a hung collective, even one that
released the GIL) stops the beats, and the monitor's heartbeat timeout fires. A ``while True`` livelock
still beats: that is what manual heartbeats and sections are for.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable

log = logging.getLogger("nvrx.progress_watchdog")

_PENDING_CALL = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_add_pending_call = ctypes.pythonapi.Py_AddPendingCall
_add_pending_call.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_add_pending_call.restype = ctypes.c_int


class ProgressWatchdog:
    """Every ``interval`` seconds, schedule one ``beat()`` in the main thread unless one is still queued."""

    def __init__(self, beat: Callable[[], None], interval: float) -> None:
        self._beat = beat
        self.interval = interval
        self._queued = threading.Event()
        self._stop = threading.Event()
        self._callback = _PENDING_CALL(self._in_main_thread)  # kept alive as long as we are
        self._thread = threading.Thread(target=self._loop, name="nvrx-progress-watchdog", daemon=True)

    def _in_main_thread(self, _arg: int) -> int:
        self._queued.clear()
        try:
            self._beat()
        except Exception:  # must never raise into the user's code
            pass
        return 0

    def _loop(self) -> None:
        pointer = ctypes.cast(self._callback, ctypes.c_void_p)
        while not self._stop.wait(self.interval):
            if self._queued.is_set():
                continue  # the main thread has not run bytecode since the last request: no beat
            self._queued.set()
            if _add_pending_call(pointer, None) != 0:
                self._queued.clear()  # the interpreter's queue is full: try next time

    def start(self) -> "ProgressWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def watchdog_interval(heartbeat_timeout: float | None) -> float:
    """Beat often enough that a live rank never comes near its heartbeat timeout."""
    if heartbeat_timeout is None:
        return 1.0
    return max(0.01, min(1.0, heartbeat_timeout / 10.0))
