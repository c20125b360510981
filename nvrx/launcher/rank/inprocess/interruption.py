"""Deliver the restart exception to the main thread only when it is allowed to arrive.

The main thread opens the gate while it runs the iteration (initialize, health check, the wrapped
function, the completion barrier) and closes it when it leaves. The monitor thread may interrupt only
through an open gate: under the gate's lock it runs the abort, then raises ``RestartInterrupt`` in the
main thread (``PyThreadState_SetAsyncExc``) and sends the main thread a signal, because an
asynchronous exception is only noticed between bytecodes and a blocking call such as ``time.sleep``
would otherwise hold it back until it returns (measured: the signal makes a 1.5 s sleep end after 0.3 s
instead of 1.5 s). The handler for that signal does nothing; running it is what delivers the exception.

The same lock is ``CallWrapper.atomic()``: while the wrapped function holds it, no interrupt is raised;
once an interrupt is under way, ``atomic()`` refuses to start. Closing the gate withdraws an interrupt
that was raised but has not arrived yet, so it can never land in the Wrapper's own code.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
from typing import Callable, Iterator
from contextlib import contextmanager

from nvrx.launcher.rank.inprocess.exceptions import RestartInterrupt

log = logging.getLogger(__name__)

NUDGE_SIGNAL = signal.SIGRTMIN + 5

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.py_object]
_set_async_exc.restype = ctypes.c_int


def _raise_in(thread_id: int, exc_type: type[BaseException] | None) -> None:
    if exc_type is None:
        _set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object())  # NULL: withdraw a pending one
    else:
        _set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type))


def _ignore_nudge(signum: int, frame: object) -> None:
    """Running this handler is enough: the pending exception is raised as soon as bytecode runs."""


class InterruptGate:
    """The lock and flags shared by the main thread, the monitor thread and ``atomic()``."""

    def __init__(self, thread: threading.Thread | None = None) -> None:
        thread = thread or threading.current_thread()
        self.thread_id = thread.ident or threading.get_ident()
        self.lock = threading.RLock()
        self.is_open = False
        self.raised = False  # an interrupt was raised while the gate was open
        self.aborted = False  # the abort ran in this iteration
        self._old_handler: object = None
        self._nudge = thread is threading.main_thread()

    # ------------------------------------------------------------ lifetime

    def install(self) -> None:
        """Install the do-nothing handler for the nudge signal (main thread only)."""
        if self._nudge and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(NUDGE_SIGNAL, _ignore_nudge)
        else:
            self._nudge = False

    def uninstall(self) -> None:
        if self._nudge and self._old_handler is not None:
            signal.signal(NUDGE_SIGNAL, self._old_handler)  # type: ignore[arg-type]
            self._old_handler = None

    # ------------------------------------------------------------ main thread

    def open(self) -> None:
        with self.lock:
            self.is_open = True
            self.raised = False
            self.aborted = False

    def close(self) -> bool:
        """Close the gate and withdraw a pending interrupt; returns whether one had been raised.

        An interrupt already on its way may land while we close: it is absorbed and we try again.
        """
        while True:
            try:
                with self.lock:
                    self.is_open = False
                    if self.raised:
                        _raise_in(self.thread_id, None)
                    return self.raised
            except RestartInterrupt:
                continue

    def abort_once(self, abort: Callable[[], None]) -> None:
        """Run ABORT unless the monitor thread already did in this iteration."""
        with self.lock:
            if self.aborted:
                return
            self.aborted = True
        abort()

    @contextmanager
    def atomic(self) -> Iterator[None]:
        with self.lock:
            if self.raised:
                raise RestartInterrupt("a restart is under way; atomic() block not entered")
            yield

    # ------------------------------------------------------------ monitor thread

    def interrupt(self, abort: Callable[[], None], nudge: bool = True) -> bool:
        """Abort and interrupt the main thread, if the gate is open and no interrupt was raised yet.

        NUDGE=False raises the exception without the signal: it arrives when the main thread next runs
        bytecode, so a thread stuck in a blocking call stays stuck (and the hard timeout ends the rank).
        """
        with self.lock:
            if not self.is_open or self.raised:
                return False
            if not self.aborted:
                self.aborted = True
                try:
                    abort()
                except Exception:
                    log.exception("abort failed; interrupting the wrapped function anyway")
            self._raise(nudge)
            return True

    def reraise(self) -> bool:
        """Raise again after the wrapped function swallowed the interrupt (gate still open)."""
        with self.lock:
            if not self.is_open or not self.raised:
                return False
            self._raise()
            return True

    def _raise(self, nudge: bool = True) -> None:
        self.raised = True
        _raise_in(self.thread_id, RestartInterrupt)
        if self._nudge and nudge:
            try:
                signal.pthread_kill(self.thread_id, NUDGE_SIGNAL)
            except (OSError, ValueError):
                pass
