"""RankMonitorClient: the rank's side of fault-tolerance monitoring.

Under ``nvrx launch`` the bootstrap attaches each rank to its monitor before user code runs (in a
background thread, so the rank's start is not delayed): the monitor then knows the rank's pid and start
time, and ``RankMonitorClient()`` reuses that connection. A client created outside the bootstrap connects
itself, from the environment the agent sets:

  ``NVRX_MONITOR_SOCKET``           path of this rank's monitor control socket (Unix, JSON lines)
  ``NVRX_MONITOR_TOKEN``            secret token proving the rank belongs to this launch
  ``NVRX_MONITOR_SHM``              path of this rank's heartbeat slot (mmap'd, see nvrx.monitors.heartbeat)
  ``NVRX_MONITOR_CONNECT_TIMEOUT``  optional; seconds to wait for the monitor to listen (default 30)
  ``NVRX_AUTO_HEARTBEAT``           optional; the bootstrap heartbeats automatically at this interval

Usage::

    client = RankMonitorClient()
    client.load_state_dict(saved)             # optional: timeouts learned by an earlier job
    client.init_workload_monitoring()
    for step in ...:
        client.start_section("step"); train_step(); client.end_section("step")
        client.send_heartbeat()
    client.calculate_and_set_hb_timeouts()      # collective, as in NVRx
    client.calculate_and_set_section_timeouts()
    saved = client.state_dict()
    client.shutdown_workload_monitoring()

A monitor started by ``RankMonitorServer`` (nvrx.monitors.server) is found through NVRx's
``FT_RANK_MONITOR_IPC_SOCKET`` instead.

``send_heartbeat``/``start_section``/``end_section`` only store into shared memory (no syscall); the
first use of a section name unknown to the monitor costs one request to register it. If the monitor
dies and the agent restarts it, the link re-attaches and carries the run's record into the new slot;
a control request that fails because the monitor died re-attaches and is retried once.

The token is removed from ``os.environ`` when it is first read (and kept in this module), so processes
the rank starts do not inherit it; the monitor also refuses a second live process for the same rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping

from nvrx.common import checkpoint_report
from nvrx.monitors.control import Channel, MonitorError
from nvrx.monitors.data import (FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR, HeartbeatTimeouts, RankMonitorClientError, SectionTimeouts, SectionUsageError,
                           WorkloadControlRequest, hb_timeouts_of, section_timeouts_of)
from nvrx.monitors.heartbeat import Slot, SlotWriter
from nvrx.monitors.sections import validate_section_name
from nvrx.monitors.timeouts import Timeouts, TimeoutTracker, tracker_state_from_nvrx

log = logging.getLogger("nvrx.client")

ENV_SOCKET = "NVRX_MONITOR_SOCKET"
ENV_TOKEN = "NVRX_MONITOR_TOKEN"
ENV_SHM = "NVRX_MONITOR_SHM"
ENV_CONNECT_TIMEOUT = "NVRX_MONITOR_CONNECT_TIMEOUT"
ENV_AUTO_HEARTBEAT = "NVRX_AUTO_HEARTBEAT"  # seconds between automatic heartbeats (bootstrap); unset = off
REATTACH_TIMEOUT = 60.0  # how long a rank waits for the agent to restart a dead monitor

_token: str | None = None  # this process's monitor token, once taken out of os.environ


def take_monitor_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The monitor variables of ENV (default os.environ), with the token removed from os.environ.

    The token proves a process is the rank nvrx launch started; left in the environment, every
    subprocess the training script starts (data loaders, shells, tools) would inherit it. It is kept
    here instead, so later clients in this process still find it.
    """
    global _token
    env = os.environ if env is None else env
    out = {k: v for k, v in env.items()
           if k.startswith("NVRX_MONITOR_") or k in ("RANK", FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR)}
    popped = os.environ.pop(ENV_TOKEN, None)  # always: ENV may be a copy
    _token = out.get(ENV_TOKEN) or popped or _token
    if _token:
        out[ENV_TOKEN] = _token
    return out


class MonitorLink:
    """This process's connection to its rank monitor: the control channel plus the heartbeat slot."""

    def __init__(self, socket_path: Path, shm_path: Path, token: str, connect_timeout: float = 30.0,
                 global_rank: int | None = None) -> None:
        self.socket_path, self.shm_path = Path(socket_path), Path(shm_path)
        self.global_rank = global_rank  # RANK, so the monitor's events name the rank users know
        self._token = token
        self.connect_timeout = connect_timeout
        self._lock = threading.RLock()
        self._reattach_lock = threading.Lock()  # one re-attach at a time (watch thread or a failed request)
        self._channel: Channel | None = None
        self.writer: SlotWriter | None = None
        self.ids: dict[str, int] = {}
        self.rank: int | None = None
        self.timeouts: dict[str, Any] = {}
        self.monitor_pid: int | None = None
        self.started: float | None = None
        self.armed = False
        self.owner: object | None = None  # the RankMonitorClient that initialized monitoring

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "MonitorLink":
        if not env.get(ENV_SOCKET) and env.get(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR):
            env = _env_of_server(env)
        values = {name: env.get(name) for name in (ENV_SOCKET, ENV_TOKEN, ENV_SHM)}
        missing = sorted(name for name, value in values.items() if not value)
        if missing == [ENV_TOKEN]:
            raise RuntimeError(f"{ENV_TOKEN} is not set: nvrx launch gives the monitor token only to the rank process "
                               "it started (processes the rank starts do not inherit it); use RankMonitorClient in "
                               "the rank process itself")
        if missing:
            raise RuntimeError(f"no rank monitor for this process ({', '.join(missing)} not set): "
                               "start the script with `nvrx launch`")
        timeout = float(env.get(ENV_CONNECT_TIMEOUT) or 30.0)
        rank = env.get("RANK", "")
        return cls(Path(values[ENV_SOCKET]), Path(values[ENV_SHM]), values[ENV_TOKEN], timeout,
                   int(rank) if rank.isdigit() else None)

    # ---- connecting
    def attach(self, started: float | None, armed: bool, timeout: float | None = None) -> None:
        """Register this process with the monitor (``armed``: start checking deadlines now)."""
        self._connect("attach", timeout, started=started, armed=armed, resume=False)
        self.started = started
        self.armed = armed
        log.debug("attached to rank monitor (rank %s, pid %s)", self.rank, self.monitor_pid)

    def arm(self, sections: Iterable[str] = ()) -> dict[str, Any]:
        """Start a monitored run (``init``); on an attached link the run counts from the rank's start."""
        names = [validate_section_name(n) for n in sections]
        with self._lock:
            connected = self._channel is not None
            if not connected:  # a failure here never reached a monitor: no retry, it would wait as long again
                reply = self._connect("init", None, sections=names)
        if connected:
            reply = self._retrying("init", lambda: self._init_locked(names))
        self.armed = True
        return reply

    def _init_locked(self, names: list[str]) -> dict[str, Any]:
        reply = self._request_locked("init", token=self._token, pid=os.getpid(), global_rank=self.global_rank,
                                     sections=names)
        self._adopt(reply)
        return reply

    def _connect(self, op: str, timeout: float | None, **fields: Any) -> dict[str, Any]:
        channel = Channel.connect(self.socket_path, connect_timeout=self.connect_timeout if timeout is None else timeout)
        try:
            reply = channel.request(op, token=self._token, pid=os.getpid(), global_rank=self.global_rank, **fields)
            slot = Slot.attach(self.shm_path)
        except MonitorError as exc:
            channel.close()
            raise RuntimeError(f"the rank monitor refused this rank: {exc}") from None
        except BaseException:
            channel.close()
            raise
        with self._lock:
            old, self._channel = self._channel, channel  # a new channel: tells others someone re-attached
            if self.writer is None:
                self.writer = SlotWriter(slot)
            else:
                self.writer.rebind(slot)
            self._adopt(reply)
        if old is not None:
            old.close()
        return reply

    def _adopt(self, reply: Mapping[str, Any]) -> None:
        if "sections" in reply:
            self.ids = dict(reply["sections"])
        self.rank = reply.get("rank", self.rank)
        self.timeouts = reply.get("timeouts", self.timeouts)
        self.monitor_pid = reply.get("monitor_pid", self.monitor_pid)

    # ---- requests
    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """One control request; if the monitor died under it, re-attach to its replacement and retry once.

        The agent restarts a dead monitor within about a second; a training script calling e.g.
        ``calculate_and_set_timeouts`` at that moment should not crash for it.
        """
        return self._retrying(op, lambda: self._request_locked(op, **fields))

    def _retrying(self, op: str, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """CALL under the lock; on OSError from a monitor that has exited, re-attach and CALL once more."""
        with self._lock:
            failed_on = self._channel
            try:
                return call()
            except OSError as exc:  # ConnectionError, BrokenPipeError, timeouts: the monitor went away?
                if not self._monitor_exited():
                    raise  # the monitor lives: re-attaching would reset its record of this run
                log.info("rank monitor request %r failed (%s); re-attaching and retrying once", op, exc)
        if not self._recover(failed_on):
            raise ConnectionError(f"the rank monitor is gone and did not come back within {REATTACH_TIMEOUT:.0f} s "
                                  f"({op}); is the nvrx launch agent still running?")
        with self._lock:
            return call()

    def request_once(self, op: str, **fields: Any) -> dict[str, Any]:
        """One control request, no retry (e.g. ``shutdown``: not worth waiting for a new monitor)."""
        with self._lock:
            return self._request_locked(op, **fields)

    def _monitor_exited(self, wait: float = 2.0) -> bool:
        """True if the monitor process has exited (waiting up to WAIT s: a failing socket may precede it)."""
        pid = self.monitor_pid
        if pid is None:
            return True
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return True
        try:
            return bool(select.select([fd], [], [], wait)[0])
        finally:
            os.close(fd)

    def _request_locked(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._channel is None:
            raise RuntimeError(f"not connected to the rank monitor ({op})")
        return self._channel.request(op, **fields)

    # ---- surviving a monitor restart
    def watch(self) -> None:
        """Re-attach (in a daemon thread) whenever the monitor process dies and the agent restarts it."""
        threading.Thread(target=self._watch_loop, name="nvrx-monitor-watch", daemon=True).start()

    def _watch_loop(self) -> None:
        while self.monitor_pid is not None:
            watched = self._channel
            try:
                pidfd = os.pidfd_open(self.monitor_pid)
            except ProcessLookupError:
                pidfd = None
            if pidfd is not None:
                try:
                    select.select([pidfd], [], [])
                finally:
                    os.close(pidfd)
            if self.monitor_pid is None or not self._recover(watched):
                return

    def _recover(self, lost: Channel | None) -> bool:
        """Re-attach unless someone already replaced channel LOST; True when connected to a live monitor."""
        with self._reattach_lock:
            if self._channel is not lost:
                return self._channel is not None
            if self.monitor_pid is None:  # closed on purpose
                return False
            return self._reattach()

    def _reattach(self) -> bool:
        names = [name for name, _ in sorted(self.ids.items(), key=lambda kv: kv[1])]
        deadline = time.monotonic() + REATTACH_TIMEOUT
        while time.monotonic() < deadline:
            try:
                before = dict(self.ids)
                self._connect("attach", deadline - time.monotonic(), started=self.started, armed=self.armed,
                              resume=True, sections=names)
                if any(self.ids.get(n) != sid for n, sid in before.items()):
                    log.warning("the restarted rank monitor numbered sections differently; stats may be off")
                log.info("re-attached to the restarted rank monitor (pid %s)", self.monitor_pid)
                return True
            except (OSError, ConnectionError, RuntimeError) as exc:
                log.debug("re-attach failed, retrying: %s", exc)
                time.sleep(0.1)
        log.warning("the rank monitor did not come back within %.0f s; this rank is no longer monitored",
                    REATTACH_TIMEOUT)
        return False

    def close(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
            self.monitor_pid = None
        if channel is not None:
            channel.close()


def _env_of_server(env: Mapping[str, str]) -> dict[str, str]:
    """The NVRX_MONITOR_* values of a monitor that RankMonitorServer started at FT_RANK_MONITOR_IPC_SOCKET."""
    from nvrx.monitors.server import monitor_files

    sock, slot, token = monitor_files(env[FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR])
    return {**env, ENV_SOCKET: str(sock), ENV_SHM: str(slot), ENV_TOKEN: token}


# ---- the process-wide link made by the bootstrap

_shared: MonitorLink | None = None
_attach_done: threading.Event | None = None  # None: the bootstrap started no attach in this process
_own_link: MonitorLink | None = None  # a link a RankMonitorClient made itself (no bootstrap)
REPORT_WAIT = 10.0  # s: a checkpoint report made while the bootstrap still attaches waits this long for it


def _report_to_monitor(report: checkpoint_report.CheckpointReport | checkpoint_report.IntervalReport) -> bool:
    """The checkpoint-report sink (nvrx.common.checkpoint_report): one ``checkpoint`` (or ``checkpoint_interval``)
    request to the rank's monitor.

    No retry and no re-attach: a monitor being restarted costs this one report, never the checkpoint's time.
    """
    link = shared_link(REPORT_WAIT) or _own_link
    if link is None:
        return False
    try:
        if isinstance(report, checkpoint_report.IntervalReport):
            link.request_once("checkpoint_interval", **dataclasses.asdict(report))
        else:
            link.request_once("checkpoint", step=report.step, tier=report.tier, taken=report.taken, path=report.path)
    except (OSError, MonitorError, RuntimeError) as exc:
        log.debug("checkpoint report not delivered: %s", exc)
        return False
    return True


def attach_in_background(env: Mapping[str, str], started: float,
                         on_attached: Callable[[MonitorLink], None] | None = None) -> None:
    """Bootstrap side: attach this rank to its monitor without delaying user code."""
    global _attach_done
    done = _attach_done = threading.Event()
    checkpoint_report.set_sink(_report_to_monitor)
    monitor_env = take_monitor_env(env)  # now, before user code could start a process inheriting the token

    def run() -> None:
        global _shared
        try:
            link = MonitorLink.from_env(monitor_env)
            link.attach(started=started, armed=False)
            if on_attached is not None:
                on_attached(link)
            link.watch()
            _shared = link
        except Exception as exc:  # best effort: a client that is used connects (and reports) itself
            log.warning("cannot attach to the rank monitor: %s", exc)
        finally:
            done.set()

    threading.Thread(target=run, name="nvrx-monitor-attach", daemon=True).start()


def shared_link(timeout: float = 30.0) -> MonitorLink | None:
    """The bootstrap's link once its attach finished; None outside the bootstrap or if it failed."""
    if _attach_done is None:
        return None
    _attach_done.wait(timeout)
    return _shared


def _collective_merge(local: dict[str, Any], ready: bool) -> tuple[dict[str, Any], bool]:
    """All ranks' observed maxima merged (max), and whether every rank was ready.

    NVRx's calculate_and_set_* are collective so that every rank enforces (and saves) the same timeouts;
    without an initialized torch.distributed this rank's own values are used. torch is not imported here:
    a script that uses torch.distributed has imported it already.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return local, ready
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"values": local, "ready": ready})
    merged: dict[str, Any] = {"sections": {}}
    for item in gathered:
        values = item["values"]
        for key in ("initial_heartbeat", "heartbeat", "out_of_section"):
            if key in values:
                merged[key] = _max_opt(merged.get(key), values[key])
        for name, value in (values.get("sections") or {}).items():
            merged["sections"][name] = _max_opt(merged["sections"].get(name), value)
    return merged, all(item["ready"] for item in gathered)


def _max_opt(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return b if a is None else a
    return max(a, b)


def _tracker_state_of(state: Mapping[str, Any]) -> dict[str, Any]:
    """The monitor's state from what ``state_dict()`` returned (ours or NVRx's), validated here.

    Raises RankMonitorClientError with the reason, so bad input fails at the call, not later at init.
    """
    if not isinstance(state, Mapping):
        raise RankMonitorClientError(f"load_state_dict: expected a mapping, got {type(state).__name__}")
    if isinstance(state.get(MONITOR_STATE_KEY), Mapping):
        tracker_state = dict(state[MONITOR_STATE_KEY])
    elif CURRENT_TIMEOUTS_STATE_KEY in state:
        try:
            tracker_state = tracker_state_from_nvrx(state[CURRENT_TIMEOUTS_STATE_KEY])
        except (ValueError, TypeError, AttributeError) as exc:
            raise RankMonitorClientError(f"load_state_dict: unusable {CURRENT_TIMEOUTS_STATE_KEY!r}: {exc}") from None
    else:
        tracker_state = dict(state)
    try:
        TimeoutTracker(Timeouts(), 1.0).load_state_dict(tracker_state)
    except (ValueError, TypeError, AttributeError) as exc:
        raise RankMonitorClientError(f"load_state_dict: not a RankMonitorClient state: {exc}") from None
    return tracker_state


CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"
MONITOR_STATE_KEY = "nvrx_monitor_state"  # our extra key: observations too, so later learning never goes lower


class RankMonitorClient:
    """Connects a rank to its rank monitor, with NVRx's client API (names, arguments, returns, errors).

    Differences from NVRx, on purpose: section names need not be configured in advance (unknown names
    are registered on first use); section misuse raises at once (``SectionUsageError``, a
    RankMonitorClientError and a ValueError) where NVRx's default ``skip_section_response`` hides it;
    ``state_dict()`` carries, next to NVRx's ``current_timeouts``, the monitor's observations.
    """

    CURRENT_TIMEOUTS_STATE_KEY = CURRENT_TIMEOUTS_STATE_KEY

    def __init__(self) -> None:
        self._link: MonitorLink | None = None
        self._writer: SlotWriter | None = None  # the link's writer; re-attach rebinds it in place
        self.rank: int | None = None
        self.timeouts: dict[str, Any] = {}  # the timeouts in force (Timeouts.to_dict())
        self._calculated: dict[str, Any] | None = None  # None until the monitor told us (init)
        self._pending_state: dict[str, Any] | None = None  # load_state_dict before init
        self.cfg: Any = None  # FaultToleranceConfig the monitor runs with, after init
        self.num_warmup_iters: int | None = None  # NVRx's argument of init_workload_monitoring (checked, kept)

    @property
    def is_initialized(self) -> bool:
        return self._link is not None

    @property
    def hb_timeouts(self) -> HeartbeatTimeouts | None:
        """The heartbeat timeouts in force (None before init_workload_monitoring)."""
        if self._calculated is None:
            return None
        return hb_timeouts_of(self.timeouts, self._calculated)

    @property
    def section_timeouts(self) -> SectionTimeouts | None:
        """The section timeouts in force (None before init_workload_monitoring)."""
        if self._calculated is None:
            return None
        return section_timeouts_of(self.timeouts, self._calculated)

    def _adopt(self, reply: Mapping[str, Any]) -> None:
        self.timeouts = reply.get("timeouts", self.timeouts)
        self._calculated = reply.get("calculated", self._calculated or {})

    def init_workload_monitoring(self, num_warmup_iters: int | None = None, *, sections: Iterable[str] = ()) -> None:
        """Start a monitored run on this rank's monitor connection.

        NUM_WARMUP_ITERS is NVRx's: the iterations after a restart that its progress tracking ignores. It is
        checked (None or a whole number >= 0) and kept as ``self.num_warmup_iters``; nvrx tracks progress across
        launches in ``nvrx resume``, not per iteration here, so it changes nothing else. SECTIONS (an nvrx extra,
        keyword only) registers section names up front. Timeouts given to load_state_dict() before this call are
        applied now.
        """
        if num_warmup_iters is not None and (isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int)
                                             or num_warmup_iters < 0):
            raise ValueError(f"init_workload_monitoring: num_warmup_iters={num_warmup_iters!r} is not None or a "
                             "whole number >= 0")
        self.num_warmup_iters = num_warmup_iters
        if self._link is not None:
            raise RankMonitorClientError("RankMonitorClient is already initialized")
        link = shared_link()
        try:
            if link is None:
                link = MonitorLink.from_env(take_monitor_env())
            elif isinstance(link.owner, RankMonitorClient) and link.owner.is_initialized:
                raise RankMonitorClientError("workload monitoring is already initialized by another RankMonitorClient")
            reply = link.arm(sections)
        except MonitorError as exc:
            raise RankMonitorClientError(f"the rank monitor refused this rank: {exc}") from None
        except (RuntimeError, OSError) as exc:
            if isinstance(exc, RankMonitorClientError):
                raise
            raise RankMonitorClientError(str(exc)) from None
        link.owner = self
        self._link, self._writer = link, link.writer
        if link is not _shared:
            global _own_link
            _own_link = link
            checkpoint_report.set_sink(_report_to_monitor)
        self.rank = reply.get("rank")
        self._adopt(reply)
        self.cfg = _config_of(reply.get("config"))
        if self.cfg is not None and self.cfg.install_exception_hook:
            _install_exception_hook(self)
        log.debug("monitoring rank %s (run %s)", self.rank, reply.get("generation"))
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._adopt(self._request("load_state_dict", state=state))

    # ---- hot path: stores into the shared slot, nothing else
    def send_heartbeat(self) -> None:
        """Tell the monitor this rank is alive (a few memory stores)."""
        writer = self._writer
        if writer is None:
            raise RankMonitorClientError("RankMonitorClient is not initialized (call init_workload_monitoring first)")
        writer.beat()

    def start_section(self, section: str) -> None:
        """Open SECTION; its timeout (if any) replaces the heartbeat timeout while it is open."""
        link = self._initialized_link("start_section")
        sid = link.ids.get(section)
        if sid is None:
            sid = self._register(section)
        try:
            self._writer.open_section(sid)  # type: ignore[union-attr]
        except ValueError:
            raise SectionUsageError(f"section {section!r} is already open") from None

    def end_section(self, section: str) -> None:
        """Close SECTION. SectionUsageError if it was never started or is not open."""
        link = self._initialized_link("end_section")
        sid = link.ids.get(section)
        if sid is None:
            raise SectionUsageError(f"end_section({section!r}): section {section!r} was never started")
        try:
            self._writer.close_section(sid)  # type: ignore[union-attr]
        except ValueError:
            raise SectionUsageError(f"end_section({section!r}): the section is not open (start_section first)") from None

    def end_all_sections(self) -> None:
        """Close every open section (e.g. before an exception leaves the training loop)."""
        link = self._initialized_link("end_all_sections")
        writer = self._writer
        for sid in sorted(link.ids.values()):
            if writer is not None and writer.is_open(sid):
                writer.close_section(sid)

    def _initialized_link(self, what: str) -> MonitorLink:
        link = self._link
        if link is None:
            raise RankMonitorClientError(f"RankMonitorClient is not initialized (call init_workload_monitoring "
                                         f"before {what})")
        return link

    def _register(self, name: str) -> int:
        try:
            validate_section_name(name)
        except ValueError as exc:
            raise SectionUsageError(str(exc)) from None
        reply = self._request("sections", names=[name])
        self._link.ids = dict(reply["sections"])  # type: ignore[union-attr]
        return self._link.ids[name]  # type: ignore[union-attr]

    # ---- control requests
    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        link = self._initialized_link(op)
        try:
            return link.request(op, **fields)
        except MonitorError as exc:
            raise SectionUsageError(str(exc)) if op == "sections" else RankMonitorClientError(str(exc)) from None
        except OSError as exc:
            raise RankMonitorClientError(f"{op}: the rank monitor is unreachable: {exc}") from None

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Learn the heartbeat timeouts from the observed intervals (times safety_factor); collective.

        Needs a first heartbeat and one interval on every rank. Returns True when set; without enough
        data returns False if SKIP_IF_NOT_READY, else raises RankMonitorClientError.
        """
        observed = self._request("observed")["observed"]
        local = {"initial_heartbeat": observed["initial_heartbeat"], "heartbeat": observed["heartbeat"]}
        ready = all(v is not None for v in local.values())
        return self._set_calculated(local, ready, skip_if_not_ready)

    def calculate_and_set_section_timeouts(self, selected_sections: Collection[str] | None = None,
                                           calc_out_of_section: bool = True,
                                           skip_if_not_ready: bool = False) -> bool:
        """Learn section timeouts (SELECTED_SECTIONS, default every known section) and, with
        CALC_OUT_OF_SECTION, the out-of-section timeout; collective. Same return/raise rules as
        calculate_and_set_hb_timeouts."""
        reply = self._request("observed")
        observed = reply["observed"]
        names = sorted(reply["sections"]) if selected_sections is None else list(selected_sections)
        for name in names:
            if not isinstance(name, str):
                raise RankMonitorClientError(f"selected_sections: {name!r} is not a section name")
        seen = observed["sections"]
        local: dict[str, Any] = {"sections": {n: seen[n] for n in names if n in seen}}
        ready = len(local["sections"]) == len(set(names))
        if calc_out_of_section:
            local["out_of_section"] = observed["out_of_section"]
            ready = ready and observed["out_of_section"] is not None
        return self._set_calculated(local, ready, skip_if_not_ready)

    def _set_calculated(self, local: dict[str, Any], ready: bool, skip_if_not_ready: bool) -> bool:
        values, ready = _collective_merge(local, ready)
        if not ready:
            if skip_if_not_ready:
                return False
            raise RankMonitorClientError("Not enough data to compute timeouts.")
        values = {k: v for k, v in values.items() if v is not None and v != {}}
        self._adopt(self._request("set_calculated", values=values))
        return True

    def calculate_and_set_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Spec 001's single call: learn every timeout this rank has observed; True if any was set.

        Not collective (each rank learns from its own observations); a quantity never observed keeps
        its configured timeout. With nothing observed it returns False (and logs a warning unless
        SKIP_IF_NOT_READY).
        """
        reply = self._request("calculate_and_set_timeouts")
        self._adopt(reply)
        if not reply["updated"] and not skip_if_not_ready:
            log.warning("calculate_and_set_timeouts: nothing observed yet; timeouts unchanged")
        return bool(reply["updated"])

    def state_dict(self) -> dict[str, Any]:
        """``{"current_timeouts": {"heartbeat": ..., "section": ...}}`` as NVRx gives it (only the
        calculated parts), plus the monitor's observations under ``nvrx_monitor_state``. JSON-safe."""
        reply = self._request("state_dict")
        self._adopt(reply)
        current: dict[str, Any] = {}
        hb, sec = self.hb_timeouts, self.section_timeouts
        if hb is not None and hb.are_valid and hb.were_calculated:
            current["heartbeat"] = dataclasses.asdict(hb)
        if sec is not None and (sec.calculated_sections or sec.is_out_of_section_calculated):
            current["section"] = {"section": dict(sec.section), "out_of_section": sec.out_of_section,
                                  "calculated_sections": sorted(sec.calculated_sections),
                                  "is_out_of_section_calculated": sec.is_out_of_section_calculated}
        return {CURRENT_TIMEOUTS_STATE_KEY: current, MONITOR_STATE_KEY: reply["state"]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt timeouts saved by state_dict() (ours or NVRx's); before init they apply at init."""
        tracker_state = _tracker_state_of(state)
        if self._link is None:
            self._pending_state = tracker_state
            return
        self._adopt(self._request("load_state_dict", state=tracker_state))

    def send_workload_control_request(self, req: WorkloadControlRequest) -> None:
        """Ask the launcher to act on the workload (spec 001): ``ExcludeThisNode`` ends the job at once with exit
        16 (resume elsewhere: ``nvrx resume`` avoids this node), ``ShutdownWorkload`` ends it with exit 93 (no
        restart, no requeue); ``Continue`` is only logged. The agent acts as soon as the monitor hands it over;
        RankMonitorClientError if the monitor could not (no agent, e.g. under ``RankMonitorServer``).
        """
        if not isinstance(req, WorkloadControlRequest):
            raise RankMonitorClientError(f"send_workload_control_request takes a WorkloadControlRequest, not {req!r}")
        reply = self._request("workload_control", action=req.action.name, description=str(req.description))
        if not reply.get("forwarded"):
            raise RankMonitorClientError(f"the rank monitor could not pass {req!r} to a launcher agent "
                                         "(is this rank running under nvrx launch?)")

    def shutdown_workload_monitoring(self) -> None:
        """End this rank's monitored run; the monitor stays up for a restarted rank."""
        link, self._link, self._writer = self._link, None, None
        if link is None:
            return
        link.owner = None
        try:
            link.request_once("shutdown")
        except (OSError, MonitorError, RuntimeError) as exc:
            log.debug("shutdown request failed: %s", exc)
        link.armed = False
        if link is not _shared:
            link.close()


_hooked: set[int] = set()  # ids of clients whose exception hook is installed


def _install_exception_hook(client: RankMonitorClient) -> None:
    """Log an uncaught exception with the rank number and close the rank's open sections, then let the
    previous hook print it. Closing the sections makes the monitor's record end where the rank failed
    rather than leave a section open until the rank's exit is noticed."""
    if id(client) in _hooked:
        return
    _hooked.add(id(client))
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        log.error("rank %s: uncaught %s: %s", client.rank, exc_type.__name__, exc)
        if client.is_initialized:
            try:
                client.end_all_sections()
            except Exception as err:  # never hide the original exception
                log.debug("end_all_sections in the exception hook failed: %s", err)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _config_of(raw: Any) -> Any:
    """The monitor's FaultToleranceConfig from its init reply (None if it sent none)."""
    if not isinstance(raw, Mapping):
        return None
    from nvrx.monitors.ft_config import FaultToleranceConfig

    try:
        return FaultToleranceConfig.from_dict(raw, source="rank monitor config")
    except ValueError as exc:
        log.warning("cannot read the rank monitor's config: %s", exc)
        return None
