"""The rank monitor: one process per rank, started by the agent, outliving rank restarts.

    python -m nvrx.monitors.rank_monitor --rank N --state-dir DIR --socket PATH --shm PATH \
        [--timeouts-dir DIR] [--term-grace SECONDS] \
        [--token-env NVRX_MONITOR_TOKEN] [--config-json '{...FaultToleranceConfig.to_dict()...}'] \
        [--events PATH] [--parent-pid PID] [--control-fd FD]

The secret token is read from the environment variable named by ``--token-env`` (never argv), which is
then removed from the environment. The monitor creates the heartbeat slot (``--shm``, 0600) and the
control socket (``--socket``, 0600; both parents 0700), serves ``nvrx.monitors.control`` requests, and sleeps
until the earliest deadline (at most ``workload_check_interval``). When a deadline passes it records the
reason (event ``hang_detected``, which the agent reads back to explain the rank's exit) and sends
``rank_termination_signal`` to the rank's pid; if that is not SIGKILL and the rank is still alive
``--term-grace`` seconds later, it sends SIGKILL (a hung rank may well ignore or block SIGTERM).

Straggler detection: at most every 0.5 s the monitor also samples the slot's section durations and
heartbeat intervals (``nvrx.monitors.straggler.TimingSampler``) and writes their medians every
``straggler_report_interval`` as a ``rank_timing`` event, which the agent reads and compares across ranks.
Workload control (spec 001): a rank's ``workload_control`` request is passed to the agent as one JSON line on
the pipe given as ``--control-fd``.

One session at a time: while the process of the current session is alive, an attach/init from another
pid is refused (a child process that inherited the rank's environment must not take the rank's place).

Learned timeouts are persisted at ``<timeouts-dir>/rank<G>.timeouts.json``, where G is the global rank
the attached rank reports (``RANK``; N when it reports none), and loaded when a rank with a new G
attaches, so the next job of an auto-resume chain finds them even on other nodes. The monitor exits
on SIGTERM/SIGINT/SIGHUP, on ``stop_monitor``, or when its parent (the agent) dies; in the last case
it also removes its private socket directory once empty, since no agent is left to do it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from nvrx.common.process import die_with_parent
from nvrx.monitors.control import LineBuffer, MonitorProtocolError, encode, ensure_private_dir, listen, peer_credentials
from nvrx.events import HeartbeatStats as HeartbeatStatsEvent
from nvrx.events import (EventLog, FirstHeartbeat, HangDetected, MonitorAttach, MonitorAuthFailed,
                             MonitorConnect, MonitorDisconnect, MonitorExit, MonitorStart, MonitorTakeoverRefused,
                             RankKilled, RankTerminated, SectionClose, SectionOpen, TimeoutsInfo, TimeoutsLoaded,
                             TimeoutsSet, TimeoutsStateIgnored)
from nvrx.events import CheckpointComplete, CheckpointInterval, RankTiming, TimingInfo, WorkloadControl
from nvrx.events import HeartbeatTimeoutAuto, HeartbeatTimeoutAutoDeferred
from nvrx.monitors.auto_timeout import AutoTimeout, AutoTimeoutChange
from nvrx.monitors.rank_activity import ActivityWatch, busy_peer, sample_main_thread, stopped_peer
from nvrx.monitors.straggler import TimingSampler
from nvrx.monitors.heartbeat import Slot, SlotSnapshot
from nvrx.monitors.jit_relay import PEER_FAILED, JitRelay
from nvrx.monitors.sections import SectionRegistry, SectionStats
from nvrx.monitors.ft_config import FaultToleranceConfig, inactive_settings_line
from nvrx.monitors.timeouts import HeartbeatStats, TimeoutTracker, Timeouts, state_file
from nvrx.common.files import load_json, save_json_atomic

log = logging.getLogger("nvrx.rank_monitor")

DEFAULT_TERM_GRACE = 5.0     # seconds between a non-SIGKILL termination signal and SIGKILL (--term-grace)
STATS_PERIOD = 30.0          # min seconds between heartbeat_stats events
SECTION_EVENT_PERIOD = 10.0  # min seconds between section_open/section_close events of one section
MAX_PENDING_CONNS = 16
WORKLOAD_ACTIONS = ("Continue", "ExcludeThisNode", "ShutdownWorkload")  # nvrx.monitors.data.WorkloadAction names


# ------------------------------------------------------------------ settings


def timeouts_from_config(cfg: FaultToleranceConfig) -> Timeouts:
    """The configured timeouts in the tracker's terms (None = learn at run time)."""
    return Timeouts.from_dict({"initial_heartbeat": cfg.initial_rank_heartbeat_timeout,
                               "heartbeat": cfg.rank_heartbeat_timeout,
                               "sections": dict(cfg.rank_section_timeouts),
                               "out_of_section": cfg.rank_out_of_section_timeout})


# ------------------------------------------------------------------ detection


@dataclass(frozen=True)
class Deadline:
    """The moment a check fails unless the rank makes progress first."""

    at: float
    reason: str
    timeout: float
    since: float
    section: str | None = None


AUTO_REASON = "auto_heartbeat_timeout"


def liveness_since(snap: SlotSnapshot) -> float:
    """The rank's last liveness mark: the latest of its beats (explicit, automatic) and its last section end."""
    return max(snap.last_hb, snap.auto_hb, snap.last_section_end)


def next_deadline(snap: SlotSnapshot, timeouts: Timeouts, name_of: Callable[[int], str],
                  auto: float | None = None) -> Deadline | None:
    """The earliest deadline implied by SNAP. Heartbeat checks pause while a timed section is open.

    AUTO, the automatic heartbeat timeout in force (``nvrx.monitors.auto_timeout``), replaces the heartbeat timeout
    when it is shorter (reason ``auto_heartbeat_timeout``).
    """
    found: list[Deadline] = []
    open_ids = snap.open_ids()
    timed_open = False
    for sid in open_ids:
        name = name_of(sid)
        limit = timeouts.section(name)
        if limit is not None:
            timed_open = True
            start = snap.section_start[sid]
            found.append(Deadline(start + limit, "section_timeout", limit, start, name))
    if not timed_open:
        end = snap.last_section_end
        beaten = snap.hb_count > 0 or snap.auto_hb > 0
        if not beaten and timeouts.initial_heartbeat is not None:
            since = max(snap.run_start, end)
            found.append(Deadline(since + timeouts.initial_heartbeat, "no_first_heartbeat",
                                  timeouts.initial_heartbeat, since))
        elif beaten and auto is not None and (timeouts.heartbeat is None or auto < timeouts.heartbeat):
            since = liveness_since(snap)
            found.append(Deadline(since + auto, AUTO_REASON, auto, since))
        elif beaten and timeouts.heartbeat is not None:
            since = liveness_since(snap)
            found.append(Deadline(since + timeouts.heartbeat, "heartbeat_timeout", timeouts.heartbeat, since))
    if not open_ids and timeouts.out_of_section is not None:
        since = snap.last_section_end
        found.append(Deadline(since + timeouts.out_of_section, "out_of_section_timeout",
                              timeouts.out_of_section, since))
    return min(found, key=lambda d: d.at) if found else None


def run_observations(snap: SlotSnapshot, registry: SectionRegistry) -> tuple[HeartbeatStats, SectionStats]:
    """The current run's maxima, as recorded by the rank in the slot."""
    hb = HeartbeatStats(snap.first_delay if snap.hb_count else None,
                        snap.max_interval if snap.hb_count > 1 and snap.max_interval > 0 else None)
    sections = SectionStats()
    for name, sid in registry.mapping().items():
        if snap.section_closes[sid]:
            sections.observe_section(name, snap.section_max[sid])
    sections.observe_out_of_section(snap.max_out_of_section)
    return hb, sections


def _alive(proc: psutil.Process) -> bool:
    """PROC is running (a zombie has exited, whatever psutil.is_running says)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ------------------------------------------------------------------ the process


@dataclass
class Conn:
    sock: socket.socket
    lines: LineBuffer = field(default_factory=LineBuffer)
    authed: bool = False


@dataclass
class AttachedRank:
    """The monitor's view of the rank process attached to it: one rank run, from attach or init to
    disconnect, shutdown or termination."""

    conn: Conn
    proc: psutil.Process
    generation: int
    armed: bool = True  # False: attached by the bootstrap, deadlines not checked until init
    global_rank: int | None = None  # the rank's RANK in this round (the monitor's own rank is the local one)
    first_hb_reported: bool = False
    terminated: bool = False
    kill_at: float | None = None  # when a rank that survived the termination signal gets SIGKILL
    next_stats: float = 0.0
    last_hb_count: int = 0
    last_auto_hb: float = 0.0  # the automatic beat time in the last heartbeat_stats
    section_closes: dict[int, int] = field(default_factory=dict)
    section_opened: dict[int, float] = field(default_factory=dict)
    section_next_event: dict[tuple[str, int], float] = field(default_factory=dict)
    next_sample: float = 0.0  # straggler detection: the next look at the slot's timings
    window_start: float = 0.0  # ... and the start of the current report window
    activity: ActivityWatch | None = None  # automatic timeout: the rank's main thread, sampled at wake-ups
    deferred_since: float | None = None  # the gap (by its start) that passed the automatic timeout busy
    recheck_at: float = 0.0  # ... when to look at it again
    judged_at: float = 0.0  # the last look
    peer_wait_since: tuple[float, float] | None = None  # (gap start, until when) left to a stopped peer's monitor


class RankMonitor:
    """Serves the control socket and watches one rank's heartbeat slot."""

    def __init__(self, rank: int, settings: FaultToleranceConfig, state_dir: Path, socket_path: Path,
                 shm_path: Path, token: str, events: EventLog, parent_pid: int,
                 timeouts_dir: Path | None = None, term_grace: float = DEFAULT_TERM_GRACE,
                 control_fd: int | None = None) -> None:
        self.rank = rank
        self.control_fd = control_fd  # the agent's pipe for workload control requests (None: not under an agent)
        self.timing = TimingSampler()  # straggler detection: this rank's section and heartbeat timings
        self.settings = settings
        self.state_dir = ensure_private_dir(Path(state_dir))
        self.timeouts_dir = ensure_private_dir(Path(timeouts_dir)) if timeouts_dir is not None else self.state_dir
        self.term_grace = max(0.0, float(term_grace))
        self._state_key: int | None = None  # the global rank whose learned timeouts the tracker holds
        self.socket_path = Path(socket_path)
        self.shm_path = Path(shm_path)
        self._token = token.encode()
        self.events = events
        self.parent_pid = parent_pid
        self.registry = SectionRegistry(settings.rank_section_timeouts)
        self.tracker = TimeoutTracker(timeouts_from_config(settings), settings.safety_factor)
        self.auto = AutoTimeout(settings.auto_timeout, self.tracker.in_force().heartbeat)
        self.session: AttachedRank | None = None
        self.generation = 0
        self.stopping: str | None = None
        self.conns: dict[socket.socket, Conn] = {}
        self.jit = JitRelay()  # just-in-time checkpoint requests, agent -> rank -> agent (nvrx.monitors.jit_relay)
        self.sel = selectors.DefaultSelector()
        ensure_private_dir(self.shm_path.parent)
        self.slot = Slot.create(self.shm_path)
        self.listener = listen(self.socket_path)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    # ---- lifecycle
    def _use_state_of(self, global_rank: int | None) -> None:
        """Make the tracker hold the learned timeouts of GLOBAL_RANK (loaded when it changes).

        Learned timeouts belong to a global rank (a job's rank keeps its role across nodes and jobs).
        """
        key = global_rank if global_rank is not None else self.rank
        if key == self._state_key:
            return
        if self._state_key is not None:  # another rank's learning must not carry over
            self.tracker = TimeoutTracker(timeouts_from_config(self.settings), self.settings.safety_factor)
            self.auto.reset()
        self._state_key = key
        path = state_file(self.timeouts_dir, key)
        try:
            state = load_json(path)
            if state is not None:
                self.tracker.load_state_dict(state)
                self.events.emit(TimeoutsLoaded(rank=self.rank, global_rank=key, path=str(path),
                                                timeouts=TimeoutsInfo.of(self.tracker.in_force().to_dict())))
                log.info("loaded learned timeouts from %s", path)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring unusable timeouts state %s: %s", path, exc)
            self.events.emit(TimeoutsStateIgnored(rank=self.rank, path=str(path), error=str(exc)))

    def install_signal_handlers(self) -> None:
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = self.stopping or f"signal {signal.Signals(signum).name}"

    def run(self) -> int:
        """Serve until told to stop or orphaned; returns the process exit code."""
        self.events.emit(MonitorStart(rank=self.rank, pid=os.getpid(), socket=str(self.socket_path),
                                      timeouts=TimeoutsInfo.of(self.tracker.in_force().to_dict()),
                                      check_interval=self.settings.workload_check_interval))
        try:
            while self.stopping is None:
                if os.getppid() != self.parent_pid:  # cheap; close() checks more thoroughly
                    self.stopping = "parent died"
                    break
                timeout = self._tick(time.monotonic())
                for key, _ in self.sel.select(timeout):
                    self._dispatch(key)
        finally:
            self.close()
        return 0

    def close(self) -> None:
        orphaned = self._parent_gone()
        if orphaned and self.stopping and self.stopping.startswith("signal"):
            self.stopping = f"parent died ({self.stopping})"  # PR_SET_PDEATHSIG delivers a signal
        log.debug("rank monitor stopping: %s", self.stopping)
        self.events.emit(MonitorExit(rank=self.rank, reason=self.stopping or "error"))
        for conn in list(self.conns.values()):
            self._drop(conn)
        self.listener.close()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        self.slot.close()
        try:
            self.shm_path.unlink()
        except FileNotFoundError:
            pass
        if orphaned:
            self._remove_private_dirs()
        self.events.close()

    def _parent_gone(self) -> bool:
        """Our agent died (or is dying).

        getppid() alone is not enough: PR_SET_PDEATHSIG fires when the agent *thread* that started us
        exits, and while the rest of a SIGKILLed agent is still being torn down we are re-parented to
        one of its other threads, so getppid() still names the agent; its leader is a zombie by then.
        """
        if os.getppid() != self.parent_pid:
            return True
        try:
            return psutil.Process(self.parent_pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except psutil.Error:
            return True

    def _remove_private_dirs(self) -> None:
        """The agent that made our socket dir is gone and cannot remove it: the last monitor out does.

        Only empty directories are removed (rmdir), so a sibling monitor still running keeps its files and
        the last one to exit removes the directory.
        """
        for d in {self.socket_path.parent, self.shm_path.parent}:
            try:
                d.rmdir()
            except OSError:
                pass

    # ---- periodic work
    def _tick(self, now: float) -> float:
        """Check the slot; returns seconds until the next wake-up."""
        interval = self.settings.workload_check_interval
        sess = self.session
        if sess is None:
            return interval
        if sess.terminated:
            return self._escalate(sess, now, interval)
        if not sess.proc.is_running():
            self._end_session("rank_exited")
            return interval
        if not sess.armed:
            return interval
        snap = self.slot.snapshot()
        self.tracker.set_run_observations(*run_observations(snap, self.registry))
        self._emit_progress(sess, snap, now)
        next_timing = self._sample_timing(sess, snap, now)
        timeouts = self.tracker.in_force()
        auto = self._auto_timeout(sess, snap, now, timeouts.heartbeat)
        deadline = next_deadline(snap, timeouts, self.registry.name_of, auto)
        if deadline is not None and deadline.reason == AUTO_REASON:
            deadline = self._judge_auto(sess, snap, deadline, now, timeouts)
        if deadline is not None and deadline.at <= now:
            if not self._waits_for_stopped_peer(sess, deadline, now):
                self._on_hang(sess, deadline, now, timeouts)
            return interval
        # The rank changes the slot without telling us (a beat, a section); any deadline such a change
        # creates lies >= (now + the shortest timeout), so waking by then keeps detection on time.
        wake = min(interval, min(x for x in (timeouts.smallest(), auto, interval) if x is not None), next_timing - now)
        if deadline is not None:
            wake = min(wake, deadline.at - now)
        return max(0.0005, wake)

    def _auto_timeout(self, sess: AttachedRank, snap: SlotSnapshot, now: float, configured: float | None) -> float | None:
        """Fold the slot's gaps into the automatic timeout (reporting a change); the one to enforce now, if any."""
        self.auto.configured = configured
        beaten = snap.hb_count > 0 or snap.auto_hb > 0
        change = self.auto.observe(snap.gap_hist, beaten, now)
        if change is not None:
            self._emit_auto(sess, change, configured)
        auto = self.auto.enforced(now)
        if auto is None:
            return None  # off, suggesting only, settling
        if sess.activity is None:
            sess.activity = ActivityWatch(sess.proc.pid)
        sess.activity.sample(now)
        return auto

    def _emit_auto(self, sess: AttachedRank, change: AutoTimeoutChange, configured: float | None) -> None:
        s = self.auto.settings
        self.events.emit(HeartbeatTimeoutAuto(
            rank=self.rank, global_rank=sess.global_rank, mode=s.mode, timeout=change.timeout,
            previous=change.previous, reason=change.reason, percentile=s.percentile, basis=change.basis,
            longest_gap=round(change.longest_gap, 6),
            p50=round(change.p50, 6), p99=round(change.p99, 6), gaps=change.gaps, observed_s=change.observed_s,
            multiple=s.multiple, floor=s.floor, configured=configured, capped=change.capped))
        log.info("rank %d: automatic heartbeat timeout %s %.3f s (%s: %g x p%g of %d gaps, %.4f s; longest %.4f s; "
                 "floor %g s)", self.rank, "set to" if s.mode == "set" else "suggested:", change.timeout,
                 change.reason, s.multiple, s.percentile, change.gaps, change.basis, change.longest_gap, s.floor)

    def _judge_auto(self, sess: AttachedRank, snap: SlotSnapshot, deadline: Deadline, now: float,
                    timeouts: Timeouts) -> Deadline | None:
        """The automatic deadline, judged before it is acted on (nvrx.monitors.rank_activity).

        A gap found busy is looked at again one automatic timeout later; the configured deadline (the
        absolute bound) takes over once it has passed, or when the rank turns out to be busy.
        """
        if sess.deferred_since == deadline.since:
            deadline = dataclasses.replace(deadline, at=sess.recheck_at)
        if deadline.at > now:
            return deadline
        configured = next_deadline(snap, timeouts, self.registry.name_of)
        if configured is not None and configured.at <= now:
            return configured
        if not self._busy(sess, deadline, now, timeouts.heartbeat):
            return deadline
        recheck = dataclasses.replace(deadline, at=sess.recheck_at)
        return recheck if configured is None or recheck.at < configured.at else configured

    def _busy(self, sess: AttachedRank, deadline: Deadline, now: float, configured: float | None) -> bool:
        """The rank passed its automatic timeout: busy (not hung) if it or a local peer works; see rank_activity."""
        watch = sess.activity or ActivityWatch(sess.proc.pid)
        verdict = watch.judge(max(deadline.since, sess.judged_at), now,
                              lambda: busy_peer(self.shm_path, now, deadline.timeout))
        sess.judged_at = now
        if not verdict.busy:
            return False
        sess.recheck_at = now + deadline.timeout
        if sess.deferred_since != deadline.since:  # one event per gap, not per look
            sess.deferred_since = deadline.since
            self.events.emit(HeartbeatTimeoutAutoDeferred(
                rank=self.rank, global_rank=sess.global_rank, pid=sess.proc.pid,
                elapsed=round(now - deadline.since, 6), timeout=deadline.timeout, state=verdict.state,
                cpu_fraction=verdict.cpu_fraction, why=verdict.why, fallback=configured))
            log.info("rank %d passed its automatic heartbeat timeout (%.3f s) busy (%s): not a hang; looking again "
                     "every %.3f s, the configured timeout bounds this gap", self.rank, deadline.timeout, verdict.why,
                     deadline.timeout)
        return True

    def _escalate(self, sess: AttachedRank, now: float, interval: float) -> float:
        """SIGKILL a hung rank that is still alive term_grace seconds after the termination signal.

        Returns seconds until the next wake-up (the kill time, if one is pending).
        """
        if sess.kill_at is None:
            return interval
        if not _alive(sess.proc):
            sess.kill_at = None
            return interval
        if now < sess.kill_at:
            return min(interval, max(0.0005, sess.kill_at - now))
        sess.kill_at = None
        sig = self.settings.rank_termination_signal
        log.error("rank %d (pid %d) is still alive %.1f s after %s; sending SIGKILL", self.rank, sess.proc.pid,
                  self.term_grace, sig.name)
        try:
            sess.proc.send_signal(signal.SIGKILL)
            self.events.emit(RankKilled(rank=self.rank, pid=sess.proc.pid, signal="SIGKILL", after=sig.name,
                                        grace=self.term_grace))
        except psutil.Error as exc:
            self.events.emit(RankKilled(rank=self.rank, pid=sess.proc.pid, signal="SIGKILL", after=sig.name,
                                        grace=self.term_grace, error=f"already gone: {exc}"))
        return interval

    def _emit_progress(self, sess: AttachedRank, snap: SlotSnapshot, now: float, final: bool = False) -> None:
        """first_heartbeat, heartbeat_stats and section events, rate-limited unless FINAL (run end)."""
        if snap.hb_count and not sess.first_hb_reported:
            sess.first_hb_reported = True
            self.events.emit(FirstHeartbeat(rank=self.rank, pid=sess.proc.pid, delay=round(snap.first_delay, 6)))
        beaten = snap.hb_count > sess.last_hb_count or snap.auto_hb > sess.last_auto_hb  # automatic beats count too
        if beaten and (final or now >= sess.next_stats):
            self.events.emit(HeartbeatStatsEvent(
                rank=self.rank, count=snap.hb_count, max_interval=round(snap.max_interval, 6),
                since_last=round(now - snap.last_hb, 6) if snap.hb_count else None,
                auto_since_last=round(now - snap.auto_hb, 6) if snap.auto_hb else None))
            sess.last_hb_count, sess.last_auto_hb = snap.hb_count, snap.auto_hb
            sess.next_stats = now + STATS_PERIOD
        for name, sid in self.registry.mapping().items():
            start = snap.section_start[sid]
            if snap.open_mask >> sid & 1 and sess.section_opened.get(sid) != start:
                if not final and self._section_event_due(sess, "open", sid, now):
                    sess.section_opened[sid] = start
                    self.events.emit(SectionOpen(rank=self.rank, section=name, open_for=round(now - start, 6)))
            closes = snap.section_closes[sid]
            if closes > sess.section_closes.get(sid, 0) and (final or self._section_event_due(sess, "close", sid, now)):
                self.events.emit(SectionClose(rank=self.rank, section=name,
                                              closes=closes - sess.section_closes.get(sid, 0),
                                              last_duration=round(snap.section_last[sid], 6),
                                              max_duration=round(snap.section_max[sid], 6)))
                sess.section_closes[sid] = closes

    def _sample_timing(self, sess: AttachedRank, snap: SlotSnapshot, now: float) -> float:
        """Straggler detection: look at the slot's timings when due, and report a window when it is over.

        Returns the time of the next look. Looking several times per report (at most every 0.5 s) samples the
        section durations of fast steps without any work on the rank's side (monitors.straggler).
        """
        report = self.settings.straggler_report_interval
        if sess.window_start == 0.0:
            sess.window_start, sess.next_sample = now, now
        if now >= sess.next_sample:
            self.timing.observe(snap.hb_count, snap.last_hb, snap.section_closes, snap.section_last,
                                {sid: name for name, sid in self.registry.mapping().items()})
            sess.next_sample = now + min(0.5, max(0.02, report / 20))
        if now - sess.window_start >= report:
            summary = self.timing.take()
            if summary:
                self.events.emit(RankTiming(rank=self.rank, global_rank=sess.global_rank, pid=sess.proc.pid,
                                            window=round(now - sess.window_start, 3), timings=[
                                                TimingInfo(metric=name, median=round(m.median, 9), samples=m.samples)
                                                for name, m in sorted(summary.items())]))
            sess.window_start = now
        return min(sess.next_sample, sess.window_start + report)

    @staticmethod
    def _section_event_due(sess: AttachedRank, kind: str, sid: int, now: float) -> bool:
        key = (kind, sid)
        if now < sess.section_next_event.get(key, 0.0):
            return False
        sess.section_next_event[key] = now + SECTION_EVENT_PERIOD
        return True

    def _waits_for_stopped_peer(self, sess: AttachedRank, deadline: Deadline, now: float) -> bool:
        """True while this silent rank only waits for a stopped local peer: that peer is the hang, its own monitor
        ends it, and this rank (still holding the state of the last step: a just-in-time checkpoint can save it)
        sees its collective fail and exits by itself. Bounded: after one more timeout this rank is judged as usual.
        """
        own = sample_main_thread(sess.proc.pid, now)
        if own is None or own.state in ("T", "t"):
            return False
        if sess.peer_wait_since is not None and sess.peer_wait_since[0] == deadline.since:
            return now < sess.peer_wait_since[1]
        peer = stopped_peer(self.shm_path)
        if peer is None:
            return False
        sess.peer_wait_since = (deadline.since, now + deadline.timeout)
        log.info("rank %d passed its %s (%.3f s) waiting for a stopped local peer (%s): leaving that hang to its "
                 "monitor, for at most %.3f s more", self.rank, deadline.reason, deadline.timeout, peer,
                 deadline.timeout)
        return True

    def _on_hang(self, sess: AttachedRank, deadline: Deadline, now: float, timeouts: Timeouts) -> None:
        sig = self.settings.rank_termination_signal
        hang = HangDetected(rank=self.rank, global_rank=sess.global_rank, pid=sess.proc.pid,
                            generation=sess.generation, reason=deadline.reason, section=deadline.section,
                            elapsed=round(now - deadline.since, 6), timeout=deadline.timeout,
                            timeouts=TimeoutsInfo.of(timeouts.to_dict()), signal=sig.name)
        log.error("rank %d hang detected: %s%s after %.3fs (timeout %.3fs); sending %s to pid %d", self.rank,
                  deadline.reason, f" [{deadline.section}]" if deadline.section else "", now - deadline.since,
                  deadline.timeout, sig.name, sess.proc.pid)
        self.events.emit(hang)  # before the signal: the agent reads it back when the rank's exit ends the round
        sess.terminated = True
        try:
            sess.proc.send_signal(sig)  # psutil refuses if the pid was reused (create time differs)
            if sig != signal.SIGKILL:
                sess.kill_at = now + self.term_grace
            self.events.emit(RankTerminated(rank=self.rank, pid=sess.proc.pid, signal=sig.name,
                                            reason=deadline.reason))
        except psutil.Error as exc:
            self.events.emit(RankTerminated(rank=self.rank, pid=sess.proc.pid, signal=sig.name,
                                            reason=deadline.reason, error=f"already gone: {exc}"))

    # ---- sockets
    def _dispatch(self, key: selectors.SelectorKey) -> None:
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        else:
            self._readable(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        if sum(not c.authed for c in self.conns.values()) >= MAX_PENDING_CONNS:
            sock.close()
            return
        sock.setblocking(False)
        conn = Conn(sock)
        self.conns[sock] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        try:
            msgs = conn.lines.feed(data)
        except MonitorProtocolError as exc:
            self._reply(conn, {"ok": False, "error": f"bad message: {exc}"})
            self._drop(conn)
            return
        for msg in msgs:
            if conn.sock not in self.conns:
                return
            if isinstance(msg, MonitorProtocolError):
                self._reply(conn, {"ok": False, "error": f"bad message: {msg}"})
                if not conn.authed:
                    self._drop(conn)
                continue
            self._handle(conn, msg)

    def _reply(self, conn: Conn, msg: dict[str, Any]) -> None:
        try:
            conn.sock.settimeout(2.0)
            conn.sock.sendall(encode(msg))
            conn.sock.setblocking(False)
        except OSError as exc:
            log.warning("dropping a control connection: %s", exc)
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        if self.conns.pop(conn.sock, None) is None:
            return
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self.jit.dropped(conn, self._reply)
        if self.session is not None and self.session.conn is conn:
            self._end_session("rank_disconnected")

    # ---- requests
    def _handle(self, conn: Conn, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if not conn.authed:
            handler = {"init": self._op_init, "attach": self._op_attach, "stop_monitor": self._op_stop_monitor,
                       "jit_wait": self._op_jit_wait, "jit_request": self._op_jit_request}.get(op)
        else:
            handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
        if handler is None:
            error = f"unknown op {op!r}" if conn.authed else "send init with the monitor token first"
            self._reply(conn, {"ok": False, "error": error})
            if not conn.authed:
                self._drop(conn)
            return
        try:
            reply = handler(conn, msg)
        except (ValueError, TypeError, KeyError) as exc:
            self._reply(conn, {"ok": False, "error": f"{op}: {exc}"})
            return
        if reply is not None:
            self._reply(conn, {"ok": True, **reply})

    def _check_token(self, conn: Conn, msg: dict[str, Any]) -> bool:
        token = msg.get("token")
        if isinstance(token, str) and hmac.compare_digest(token.encode(), self._token):
            return True
        self.events.emit(MonitorAuthFailed(rank=self.rank, op=msg.get("op")))
        log.warning("rejected a %s request with a wrong or stale token", msg.get("op"))
        self._reply(conn, {"ok": False, "error": f"invalid monitor token for rank {self.rank}: wrong or stale "
                                                 "NVRX_MONITOR_TOKEN (was this rank started by this nvrx launch?)"})
        self._drop(conn)
        return False

    def _verified_proc(self, conn: Conn, msg: dict[str, Any]) -> psutil.Process:
        """The process behind CONN, which must be the pid the message claims and our own user."""
        pid = msg.get("pid")
        peer_pid, peer_uid, _ = peer_credentials(conn.sock)
        if not isinstance(pid, int) or pid != peer_pid or peer_uid != os.getuid():
            raise ValueError(f"pid {pid!r} does not match the connecting process (pid {peer_pid}, uid {peer_uid})")
        return psutil.Process(pid)

    def _refuse_takeover(self, proc: psutil.Process) -> None:
        """ValueError if another live process holds the session: a rank's session belongs to its process.

        The token reaches every process that can read the rank's environment (a child it forks, a
        shell it runs); such a process must not silently replace the live rank, which would then run
        unwatched. A session whose process exited (a restarted rank's predecessor), or that this monitor
        is already terminating, may be replaced.
        """
        old = self.session
        if old is None or old.proc.pid == proc.pid or old.terminated or not _alive(old.proc):
            return
        self.events.emit(MonitorTakeoverRefused(rank=self.rank, pid=proc.pid, holder=old.proc.pid))
        log.warning("refused pid %d: rank %d is monitored for live pid %d", proc.pid, self.rank, old.proc.pid)
        raise ValueError(f"rank monitor {self.rank} is already watching pid {old.proc.pid}, which is still running; "
                         f"pid {proc.pid} cannot take over its session (only the rank process that nvrx launch "
                         "started may use RankMonitorClient; do not call it from child processes)")

    def _open_session(self, conn: Conn, proc: psutil.Process, armed: bool, started: float | None,
                      global_rank: int | None = None) -> AttachedRank:
        """A new rank run on CONN; the previous one (a restarted rank's predecessor) ends."""
        self._refuse_takeover(proc)
        if self.session is not None:
            old = self.session
            self._end_session("replaced")
            if old.conn is not conn:
                self._drop(old.conn)
        now = time.monotonic()
        self.generation += 1
        start = started if isinstance(started, (int, float)) and 0 < started <= now else now
        self.slot.reset(self.generation, start, proc.pid)
        self.timing.reset()
        self._use_state_of(global_rank)
        self.auto.start_run()
        self.tracker.reset_run()
        conn.authed = True
        self.session = AttachedRank(conn, proc, self.generation, armed=armed, global_rank=global_rank)
        return self.session

    def _session_reply(self) -> dict[str, Any]:
        return {"rank": self.rank, "generation": self.generation, "sections": self.registry.mapping(),
                "timeouts": self.tracker.in_force().to_dict(), "calculated": self.tracker.calculated(),
                "monitor_pid": os.getpid(), "config": self.settings.to_dict()}

    def _register_sections(self, msg: dict[str, Any]) -> None:
        for name in msg.get("sections") or []:
            self.registry.register(str(name))

    def _op_attach(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The bootstrap registers a rank at its start (or again after this monitor was restarted)."""
        if not self._check_token(conn, msg):
            return None
        proc = self._verified_proc(conn, msg)
        self._register_sections(msg)
        sess = self._open_session(conn, proc, bool(msg.get("armed")), msg.get("started"),
                                  _int_or_none(msg.get("global_rank")))
        self.events.emit(MonitorAttach(rank=self.rank, global_rank=sess.global_rank, pid=proc.pid,
                                       generation=sess.generation, armed=sess.armed,
                                       reattach=bool(msg.get("resume"))))
        if sess.armed:
            self._emit_connect(sess)
        return self._session_reply()

    def _op_init(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Start a monitored run: arm the attached session of this connection, or open a new one."""
        if not self._check_token(conn, msg):
            return None
        proc = self._verified_proc(conn, msg)
        self._register_sections(msg)
        sess = self.session
        if sess is not None and sess.conn is conn and sess.proc.pid == proc.pid and not sess.terminated:
            sess.armed = True
        else:
            sess = self._open_session(conn, proc, True, None, _int_or_none(msg.get("global_rank")))
        self._emit_connect(sess)
        return self._session_reply()

    def _emit_connect(self, sess: AttachedRank) -> None:
        self.events.emit(MonitorConnect(rank=self.rank, global_rank=sess.global_rank, pid=sess.proc.pid,
                                        generation=sess.generation,
                                        timeouts=TimeoutsInfo.of(self.tracker.in_force().to_dict())))
        log.info("rank %d monitored (pid %d, run %d)", self.rank, sess.proc.pid, sess.generation)

    def _op_stop_monitor(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        if not self._check_token(conn, msg):
            return None
        self.stopping = "stop requested"
        return {}

    def _op_sections(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        for name in msg.get("names") or []:
            self.registry.register(str(name))
        return {"sections": self.registry.mapping(), "timeouts": self.tracker.in_force().to_dict()}

    def _refresh_observations(self) -> None:
        if self.session is not None:
            self.tracker.set_run_observations(*run_observations(self.slot.snapshot(), self.registry))

    def _op_calculate_and_set_timeouts(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        self._refresh_observations()
        updated = self.tracker.calculate_and_set()
        timeouts = self.tracker.in_force().to_dict()
        path = state_file(self.timeouts_dir, self._state_key)  # set: only a session's connection gets here
        save_json_atomic(path, self.tracker.state_dict())
        self.events.emit(TimeoutsSet(rank=self.rank, updated=updated, timeouts=TimeoutsInfo.of(timeouts), path=str(path)))
        return {"updated": updated, "timeouts": timeouts, "calculated": self.tracker.calculated()}

    def _op_observed(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """The observed maxima, for the ranks to agree on before ``set_calculated`` (NVRx's calculate_and_set_*)."""
        self._refresh_observations()
        return {"observed": self.tracker.observed_values(), "sections": self.registry.mapping()}

    def _op_set_calculated(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Learn the timeouts of the given (agreed) observed maxima, persist, and enforce them at once."""
        values = msg.get("values")
        if not isinstance(values, dict):
            raise ValueError("values must be a mapping of observed maxima")
        for name in dict(values.get("sections") or {}):
            self.registry.register(str(name))
        self.tracker.set_calculated(values)
        timeouts = self.tracker.in_force().to_dict()
        path = state_file(self.timeouts_dir, self._state_key)
        save_json_atomic(path, self.tracker.state_dict())
        self.events.emit(TimeoutsSet(rank=self.rank, updated=True, timeouts=TimeoutsInfo.of(timeouts), path=str(path)))
        return {"timeouts": timeouts, "calculated": self.tracker.calculated(), "sections": self.registry.mapping()}

    def _op_state_dict(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        self._refresh_observations()
        return {"state": self.tracker.state_dict(), "timeouts": self.tracker.in_force().to_dict(),
                "calculated": self.tracker.calculated()}

    def _op_load_state_dict(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        self.tracker.load_state_dict(msg.get("state"))
        timeouts = self.tracker.in_force().to_dict()
        self.events.emit(TimeoutsLoaded(rank=self.rank, source="rank", timeouts=TimeoutsInfo.of(timeouts)))
        return {"timeouts": timeouts, "calculated": self.tracker.calculated()}

    def _op_workload_control(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Spec 001's workload control: pass the rank's request (exclude its node, shut down) to the agent.

        The agent reads the line from the pipe it gave us and acts at once (launcher.agent.rank_monitors).
        The request travels one way, rank -> monitor -> agent; the reply only says whether it was handed over.
        """
        action, description = msg.get("action"), msg.get("description")
        if action not in WORKLOAD_ACTIONS:
            raise ValueError(f"action must be one of {', '.join(WORKLOAD_ACTIONS)}, not {action!r}")
        description = str(description if description is not None else "<not set>")[:500]
        sess = self.session
        pid = sess.proc.pid if sess is not None else int(msg.get("pid") or 0)
        global_rank = sess.global_rank if sess is not None else None
        forwarded = self._forward_to_agent(action, description, pid)
        self.events.emit(WorkloadControl(rank=self.rank, global_rank=global_rank, pid=pid, action=action,
                                         description=description, forwarded=forwarded))
        log.warning("rank %s asks the agent to %s: %s%s", global_rank if global_rank is not None else self.rank,
                    action, description, "" if forwarded else " (no agent channel: not forwarded)")
        return {"forwarded": forwarded}

    def _op_checkpoint(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of the rank is complete (``nvrx.common.checkpoint_report``): one ``checkpoint_complete`` event.

        `nvrx inspect` counts the progress after the last complete checkpoint of a failed round as redone.
        """
        step, tier, taken, path = msg.get("step"), msg.get("tier"), msg.get("taken"), msg.get("path")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be a non-negative integer or null, not {step!r}")
        if not isinstance(tier, str) or not tier or len(tier) > 40:
            raise ValueError(f"tier must be a short name (global, local, jit), not {tier!r}")
        if taken is not None and (isinstance(taken, bool) or not isinstance(taken, (int, float))
                                  or not 0 < taken < 253402300800.0):
            raise ValueError(f"taken must be a unix time or null, not {taken!r}")
        sess = self.session
        pid = sess.proc.pid if sess is not None else int(msg.get("pid") or 0)
        self.events.emit(CheckpointComplete(rank=self.rank, global_rank=sess.global_rank if sess is not None else None,
                                            pid=pid, step=step, tier=tier, taken=taken,
                                            path=str(path)[:500] if path is not None else None))
        return {}

    def _op_checkpoint_interval(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """``every_steps="auto"`` chose a checkpoint interval (``report_interval``): one ``checkpoint_interval`` event."""
        every, why = msg.get("every_steps"), msg.get("why")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every_steps must be a positive integer, not {every!r}")
        if not isinstance(why, str):
            raise ValueError(f"why must be a string, not {why!r}")
        numbers = {}
        for key in ("seconds", "save_cost_s", "step_s", "drain_s", "mtbf_s", "restart_s", "expected_goodput"):
            value = msg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < 1e12):
                raise ValueError(f"{key} must be a non-negative number or null, not {value!r}")
            numbers[key] = float(value) if value is not None else None
        sess = self.session
        pid = sess.proc.pid if sess is not None else int(msg.get("pid") or 0)
        self.events.emit(CheckpointInterval(rank=self.rank, global_rank=sess.global_rank if sess is not None else None,
                                            pid=pid, every_steps=every, why=why[:500], **numbers))
        return {}

    def _forward_to_agent(self, action: str, description: str, pid: int | None) -> bool:
        """The rank's request ACTION as one JSON line into the agent's pipe (atomic: far below PIPE_BUF); False if
        there is none or it is full."""
        if self.control_fd is None:
            return False
        global_rank = self.session.global_rank if self.session is not None else None
        request = {"local_rank": self.rank, "global_rank": global_rank, "pid": pid, "action": action,
                   "description": description}
        try:
            os.write(self.control_fd, encode(request))
            return True
        except OSError as exc:  # BlockingIOError (an agent that does not read), EPIPE (no agent)
            log.warning("cannot pass the workload control request to the agent: %s", exc)
            return False

    def _op_jit_wait(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The rank's JIT thread parks this connection until the agent asks for a save (no reply until then)."""
        if not self._check_token(conn, msg):
            return None
        proc = self._verified_proc(conn, msg)
        conn.authed = True  # (its process holds the token: it may answer with jit_result)
        self.jit.park(conn, proc.pid)
        log.debug("rank %d: JIT saver of pid %d waiting", self.rank, proc.pid)
        return None

    def _op_jit_request(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The agent asks the rank for a just-in-time checkpoint; answered when the rank answers (or now)."""
        if not self._check_token(conn, msg):
            return None
        request = {k: msg.get(k) for k in ("round", "lost", "deadline", "world_size", "saver")}
        log.info("rank %d: the agent asks for a just-in-time checkpoint (lost ranks %s)", self.rank, request["lost"])
        return self.jit.ask(conn, request, self._reply)

    def _op_jit_peer_failed(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The rank's collective failed because a peer is gone, and the rank waits for a JIT request: tell the agent
        now (the peer's node may be gone with its agent: nobody else would for seconds). No reply."""
        if conn is not self.jit.waiter:
            raise ValueError("only the rank's parked JIT connection may say a peer failed")
        error = str(msg.get("error") or "a collective failed")[:500]
        log.warning("rank %d: a collective failed because a peer is gone (%s): telling the agent", self.rank, error)
        self._forward_to_agent(PEER_FAILED, error, self.jit.waiter_pid)
        return None

    def _op_jit_result(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The rank's JIT thread reports its save; passed on to the agent."""
        result = {k: msg.get(k) for k in ("saved", "path", "step", "error", "seconds", "skipped")}
        if not self.jit.answer(conn, result, self._reply):
            raise ValueError("no JIT request is waiting for this answer")
        log.info("rank %d: just-in-time checkpoint %s", self.rank,
                 f"saved: {result['path']}" if result["saved"] else f"not saved: {result['error']}")
        return {}

    def _op_shutdown(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        self._refresh_observations()
        self._end_session("shutdown")
        return {}

    def _end_session(self, reason: str) -> None:
        sess, self.session = self.session, None
        if sess is None:
            return
        self.auto.end_run()
        try:
            snap = self.slot.snapshot()
            self.tracker.set_run_observations(*run_observations(snap, self.registry))
            self._emit_progress(sess, snap, time.monotonic(), final=True)
        except Exception as exc:  # the slot is advisory here; never fail a session end
            log.warning("cannot read the final slot state: %s", exc)
        self.events.emit(MonitorDisconnect(rank=self.rank, pid=sess.proc.pid, generation=sess.generation,
                                           reason=reason))
        log.info("rank %d run %d ended: %s", self.rank, sess.generation, reason)


# ------------------------------------------------------------------ entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m monitors.rank_monitor", description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True, help="global rank watched by this monitor")
    p.add_argument("--state-dir", type=Path, required=True, help="learned timeouts, unless --timeouts-dir is given")
    p.add_argument("--timeouts-dir", type=Path, default=None,
                   help="learned timeouts, rank<GLOBAL_RANK>.timeouts.json (default: --state-dir)")
    p.add_argument("--term-grace", type=float, default=DEFAULT_TERM_GRACE,
                   help="seconds before a hung rank that survived a non-SIGKILL termination signal gets SIGKILL")
    p.add_argument("--socket", type=Path, required=True, help="control socket path (parent dir becomes 0700)")
    p.add_argument("--shm", type=Path, required=True, help="heartbeat slot file (parent dir becomes 0700)")
    p.add_argument("--token-env", default="NVRX_MONITOR_TOKEN", help="env var holding the secret token")
    p.add_argument("--config-json", default="{}", help="FaultToleranceConfig.to_dict() as JSON")
    p.add_argument("--events", type=Path, default=None, help="JSON-lines event file")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    p.add_argument("--control-fd", type=int, default=None,
                   help="inherited pipe to the agent: workload control requests of the rank, one JSON line each")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent_pid = args.parent_pid if args.parent_pid is not None else os.getppid()
    die_with_parent(parent_pid, signal.SIGTERM)
    try:
        config = json.loads(args.config_json)
        if not isinstance(config, dict):
            raise ValueError("--config-json must be a JSON object")
        settings = FaultToleranceConfig.from_dict(config, source="--config-json")
    except Exception as exc:  # ConfigError, ValueError...: one line, exit 2
        print(f"rank_monitor: bad --config-json: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=f"[rank-monitor {args.rank}] %(asctime)s %(levelname)s %(message)s")
    token = os.environ.pop(args.token_env, "")  # not inherited by anything this process might start
    if len(token) < 16:
        print(f"rank_monitor: ${args.token_env} must hold the secret token (>= 16 characters)", file=sys.stderr)
        return 2
    log.info("%s", inactive_settings_line(settings))  # NVRx settings (GPU, NIC, progress) nvrx does not act on
    events = EventLog(args.events, f"monitor-{args.rank}")
    if args.control_fd is not None:
        os.set_blocking(args.control_fd, False)  # never block the monitor on an agent that does not read
    monitor = RankMonitor(args.rank, settings, args.state_dir, args.socket, args.shm, token, events, parent_pid,
                          timeouts_dir=args.timeouts_dir, term_grace=args.term_grace, control_fd=args.control_fd)
    monitor.install_signal_handlers()
    return monitor.run()


def _exit_now(code: int) -> None:
    """Everything is closed and flushed by now; skipping interpreter teardown shortens the agent's shutdown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
