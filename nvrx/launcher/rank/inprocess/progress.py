"""Where this rank's progress is recorded, and how the monitor thread and process read it.

The record is the rank-monitor heartbeat slot (``nvrx.monitors.heartbeat``): a 0600 shared-memory file
in a 0700 directory, written with plain memory stores. The progress watchdog
(``nvrx.monitors.progress_watchdog``) stores the time the main thread last ran bytecode (automatic
heartbeat); ``CallWrapper.ping()`` is a manual heartbeat; section 0 is open while an iteration runs,
which is when the timeouts apply.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nvrx.monitors.heartbeat import Slot, SlotWriter
from nvrx.monitors.progress_watchdog import ProgressWatchdog

RUN_SECTION = 0
SLOT_DIR_PREFIX = "nvrx-inprocess-"


@dataclass(frozen=True)
class Progress:
    """What the monitors need: is an iteration running, and when did it last show progress."""

    running: bool
    since: float  # start of the running iteration
    auto: float  # last automatic heartbeat (main thread ran bytecode)
    manual: float  # last ping(), 0.0 if none in this iteration

    def stalled_for(self, now: float) -> float:
        """Seconds without progress: the older of the two heartbeats counts (a manual one once used)."""
        auto = max(self.auto, self.since)
        oldest = min(auto, max(self.manual, self.since)) if self.manual else auto
        return now - oldest


def read_progress(slot: Slot) -> Progress:
    snap = slot.snapshot()
    running = bool(snap.open_mask >> RUN_SECTION & 1)
    since = snap.section_start[RUN_SECTION]
    manual = snap.last_hb if snap.last_hb >= since else 0.0
    return Progress(running, since, snap.auto_hb, manual)


class ProgressRecorder:
    """The rank's side: creates the slot, runs the watchdog, records pings and iteration start/end."""

    def __init__(self, watchdog_interval: float) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix=SLOT_DIR_PREFIX, dir=_shm_dir()))
        self.path = self.directory / "progress.slot"
        self.slot = Slot.create(self.path)
        self.writer = SlotWriter(self.slot)
        self._lock = threading.Lock()  # ping() may come from any thread; the slot has one writer at a time
        self.writer.auto_beat()
        self.watchdog = ProgressWatchdog(self.writer.auto_beat, watchdog_interval)

    def start(self) -> "ProgressRecorder":
        self.watchdog.start()
        return self

    def ping(self) -> None:
        with self._lock:
            self.writer.beat()

    def start_iteration(self) -> None:
        with self._lock:
            self.writer.auto_beat()
            if not self.writer.is_open(RUN_SECTION):
                self.writer.open_section(RUN_SECTION)

    def end_iteration(self) -> None:
        with self._lock:
            if self.writer.is_open(RUN_SECTION):
                self.writer.close_section(RUN_SECTION)

    def progress(self) -> Progress:
        return read_progress(self.slot)

    def close(self) -> None:
        self.watchdog.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _shm_dir() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def now() -> float:
    return time.monotonic()
