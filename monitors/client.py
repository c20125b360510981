"""RankMonitorClient: the rank's side of fault-tolerance monitoring.

Under ``nvrx launch`` the bootstrap attaches each rank to its monitor before user code runs (in a
background thread, so the rank's start is not delayed): the monitor then knows the rank's pid and start
time, and ``RankMonitorClient()`` reuses that connection. A client created outside the bootstrap connects
itself, from the environment the agent sets:

  ``NVRX_MONITOR_SOCKET``           path of this rank's monitor control socket (Unix, JSON lines)
  ``NVRX_MONITOR_TOKEN``            secret token proving the rank belongs to this launch
  ``NVRX_MONITOR_SHM``              path of this rank's heartbeat slot (mmap'd, see monitors.heartbeat)
  ``NVRX_MONITOR_CONNECT_TIMEOUT``  optional; seconds to wait for the monitor to listen (default 30)
  ``NVRX_AUTO_HEARTBEAT``           optional; the bootstrap heartbeats automatically at this interval

Usage::

    client = RankMonitorClient()
    client.init_workload_monitoring()
    for step in ...:
        client.start_section("step"); train_step(); client.end_section("step")
        client.send_heartbeat()
    client.calculate_and_set_timeouts()
    client.shutdown_workload_monitoring()

``send_heartbeat``/``start_section``/``end_section`` only store into shared memory (no syscall); the
first use of a section name unknown to the monitor costs one request to register it. If the monitor
dies and the agent restarts it, the link re-attaches and carries the run's record into the new slot;
a control request that fails because the monitor died re-attaches and is retried once.

The token is removed from ``os.environ`` when it is first read (and kept in this module), so processes
the rank starts do not inherit it; the monitor also refuses a second live process for the same rank.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from monitors.control import Channel, MonitorError
from monitors.heartbeat import Slot, SlotWriter
from monitors.sections import validate_section_name

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
    out = {k: v for k, v in env.items() if k.startswith("NVRX_MONITOR_") or k == "RANK"}
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


# ---- the process-wide link made by the bootstrap

_shared: MonitorLink | None = None
_attach_done: threading.Event | None = None  # None: the bootstrap started no attach in this process


def attach_in_background(env: Mapping[str, str], started: float,
                         on_attached: Callable[[MonitorLink], None] | None = None) -> None:
    """Bootstrap side: attach this rank to its monitor without delaying user code."""
    global _attach_done
    done = _attach_done = threading.Event()
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


class RankMonitorClient:
    """Connects a rank to its rank monitor; mirrors the NVRx client API names."""

    def __init__(self) -> None:
        self._link: MonitorLink | None = None
        self._writer: SlotWriter | None = None  # the link's writer; re-attach rebinds it in place
        self.rank: int | None = None
        self.timeouts: dict[str, Any] = {}

    @property
    def is_initialized(self) -> bool:
        return self._link is not None

    def init_workload_monitoring(self, sections: Iterable[str] = ()) -> None:
        """Start a monitored run on this rank's monitor connection."""
        if self._link is not None:
            raise RuntimeError("workload monitoring is already initialized")
        link = shared_link()
        if link is None:
            link = MonitorLink.from_env(take_monitor_env())
        elif isinstance(link.owner, RankMonitorClient) and link.owner.is_initialized:
            raise RuntimeError("workload monitoring is already initialized by another RankMonitorClient")
        try:
            reply = link.arm(sections)
        except MonitorError as exc:
            raise RuntimeError(f"the rank monitor refused this rank: {exc}") from None
        link.owner = self
        self._link, self._writer = link, link.writer
        self.rank = reply.get("rank")
        self.timeouts = reply.get("timeouts", {})
        log.debug("monitoring rank %s (run %s)", self.rank, reply.get("generation"))

    # ---- hot path: stores into the shared slot, nothing else
    def send_heartbeat(self) -> None:
        """Tell the monitor this rank is alive (a few memory stores)."""
        writer = self._writer
        if writer is None:
            raise RuntimeError("call init_workload_monitoring() before send_heartbeat()")
        writer.beat()

    def start_section(self, name: str) -> None:
        """Open section NAME; its timeout (if any) replaces the heartbeat timeout while it is open."""
        link = self._link
        if link is None:
            raise RuntimeError("call init_workload_monitoring() before start_section()")
        sid = link.ids.get(name)
        if sid is None:
            sid = self._register(name)
        try:
            self._writer.open_section(sid)  # type: ignore[union-attr]
        except ValueError:
            raise ValueError(f"section {name!r} is already open") from None

    def end_section(self, name: str) -> None:
        """Close section NAME. ValueError if it was never started or is not open."""
        link = self._link
        if link is None:
            raise RuntimeError("call init_workload_monitoring() before end_section()")
        sid = link.ids.get(name)
        if sid is None:
            raise ValueError(f"end_section({name!r}): section {name!r} was never started")
        try:
            self._writer.close_section(sid)  # type: ignore[union-attr]
        except ValueError:
            raise ValueError(f"end_section({name!r}): the section is not open (start_section first)") from None

    def _register(self, name: str) -> int:
        validate_section_name(name)
        reply = self._request("sections", names=[name])
        self._link.ids = dict(reply["sections"])  # type: ignore[union-attr]
        return self._link.ids[name]  # type: ignore[union-attr]

    # ---- control requests
    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._link is None:
            raise RuntimeError(f"call init_workload_monitoring() before {op}")
        try:
            return self._link.request(op, **fields)
        except MonitorError as exc:
            raise ValueError(str(exc)) from None

    def calculate_and_set_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Learn timeouts from the observed intervals (monitor persists them); True if any was set."""
        reply = self._request("calculate_and_set_timeouts")
        self.timeouts = reply["timeouts"]
        if not reply["updated"] and not skip_if_not_ready:
            log.warning("calculate_and_set_timeouts: nothing observed yet; timeouts unchanged")
        return bool(reply["updated"])

    def state_dict(self) -> dict[str, Any]:
        """The monitor's learned timeouts and observations (JSON-safe)."""
        return self._request("state_dict")["state"]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt timeouts learned in a previous run."""
        self.timeouts = self._request("load_state_dict", state=dict(state))["timeouts"]

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
