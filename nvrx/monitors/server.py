"""``RankMonitorServer``: NVRx's entry point for running a rank monitor, mapped onto ``nvrx.monitors.rank_monitor``.

``nvrx launch`` starts its monitors itself (``python -m nvrx.monitors.rank_monitor``). This class is for code
that, like NVRx's own launcher or a custom one, starts a monitor by hand::

    proc = RankMonitorServer.run_in_subprocess(cfg, "/tmp/rank0-monitor.socket")
    # start the rank with FT_RANK_MONITOR_IPC_SOCKET=/tmp/rank0-monitor.socket in its environment;
    # its RankMonitorClient().init_workload_monitoring() connects to this monitor.

Our monitor's socket, heartbeat slot and secret token must live in a private (0700) directory, and a
path like ``/tmp/x.socket`` is in a shared one; so the monitor makes its own private directory and the
given path becomes a symlink to the socket inside it. The client follows the symlink and finds the token
(a 0600 file) and the slot next to the socket: the same user, and only that user, can attach, as with
the socket itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from nvrx.common.errors import NvrxError
from nvrx.common.process import die_with_parent
from nvrx.events import EventLog
from nvrx.monitors.ft_config import FaultToleranceConfig, inactive_settings_line
from nvrx.monitors.rank_monitor import RankMonitor

log = logging.getLogger("nvrx.rank_monitor")

SOCKET_NAME = "monitor.sock"
SLOT_NAME = "slot"
TOKEN_NAME = "token"


class RankMonitorServerError(NvrxError, RuntimeError):
    """The rank monitor could not be started (NVRx raises RuntimeError here; this is one)."""


def monitor_files(ipc_socket_path: str | os.PathLike[str]) -> tuple[Path, Path, str]:
    """(real socket, heartbeat slot, token) of a monitor started by RankMonitorServer at IPC_SOCKET_PATH.

    Used by the client when only NVRx's ``FT_RANK_MONITOR_IPC_SOCKET`` is set. Refuses a directory that
    is not private to this user, so a planted symlink cannot hand the rank someone else's monitor.
    """
    real = Path(os.path.realpath(ipc_socket_path))
    folder = real.parent
    st = os.lstat(folder)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise RankMonitorServerError(f"{ipc_socket_path} does not lead to a private directory of this user; "
                                     "was the monitor started by RankMonitorServer?")
    try:
        token = (folder / TOKEN_NAME).read_text().strip()
    except OSError as exc:
        raise RankMonitorServerError(f"no rank monitor token next to {real}: {exc.strerror or exc}") from None
    return real, folder / SLOT_NAME, token


class RankMonitorServer:
    """A rank monitor for one rank, with NVRx's constructor and ``run`` / ``run_in_subprocess``."""

    RANK_MONITOR_INIT_TIMEOUT = 180.0

    def __init__(self, cfg: FaultToleranceConfig, ipc_socket_path: str, rank_monitor_ready_event: Any = None,
                 logger: Any = None, *, rank: int = 0) -> None:
        if not isinstance(cfg, FaultToleranceConfig):
            raise TypeError(f"cfg must be a FaultToleranceConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.ipc_socket_path = Path(ipc_socket_path)
        self.ready_event = rank_monitor_ready_event
        self.logger = logger  # NVRx's RankMonitorLogger; nvrx logs through the logging module instead
        self.rank = rank
        self.private_dir = Path(tempfile.mkdtemp(prefix="nvrx-rmon-"))  # 0700
        self._token = secrets.token_hex(16)
        token_file = self.private_dir / TOKEN_NAME
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self._token)

    def _publish(self) -> None:
        """Make IPC_SOCKET_PATH lead to our socket (a symlink; a stale link or socket of ours is replaced)."""
        path, target = self.ipc_socket_path, self.private_dir / SOCKET_NAME
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid != os.getuid() or not (stat.S_ISLNK(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
                raise RankMonitorServerError(f"{path} exists and is not a stale socket of this user; "
                                             "choose another ipc_socket_path")
            path.unlink()
        path.symlink_to(target)

    def serve(self, parent_pid: int | None = None) -> int:
        """Run the monitor until it is stopped (SIGTERM/SIGINT/SIGHUP) or its parent exits."""
        parent_pid = os.getppid() if parent_pid is None else parent_pid
        log.info("%s", inactive_settings_line(self.cfg))
        monitor = RankMonitor(self.rank, self.cfg, self.private_dir, self.private_dir / SOCKET_NAME,
                              self.private_dir / SLOT_NAME, self._token, EventLog(None, f"monitor-{self.rank}"),
                              parent_pid)
        try:
            self._publish()
            monitor.install_signal_handlers()
            if self.ready_event is not None:
                self.ready_event.set()
            return monitor.run()
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        try:
            if os.path.islink(self.ipc_socket_path) and \
                    os.readlink(self.ipc_socket_path) == str(self.private_dir / SOCKET_NAME):
                os.unlink(self.ipc_socket_path)
        except OSError:
            pass
        shutil.rmtree(self.private_dir, ignore_errors=True)

    @staticmethod
    def run(cfg: FaultToleranceConfig, ipc_socket_path: str, rank_monitor_ready_event: Any = None,
            is_restarter_logger: bool = False, env: Mapping[str, str] | None = None) -> None:
        """Serve in this process (NVRx runs this in the monitor's own process); ENV is applied first."""
        if env:
            os.environ.update(env)
        logging.basicConfig(level=cfg.log_level, format="[rank-monitor] %(asctime)s %(levelname)s %(message)s")
        die_with_parent(os.getppid(), signal.SIGTERM)
        RankMonitorServer(cfg, ipc_socket_path, rank_monitor_ready_event).serve()

    @staticmethod
    def run_in_subprocess(cfg: FaultToleranceConfig, ipc_socket_path: str, is_restarter_logger: bool = False,
                          mp_ctx: Any = None, env: Mapping[str, str] | None = None) -> multiprocessing.Process:
        """Start the monitor in a child process; returns it once the monitor is listening.

        MP_CTX defaults to the "spawn" context (NVRx passes torch.multiprocessing; any context works).
        RuntimeError (RankMonitorServerError) if the monitor is not ready within RANK_MONITOR_INIT_TIMEOUT.
        """
        ctx = mp_ctx if mp_ctx is not None else multiprocessing.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=RankMonitorServer.run, name="nvrx-rank-monitor", daemon=True,
                           args=(cfg, str(ipc_socket_path), ready, is_restarter_logger, dict(env or {})))
        proc.start()
        deadline = time.monotonic() + RankMonitorServer.RANK_MONITOR_INIT_TIMEOUT
        while not ready.wait(0.2):  # not a plain wait: a monitor that dies at start must fail at once
            if not proc.is_alive():
                raise RankMonitorServerError(f"Could not start rank monitor at {ipc_socket_path}: it exited "
                                             f"with code {proc.exitcode} (see its log above)")
            if time.monotonic() >= deadline:
                break
        if not ready.is_set():
            proc.terminate()
            proc.join(5)
            raise RankMonitorServerError(f"Could not start rank monitor at {ipc_socket_path}: not ready within "
                                         f"{RankMonitorServer.RANK_MONITOR_INIT_TIMEOUT:.0f} s")
        return proc
