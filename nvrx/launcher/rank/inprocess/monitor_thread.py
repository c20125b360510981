"""The in-process monitor thread: notices faults (on any rank, or no progress here) and interrupts the wrapped function.

Every ``monitor_thread_interval`` it reads the fault counter in the store; when it grew past the value
this iteration started with, it waits ``last_call_wait`` so that concurrent faults from other ranks are
recorded too, then, through the ``InterruptGate``, runs the abort and raises ``RestartInterrupt`` in
the main thread. It also records a soft timeout when the main thread made no progress for
``soft_timeout`` seconds, and notices a swallowed interrupt (logged at DEBUG with its location, then
raised again). While the main thread is inside ``init_process_group`` (or ``new_group``) it is waiting for
its peers to join, a rendezvous like the Wrapper's barriers: there ``rendezvous_timeout`` (the Wrapper's
``barrier_timeout``) applies instead of the soft timeout, so a slow start-up on a loaded machine is not
taken for a hang (a peer that fails meanwhile is recorded by its own rank or monitor process). While it
does, the thread tells the monitor process (``on_rendezvous``), whose hard timeout then counts from the
thread's last word: a thread that can still run shows that the GIL is not held. If the store stops answering it interrupts the main thread and reports the loss, which
ends the Wrapper with a clear message.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable

from nvrx.launcher.rank.inprocess.exceptions import RestartInterrupt, swallow_location
from nvrx.launcher.rank.inprocess.interruption import InterruptGate
from nvrx.launcher.rank.inprocess.progress import ProgressRecorder
from nvrx.launcher.rank.inprocess.store import StoreMixin, first_line

log = logging.getLogger(__name__)

SOFT_TIMEOUT_REASON = "soft timeout"
STORE_FAILURES_TOLERATED = 3  # consecutive failed polls before the store counts as lost
# torch.distributed calls that create a process group: each waits in C++ for every member to join
RENDEZVOUS_CALLS = frozenset({"init_process_group", "new_group"})


def in_rendezvous(thread_id: int) -> str | None:
    """The torch.distributed call that creates a process group THREAD_ID is inside right now, if any."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        code = frame.f_code
        if code.co_name in RENDEZVOUS_CALLS and "torch" in code.co_filename and "distributed" in code.co_filename:
            return code.co_name
        frame = frame.f_back
    return None


class InprocessMonitorThread:
    """The Wrapper's thread in the rank: watches the store and this rank's progress while an iteration runs."""

    def __init__(self, store: StoreMixin, gate: InterruptGate, recorder: ProgressRecorder, abort: Callable[[], None],
                 *, rank: int, interval: float, last_call_wait: float, soft_timeout: float,
                 rendezvous_timeout: float | None = None, on_rendezvous: Callable[[], None] | None = None) -> None:
        self.store = store
        self.gate = gate
        self.recorder = recorder
        self.abort = abort
        self.rank = rank
        self.interval = interval
        self.last_call_wait = last_call_wait
        self.soft_timeout = soft_timeout
        self.rendezvous_timeout = max(soft_timeout, rendezvous_timeout or soft_timeout)
        self.on_rendezvous = on_rendezvous or _no_abort
        self.store_lost: str | None = None
        self._cv = threading.Condition()
        self._armed = False
        self._iteration = 0
        self._fault_base = 0
        self._soft_reported = False
        self._rendezvous_noted = False
        self._stalled_restart: int | None = None  # the last iteration restarted while this rank was stalled
        self._stop = False
        self._seen: RestartInterrupt | None = None  # the last interrupt instance known not to be swallowed
        self._delivered_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="inprocess-monitor", daemon=True)

    def start(self) -> "InprocessMonitorThread":
        self._thread.start()
        return self

    def arm(self, iteration: int, fault_base: int) -> None:
        with self._cv:
            self._armed = True
            self._iteration = iteration
            self._fault_base = fault_base
            self._soft_reported = False
            self._rendezvous_noted = False
            self._cv.notify_all()

    @property
    def fault_base(self) -> int:
        return self._fault_base

    def disarm(self) -> None:
        with self._cv:
            self._armed = False

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            # The abort callback is a bound method of the session that owns this thread: dropping it (and the
            # store connection) breaks the cycle, so the session's store closes when its call returns, not
            # whenever the garbage collector runs.
            self.abort = _no_abort
            self.store = None  # type: ignore[assignment]

    # ------------------------------------------------------------ the loop

    def _wait(self, seconds: float) -> bool:
        """Sleep SECONDS (or until armed/stopped); False once stopped."""
        with self._cv:
            if not self._stop:
                self._cv.wait(seconds)
            return not self._stop

    def _run(self) -> None:
        failures = 0
        while self._wait(self.interval):
            with self._cv:
                if not self._armed:
                    continue
                iteration, base = self._iteration, self._fault_base
            try:
                self._poll(iteration, base)
                failures = 0
            except Exception as exc:
                failures += 1
                if failures >= STORE_FAILURES_TOLERATED and self.store_lost is None:
                    self.store_lost = first_line(exc)
                    log.error("the in-process restart store at %s stopped answering (%s); the job cannot continue "
                              "without it: interrupting", self.store.describe(), self.store_lost)
                    self._interrupt()

    def _poll(self, iteration: int, base: int) -> None:
        if self.gate.raised:
            self._check_swallowed()
            return
        count = self.store.fault_count()
        if count > base:
            if self.last_call_wait > 0 and not self._wait(self.last_call_wait):
                return
            with self._cv:
                if not self._armed or self._iteration != iteration:
                    return
            faults = self.store.faults()[base:]
            summary = "; ".join(f"rank {f['rank']}: {f['reason']}" for f in faults)
            log.info("restarting: %s", summary or "fault recorded")
            # A stalled rank's first restart interrupts even a blocking call (a restart attempt); stalled again
            # in the very next iteration it gets only the exception, as in NVRx, and the hard timeout ends it
            # if it is stuck for good (instead of being restarted into the same hang forever).
            stalled = self._stalled()
            self._interrupt(nudge=not (stalled and self._stalled_restart == iteration - 1))
            self._stalled_restart = iteration if stalled else None
            return
        self._check_soft_timeout(iteration)

    def _stalled(self) -> bool:
        """This rank's main thread made no progress for at least half the soft timeout (peers stuck waiting on
        the same hang reach the soft timeout within moments of each other, in either order)."""
        progress = self.recorder.progress()
        return progress.running and progress.stalled_for(time.monotonic()) >= self.soft_timeout / 2

    def _check_soft_timeout(self, iteration: int) -> None:
        progress = self.recorder.progress()
        if not progress.running or self._soft_reported:
            return
        stalled = progress.stalled_for(time.monotonic())
        if stalled <= self.soft_timeout / 2:
            return
        call = in_rendezvous(self.gate.thread_id)
        if call is not None and stalled <= self.rendezvous_timeout:
            self.on_rendezvous()  # keeps the monitor process's hard timeout off a rank that only waits for peers
            if stalled > self.soft_timeout and not self._rendezvous_noted:
                self._rendezvous_noted = True
                log.info("no progress for %.1f s inside %s (waiting for the other ranks to join): the barrier timeout "
                         "(%g s) applies there, not the soft timeout", stalled, call, self.rendezvous_timeout)
            return
        if stalled <= self.soft_timeout:
            return
        self._soft_reported = True
        where = f" inside {call}" if call is not None else ""
        limit = (f"barrier_timeout={self.rendezvous_timeout:g} s" if call is not None
                 else f"soft_timeout={self.soft_timeout:g} s")
        reason = f"{SOFT_TIMEOUT_REASON}: no progress for {stalled:.1f} s{where} ({limit})"
        log.warning("%s", reason)
        self.store.record_fault(self.rank, iteration, reason)

    def _interrupt(self, nudge: bool = True) -> None:
        before = RestartInterrupt.last
        if self.gate.interrupt(self.abort, nudge):
            self._seen = before
            self._delivered_at = None

    def _check_swallowed(self) -> None:
        """The interrupt arrived, yet the main thread is still in the iteration a soft timeout later.

        Unwinding may legitimately take a while (exception handlers, ``__exit__`` methods), so only
        after ``soft_timeout`` is the interrupt taken as swallowed: logged with its location at DEBUG
        and raised again.
        """
        last = RestartInterrupt.last
        if last is None or last is self._seen or not self.gate.is_open:
            return
        now = time.monotonic()
        if self._delivered_at is None:
            self._delivered_at = now
            return
        if now - self._delivered_at < self.soft_timeout:
            return
        log.debug("the wrapped function suppressed the restart exception (%s); raising it again",
                  swallow_location(last))
        self._seen = last
        self._delivered_at = None
        self.gate.reraise()


def _no_abort() -> None:
    """The abort callback of a stopped monitor thread (which never calls it); also the default rendezvous note."""


# NVRx's name for the exception the monitor thread raises in the main thread.
RankShouldRestart = RestartInterrupt
