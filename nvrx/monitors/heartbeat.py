"""The per-rank shared-memory slot: heartbeats and section state, written by the rank, read by its monitor.

The monitor creates the slot (a 4 KiB file, mode 0600, inside a 0700 directory) and mmaps it; the rank
mmaps the same file. All fields are 8-byte words (int64 or float64), addressed through two memoryview
casts of the one mapping, so a write on the rank's hot path is a plain memory store: no syscall, no lock.
Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC via the vDSO), which all processes on a host share.

Consistency: a seqlock. The rank (the only writer while a run is active) makes the sequence word odd,
writes the fields, then makes it even again; the monitor copies the slot and accepts the copy only if
the sequence word was even and unchanged around the copy. CPython performs each store as a whole 8-byte
memcpy, and x86-64 keeps stores in program order, so the reader never accepts a torn record.

Layout (word index -> meaning)::

    0 magic             1 seq               2 heartbeat count     3 last heartbeat time
    4 first hb time     5 first hb delay    6 max hb interval     7 open-section bitmask
    8 sections opened   9 sections closed  10 last section end   11 max out-of-section time
   12 run start        13 generation       14 auto heartbeat time   15 rank pid (written by the monitor)
   16 + i: start time of section i          48 + i: max duration of section i
   80 + i: last duration of section i      112 + i: close count of section i   (i < MAX_SECTIONS)
  144 + b: liveness gaps in bucket b (b < GAP_BUCKETS; see gap_bucket)

Word 14 is written outside the seqlock, by the progress watchdog (one 8-byte store of the time the
main thread last ran Python bytecode); a single aligned store cannot tear.

Heartbeat intervals are measured from the later of the last heartbeat and the last moment all sections
were closed, the same reference the monitor uses for the heartbeat deadline.

Liveness gaps (the histogram at 144): every beat, explicit or automatic, counts the time since the previous
liveness mark (explicit beat, automatic beat or the end of the last section, whichever is latest) in a
log-spaced bucket, 8 per octave. The monitor derives its automatic heartbeat timeout from them
(``nvrx.monitors.auto_timeout``). The automatic beat's increments are plain stores from the watchdog thread; a
rare increment lost to a race with an explicit beat only drops one sample.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from nvrx.common.errors import NvrxError
MAGIC = 0x4E56_5258_4842_0001  # "NVRXHB" + layout version 1
SLOT_SIZE = 4096
MAX_SECTIONS = 32

W_MAGIC, W_SEQ, W_HB_COUNT, W_LAST_HB = 0, 1, 2, 3
W_FIRST_HB, W_FIRST_DELAY, W_MAX_INTERVAL, W_OPEN_MASK = 4, 5, 6, 7
W_OPEN_COUNT, W_CLOSE_COUNT, W_LAST_SEC_END, W_MAX_OOS = 8, 9, 10, 11
W_RUN_START, W_GENERATION, W_AUTO_HB, W_PID = 12, 13, 14, 15
W_SEC_START = 16
W_SEC_MAX = W_SEC_START + MAX_SECTIONS
W_SEC_LAST = W_SEC_MAX + MAX_SECTIONS
W_SEC_CLOSES = W_SEC_LAST + MAX_SECTIONS
W_GAP_HIST = W_SEC_CLOSES + MAX_SECTIONS
GAP_BUCKETS = 160            # 8 per octave from GAP_BASE: 0.1 ms .. ~105 s (the last bucket holds the rest)
GAP_BASE = 1e-4
GAP_PER_OCTAVE = 8
USED_WORDS = W_GAP_HIST + GAP_BUCKETS
USED_BYTES = USED_WORDS * 8

_monotonic = time.monotonic
_log2 = math.log2


def gap_bucket(gap: float) -> int:
    """The histogram bucket of a liveness gap of GAP seconds."""
    if gap <= GAP_BASE:
        return 0
    return min(GAP_BUCKETS - 1, int(_log2(gap / GAP_BASE) * GAP_PER_OCTAVE))


def gap_bucket_upper(bucket: int) -> float:
    """The upper edge (seconds) of BUCKET: no gap counted in it was longer (except in the last bucket)."""
    return GAP_BASE * 2.0 ** ((bucket + 1) / GAP_PER_OCTAVE)


class SlotError(NvrxError, RuntimeError):
    """The slot file is missing, foreign, or not a heartbeat slot."""


@dataclass(frozen=True)
class SlotSnapshot:
    """A consistent copy of the slot, as the monitor sees it."""

    hb_count: int
    last_hb: float
    first_hb: float
    first_delay: float
    max_interval: float
    open_mask: int
    open_count: int
    close_count: int
    last_section_end: float
    max_out_of_section: float
    run_start: float
    generation: int
    auto_hb: float
    section_start: tuple[float, ...]
    section_max: tuple[float, ...]
    section_last: tuple[float, ...]
    section_closes: tuple[int, ...]
    gap_hist: tuple[int, ...] = ()  # liveness gaps per bucket (gap_bucket)
    pid: int = 0                    # the rank process (0: not known)

    def open_ids(self) -> list[int]:
        return [i for i in range(MAX_SECTIONS) if self.open_mask >> i & 1]


class Slot:
    """One mapped slot file; ``q`` and ``d`` are int64 / float64 views of the same words."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        try:
            self._mm = mmap.mmap(fd, SLOT_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self.q = self._view.cast("q")
        self.d = self._view.cast("d")

    @classmethod
    def create(cls, path: Path) -> "Slot":
        """Create (replacing a stale one) and zero the slot file, mode 0600. Monitor side."""
        path = Path(path)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, SLOT_SIZE)
        slot = cls(path, fd)
        slot.reset(generation=0, now=_monotonic())
        slot.q[W_MAGIC] = MAGIC
        return slot

    @classmethod
    def attach(cls, path: Path) -> "Slot":
        """Map an existing slot created by our monitor. Rank side."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SlotError(f"cannot open the heartbeat slot {path}: {exc}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < SLOT_SIZE:
            os.close(fd)
            raise SlotError(f"{path} is not a heartbeat slot owned by this user")
        slot = cls(path, fd)
        if slot.q[W_MAGIC] != MAGIC:
            slot.close()
            raise SlotError(f"{path} is not a heartbeat slot (bad magic)")
        return slot

    def reset(self, generation: int, now: float, pid: int = 0) -> None:
        """Zero the per-run fields for a new rank run. Monitor side, while no rank is writing.

        PID (the rank's) lets the monitors of the node's other ranks look at this rank (monitors.rank_activity).
        """
        q, d = self.q, self.d
        seq = q[W_SEQ]
        q[W_SEQ] = seq + 1 if seq % 2 == 0 else seq
        for i in range(W_HB_COUNT, USED_WORDS):
            q[i] = 0
        d[W_RUN_START] = now
        d[W_LAST_SEC_END] = now
        q[W_GENERATION] = generation
        q[W_PID] = pid
        q[W_SEQ] = q[W_SEQ] + 1

    def snapshot(self, retries: int = 1000) -> SlotSnapshot:
        """Copy the slot under the seqlock; retries while the rank is mid-write."""
        q = self.q
        for attempt in range(retries):
            s1 = q[W_SEQ]
            if s1 % 2 == 0:
                raw = self._mm[:USED_BYTES]
                if q[W_SEQ] == s1:
                    return _decode(raw)
            if attempt > 10:
                time.sleep(0)
        raise SlotError("heartbeat slot stayed locked (writer died mid-update?)")

    def close(self) -> None:
        for view in (self.q, self.d, self._view):
            view.release()
        self._mm.close()


def read_slot(path: Path) -> SlotSnapshot | None:
    """One look at the slot file at PATH; None when it is gone or unreadable (its rank just ended or restarts)."""
    try:
        slot = Slot.attach(path)
    except (SlotError, OSError):
        return None
    try:
        return slot.snapshot()
    except SlotError:
        return None
    finally:
        slot.close()


def _decode(raw: bytes) -> SlotSnapshot:
    qv = memoryview(raw).cast("q")
    dv = memoryview(raw).cast("d")
    n = MAX_SECTIONS
    return SlotSnapshot(
        hb_count=qv[W_HB_COUNT], last_hb=dv[W_LAST_HB], first_hb=dv[W_FIRST_HB],
        first_delay=dv[W_FIRST_DELAY], max_interval=dv[W_MAX_INTERVAL], open_mask=qv[W_OPEN_MASK],
        open_count=qv[W_OPEN_COUNT], close_count=qv[W_CLOSE_COUNT], last_section_end=dv[W_LAST_SEC_END],
        max_out_of_section=dv[W_MAX_OOS], run_start=dv[W_RUN_START], generation=qv[W_GENERATION], auto_hb=dv[W_AUTO_HB],
        section_start=tuple(dv[W_SEC_START:W_SEC_START + n]), section_max=tuple(dv[W_SEC_MAX:W_SEC_MAX + n]),
        section_last=tuple(dv[W_SEC_LAST:W_SEC_LAST + n]), section_closes=tuple(qv[W_SEC_CLOSES:W_SEC_CLOSES + n]),
        gap_hist=tuple(qv[W_GAP_HIST:W_GAP_HIST + GAP_BUCKETS]), pid=qv[W_PID],
    )


class SlotWriter:
    """The rank's side: every method is a handful of stores into the mapping (no syscall)."""

    __slots__ = ("_slot", "_q", "_d", "_seq")

    def __init__(self, slot: Slot) -> None:
        self._slot = slot
        self._q = slot.q
        self._d = slot.d
        self._seq = slot.q[W_SEQ]
        if self._seq % 2:
            raise SlotError("heartbeat slot is mid-update; the monitor has not finished resetting it")

    def beat(self) -> None:
        now = _monotonic()
        q, d = self._q, self._d
        seq = self._seq + 1
        q[W_SEQ] = seq
        n = q[W_HB_COUNT]
        end = d[W_LAST_SEC_END]
        last = d[W_LAST_HB]
        auto = d[W_AUTO_HB]
        if n or auto:
            mark = max(last, auto, end)
            q[W_GAP_HIST + gap_bucket(now - mark)] += 1
        if n:
            interval = now - (last if last > end else end)
            if interval > d[W_MAX_INTERVAL]:
                d[W_MAX_INTERVAL] = interval
        else:
            start = d[W_RUN_START]
            d[W_FIRST_HB] = now
            d[W_FIRST_DELAY] = now - (start if start > end else end)
        d[W_LAST_HB] = now
        q[W_HB_COUNT] = n + 1
        seq += 1
        q[W_SEQ] = seq
        self._seq = seq

    def open_section(self, sid: int) -> None:
        now = _monotonic()
        q, d = self._q, self._d
        mask = q[W_OPEN_MASK]
        bit = 1 << sid
        if mask & bit:
            raise ValueError("section is already open")
        seq = self._seq + 1
        q[W_SEQ] = seq
        if not mask:
            outside = now - d[W_LAST_SEC_END]
            if outside > d[W_MAX_OOS]:
                d[W_MAX_OOS] = outside
        d[W_SEC_START + sid] = now
        q[W_OPEN_MASK] = mask | bit
        q[W_OPEN_COUNT] += 1
        seq += 1
        q[W_SEQ] = seq
        self._seq = seq

    def close_section(self, sid: int) -> float:
        """Close section SID; returns its duration. ValueError if it is not open."""
        now = _monotonic()
        q, d = self._q, self._d
        mask = q[W_OPEN_MASK]
        bit = 1 << sid
        if not mask & bit:
            raise ValueError("section is not open")
        seq = self._seq + 1
        q[W_SEQ] = seq
        duration = now - d[W_SEC_START + sid]
        if duration > d[W_SEC_MAX + sid]:
            d[W_SEC_MAX + sid] = duration
        d[W_SEC_LAST + sid] = duration
        q[W_SEC_CLOSES + sid] += 1
        mask &= ~bit
        q[W_OPEN_MASK] = mask
        if not mask:
            d[W_LAST_SEC_END] = now
        q[W_CLOSE_COUNT] += 1
        seq += 1
        q[W_SEQ] = seq
        self._seq = seq
        return duration

    def is_open(self, sid: int) -> bool:
        return bool(self._q[W_OPEN_MASK] >> sid & 1)

    def auto_beat(self) -> None:
        """Record that the main thread ran Python bytecode just now (the progress watchdog's beat)."""
        now = _monotonic()
        d = self._d
        auto = d[W_AUTO_HB]
        if auto or self._q[W_HB_COUNT]:
            last, end = d[W_LAST_HB], d[W_LAST_SEC_END]
            self._q[W_GAP_HIST + gap_bucket(now - max(auto, last, end))] += 1
        d[W_AUTO_HB] = now

    def rebind(self, slot: Slot) -> None:
        """Continue in the slot of a restarted monitor, carrying this run's record over.

        The old mapping stays alive (a beat in flight on another thread may still store into it).
        """
        old, new = self._q, slot.q
        generation = new[W_GENERATION]
        new[W_SEQ] = self._seq + 1  # odd while copying
        for i in range(W_HB_COUNT, USED_WORDS):
            new[i] = old[i]
        new[W_GENERATION] = generation
        new[W_SEQ] = self._seq + 2
        self._seq += 2
        self._slot, self._q, self._d = slot, new, slot.d

    def close(self) -> None:
        self._slot.close()
