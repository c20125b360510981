"""RankMonitorClient: the rank's side of fault-tolerance monitoring.

Environment (set by ``nvrx launch`` for every rank; missing variables mean "not started by nvrx"):

  ``NVRX_MONITOR_SOCKET``           path of this rank's monitor control socket (Unix, JSON lines)
  ``NVRX_MONITOR_TOKEN``            secret token proving the rank belongs to this launch
  ``NVRX_MONITOR_SHM``              path of this rank's heartbeat slot (mmap'd, see monitors.heartbeat)
  ``NVRX_MONITOR_CONNECT_TIMEOUT``  optional; seconds to wait for the monitor to listen (default 30)

Usage::

    client = RankMonitorClient()
    client.init_workload_monitoring()
    for step in ...:
        client.start_section("step"); train_step(); client.end_section("step")
        client.send_heartbeat()
    client.calculate_and_set_timeouts()
    client.shutdown_workload_monitoring()

``send_heartbeat``/``start_section``/``end_section`` only store into shared memory (no syscall); the
first use of a section name unknown to the monitor costs one request to register it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from monitors.control import Channel, MonitorError
from monitors.heartbeat import Slot, SlotWriter
from monitors.sections import validate_section_name

log = logging.getLogger("nvrx.client")

ENV_SOCKET = "NVRX_MONITOR_SOCKET"
ENV_TOKEN = "NVRX_MONITOR_TOKEN"
ENV_SHM = "NVRX_MONITOR_SHM"
ENV_CONNECT_TIMEOUT = "NVRX_MONITOR_CONNECT_TIMEOUT"


class RankMonitorClient:
    """Connects a rank to its rank monitor; mirrors the NVRx client API names."""

    def __init__(self) -> None:
        self._channel: Channel | None = None
        self._writer: SlotWriter | None = None
        self._ids: dict[str, int] = {}
        self.rank: int | None = None
        self.timeouts: dict[str, Any] = {}

    @property
    def is_initialized(self) -> bool:
        return self._writer is not None

    def init_workload_monitoring(self, sections: Iterable[str] = ()) -> None:
        """Connect to the monitor named by the environment and start a monitored run."""
        if self._writer is not None:
            raise RuntimeError("workload monitoring is already initialized")
        env = {name: os.environ.get(name) for name in (ENV_SOCKET, ENV_TOKEN, ENV_SHM)}
        missing = sorted(name for name, value in env.items() if not value)
        if missing:
            raise RuntimeError(f"no rank monitor for this process ({', '.join(missing)} not set): "
                               "start the script with `nvrx launch`")
        names = [validate_section_name(n) for n in sections]
        timeout = float(os.environ.get(ENV_CONNECT_TIMEOUT) or 30.0)
        channel = Channel.connect(Path(env[ENV_SOCKET]), connect_timeout=timeout)
        try:
            reply = channel.request("init", token=env[ENV_TOKEN], pid=os.getpid(), sections=names)
            writer = SlotWriter(Slot.attach(Path(env[ENV_SHM])))
        except MonitorError as exc:
            channel.close()
            raise RuntimeError(f"the rank monitor refused this rank: {exc}") from None
        except BaseException:
            channel.close()
            raise
        self._channel, self._writer = channel, writer
        self._ids = dict(reply["sections"])
        self.rank = reply.get("rank")
        self.timeouts = reply.get("timeouts", {})
        log.debug("connected to rank monitor (rank %s, run %s)", self.rank, reply.get("generation"))

    # ---- hot path
    def send_heartbeat(self) -> None:
        """Tell the monitor this rank is alive (a few memory stores)."""
        writer = self._writer
        if writer is None:
            raise RuntimeError("call init_workload_monitoring() before send_heartbeat()")
        writer.beat()

    def start_section(self, name: str) -> None:
        """Open section NAME; its timeout (if any) replaces the heartbeat timeout while it is open."""
        writer = self._writer
        if writer is None:
            raise RuntimeError("call init_workload_monitoring() before start_section()")
        sid = self._ids.get(name)
        if sid is None:
            sid = self._register(name)
        try:
            writer.open_section(sid)
        except ValueError:
            raise ValueError(f"section {name!r} is already open") from None

    def end_section(self, name: str) -> None:
        """Close section NAME. ValueError if it was never started or is not open."""
        writer = self._writer
        if writer is None:
            raise RuntimeError("call init_workload_monitoring() before end_section()")
        sid = self._ids.get(name)
        if sid is None:
            raise ValueError(f"end_section({name!r}): section {name!r} was never started")
        try:
            writer.close_section(sid)
        except ValueError:
            raise ValueError(f"end_section({name!r}): the section is not open (start_section first)") from None

    def _register(self, name: str) -> int:
        validate_section_name(name)
        reply = self._request("sections", names=[name])
        self._ids = dict(reply["sections"])
        return self._ids[name]

    # ---- control requests
    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._channel is None:
            raise RuntimeError(f"call init_workload_monitoring() before {op}")
        try:
            return self._channel.request(op, **fields)
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
        channel, writer = self._channel, self._writer
        self._channel = self._writer = None
        if channel is not None:
            try:
                channel.request("shutdown")
            except (OSError, MonitorError) as exc:
                log.debug("shutdown request failed: %s", exc)
            channel.close()
        if writer is not None:
            writer.close()
