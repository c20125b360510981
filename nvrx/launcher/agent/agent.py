"""The per-node agent: rendezvous, start ranks, supervise them, restart the job in place.

One agent runs on each node. Every (re)start of the job is a rendezvous round; within a round
the agent waits on three things at once, without polling: its ranks exiting (pidfds), the
round's stop record appearing in the store (a watcher thread), and signals sent to the agent.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator

from nvrx.common import exit_codes, rerun_exit
from nvrx.common.errors import NvrxError
from nvrx.launcher.agent.config import LaunchConfig, visible_device
from nvrx.launcher.agent.error_file import ErrorFiles, read_error_file
from nvrx.launcher.agent.node_health import NodeHealthChecks
from nvrx.launcher.agent.local_ckpt_dir import LOCAL_CKPT_DIR_ENV, claim_job_session, remove_job_session
from nvrx.launcher.agent.rank_monitors import RankMonitorGroup
from nvrx.launcher.agent.rdzv_errors import RendezvousError
from nvrx.launcher.agent.rdzv_records import RoundResult, StopKind, StopRecord
from nvrx.launcher.agent.restart_policy import FAULT_KINDS, RestartPolicy
from nvrx.launcher.agent.stragglers import StragglerAggregator
from nvrx.launcher.agent.worker_group import RankExit, RankSpec, WorkerGroup
from nvrx.events import (AgentSignal as AgentSignalEvent, AgentStart, EventLog, FtConfig, FtConfigInfo, HangInfo,
                             HealthCheckInfo, InprocessRankLost, JitAnswer, JitCheckpoint, JobEnd, JobFailure,
                             NodeHealth, RankErrorInfo, StopDetail)
from nvrx.monitors.ft_config import FaultToleranceConfig
from nvrx.monitors.jit_relay import PEER_FAILED

if TYPE_CHECKING:  # both import torch: the agent does so only after the fork server started importing it
    from nvrx.launcher.agent.rendezvous import Rendezvous
    from nvrx.launcher.agent.store import RendezvousStore

log = logging.getLogger(__name__)

# Forwarded signals that ranks using nvrx.launcher.rank.job_control.should_stop() turn into a graceful stop.
GRACEFUL_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2})
# The same signal again within this many seconds is one request delivered twice (Slurm signals the batch
# shell, `nvrx resume` and the agent alike), not a user's second Ctrl-C asking to kill now.
DUPLICATE_SIGNAL_WINDOW = 2.0
# bound on closing store connections at exit: the store host's linger for peers (10 s) plus a margin
STORE_CLOSE_GRACE = 15.0
# A node whose ranks exited 16 for a re-run elsewhere of ANOTHER node waits this long (beyond the grace the
# suspected node's ranks get to exit) for that node's agent to end the round before ending it itself.
RERUN_HOLD = 30.0
# --jit-ckpt: seconds a node waits, after a local rank's collective failed because a peer is gone, for the node that
# lost the rank to end the round (it names the rank); a node lost with its agent never does, and then this one ends it
PEER_FAILED_GRACE = 0.25
# After the rendezvous store stopped answering (StoreContact), how long the main thread may take to end the job
# itself before the watcher thread ends the process: the main thread may be blocked in a store request in C++.
STORE_LOST_EXIT_GRACE = 1.0


class StoreLost(RendezvousError):
    """This node could not reach the rendezvous store for store_timeout: cut off (or the store's host hangs)."""


def _gone(pid: int) -> bool:
    """PID has exited (or is a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _end_status(code: int) -> str:
    """How a job ended, for the event log and the terminal: succeeded, interrupted, steered or failed."""
    if code == exit_codes.OK:
        return "succeeded"
    if exit_codes.interrupted_signal(code) is not None:
        return "interrupted"
    return "steered" if code in exit_codes.STEERING_CODES else "failed"


class RoundState(enum.Enum):
    """This node's part in the current round while its ranks run (Agent._supervise moves it).

    RUNNING -> FAILED | SUCCEEDED | INTERRUPTED; FAILED, SUCCEEDED -> INTERRUPTED; INTERRUPTED is final.
    The round itself ends only with its stop record, which any node may write first.
    """

    RUNNING = "running"  # ranks run; this node has not asked to end the round
    FAILED = "failed"  # a local rank or rank monitor failed; this node reported the stop "failed"
    SUCCEEDED = "succeeded"  # every local rank exited 0; this node told the rendezvous so
    INTERRUPTED = "interrupted"  # a handled signal arrived: forwarded to the ranks, reported as "interrupted"


class AgentSignal(NvrxError):
    """A handled signal arrived while the agent was not supervising ranks (e.g. in rendezvous)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _StopWatch:
    """Runs Rendezvous.wait_stop in a thread and wakes the main loop through a pipe."""

    wake_fd: int
    record: StopRecord | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def build_rank_env(cfg: LaunchConfig, result: RoundResult, local_rank: int,
                   extra: dict[str, str] | None = None, error_file: str = "") -> dict[str, str]:
    """The torchrun environment for one rank of this round (plus e.g. where its monitor listens).

    Every variable torch 2.13's LocalElasticAgent gives a worker, with its values (rank_env.py lists
    them and the few values that differ on purpose; docs/reference/rank-environment.md). ERROR_FILE is the rank's
    ``TORCHELASTIC_ERROR_FILE`` ("" like torchrun with no log directory: ``record`` then only logs).
    OMP_NUM_THREADS is in ``base_env`` already (torchrun's rule, ``config.build_launch_config``).
    """
    w = cfg.workers
    rank = result.rank_offset + local_rank
    env = dict(w.base_env)
    env.update(extra or {})
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(result.world_size),
        LOCAL_WORLD_SIZE=str(w.nproc_per_node),
        GROUP_RANK=str(result.group_rank),
        GROUP_WORLD_SIZE=str(len(result.nodes)),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(result.world_size),
        ROLE_NAME=w.role,
        MASTER_ADDR=result.master_addr,
        MASTER_PORT=str(result.master_port),
        TORCHELASTIC_RESTART_COUNT=str(result.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(cfg.max_restarts),
        TORCHELASTIC_RUN_ID=cfg.rdzv.run_id,
        TORCHELASTIC_USE_AGENT_STORE=str(bool(result.agent_hosts_pg_store)),
        # torchrun passes the agent's value on and defaults it to 1 (NCCL aborts a failed collective)
        TORCH_NCCL_ASYNC_ERROR_HANDLING=w.base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        TORCHELASTIC_ERROR_FILE=error_file,
        # torchrun sets it in its own environment, which its workers inherit: the signals the agent handles
        TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(s.name for s in cfg.signals_to_handle),
        NVRX_RUN_LOG_DIR=str(cfg.run_log_dir),
        NVRX_ROUND=str(result.round),
        NVRX_GRACEFUL_SIGNALS=",".join(s.name for s in cfg.signals_to_handle if s in GRACEFUL_SIGNALS),
    )
    if w.virtual_local_rank:  # torchrun's --virtual-local-rank: the rank's one GPU is its device 0
        env.update(LOCAL_RANK="0", CUDA_VISIBLE_DEVICES=visible_device(w.base_env.get("CUDA_VISIBLE_DEVICES"),
                                                                        local_rank))
    if w.inprocess:  # read by the bootstrap: run the script inside an in-process restart Wrapper
        env.update(NVRX_INPROCESS="1", NVRX_INPROCESS_SPARES=str(w.inprocess_spares))
    if not w.fast_exit:
        env["NVRX_FULL_EXIT"] = "1"
    return env


class Agent:
    """Supervises one node's ranks across rendezvous rounds until the job ends."""

    def __init__(self, cfg: LaunchConfig, events: EventLog,
                 console_out: BinaryIO | None = None, console_err: BinaryIO | None = None) -> None:
        self.cfg = cfg
        self.events = events
        self.workers = WorkerGroup(cfg.workers, events, cfg.run_log_dir, console_out, console_err)
        self.monitors = (RankMonitorGroup(cfg.ft, cfg.workers.nproc_per_node, cfg.run_log_dir, events,
                                          dict(cfg.workers.base_env), cfg.state_dir, cfg.node_name,
                                          term_grace=cfg.workers.term_timeout)
                         if cfg.ft is not None else None)
        self.failures: list[dict[str, Any]] = []  # one entry per fault stop, for the final report
        self.error_files = ErrorFiles(cfg.run_log_dir, cfg.node_name)
        self._round_error_files: dict[int, str] = {}  # local rank -> its TORCHELASTIC_ERROR_FILE this round
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pending_signal: int | None = None
        self._raise_on_signal = False  # only while blocked in rendezvous; elsewhere signals wake the loop
        self._state = RoundState.RUNNING  # of the round being supervised (or the last one)
        self._signal_time = 0.0
        self._old_handlers: dict[int, Any] = {}
        self._rdzv: Rendezvous | None = None
        self._rs: RendezvousStore | None = None
        self._monitor_failure_round: int | None = None  # the round in which a given-up monitor was reported
        self._stragglers: StragglerAggregator | None = None  # straggler detection (with rank monitors only)
        self._rerun_notes: dict[int, str] = {}  # local rank -> where it notes the suspected nodes when exiting 16
        self._hold: tuple[float, RankExit] | None = None  # exited 16 for another node's re-run: (deadline, exit)
        self._peer_hold: tuple[float, dict[str, Any]] | None = None  # a rank's peer is gone: (deadline, its request)
        self._owns_local_session = False  # --local-ckpt-dir: nvrx made ROOT/RUN_ID (its marker): removed on success
        self._end_detail: str | None = None  # why the job ended for this node, when a round says more than a code
        # this node as its ranks name it in a re-run note (nvrx.launcher.rank.rerun: SLURMD_NODENAME, else the host)
        self._node = cfg.workers.base_env.get("SLURMD_NODENAME") or cfg.node_name
        self._contact: Any = None  # StoreContact: the partition watchdog (clients of the store only)
        self._lost_r, self._lost_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # wakes _supervise on store loss
        self._ended = threading.Event()  # run() returned: the store-loss watcher has nothing left to end
        self._t0 = time.monotonic()
        self._wakeup_fds: tuple[int, int] | None = None  # signal.set_wakeup_fd's pipe, read by the rescue thread
        self._old_wakeup_fd = -1
        self._net_env: dict[str, str] | None = None  # GLOO_SOCKET_IFNAME when the host name resolves to loopback

    # ------------------------------------------------------------ entry point

    def run(self) -> int:
        """Run the job; return the agent's exit code. Raises RendezvousError for user-fixable setup errors."""
        t0 = self._t0 = time.monotonic()
        self.workers.prepare()  # the fork server imports torch while we do the same below
        self._install_signal_handlers()
        try:
            return self._run(t0)
        except AgentSignal as sig:
            self.events.emit(AgentSignalEvent(signal=signal.Signals(sig.signum).name, phase="rendezvous"))
            return exit_codes.interrupted(sig.signum)
        except RendezvousError as err:  # e.g. the store's host is gone: the log says so, not only stderr
            if not err.usage:  # a usage error is the CLI's one line; no job ran
                self.events.emit(JobEnd(status="failed", exit_code=exit_codes.FAILED, detail=str(err),
                                        seconds=round(time.monotonic() - t0, 3),
                                        failures=[JobFailure.of(f) for f in self.failures]))
            raise
        finally:
            self._restore_signal_handlers()
            self._shutdown()
            self._ended.set()

    def _run(self, t0: float) -> int:
        from nvrx.launcher.agent.rendezvous import JobFinished, Rendezvous
        from nvrx.launcher.agent.store import StoreContact, open_rendezvous_store

        self.events.emit(AgentStart(pid=os.getpid(), nproc=self.cfg.workers.nproc_per_node,
                                    nnodes=f"{self.cfg.rdzv.min_nodes}:{self.cfg.rdzv.max_nodes}",
                                    max_restarts=self.cfg.max_restarts, run_id=self.cfg.rdzv.run_id))
        if self.cfg.ft is not None:
            from nvrx.monitors.ft_config import describe

            log.info("%s", describe(self.cfg.ft))  # describe() already starts with "fault tolerance:"
            self.events.emit(FtConfig(config=FtConfigInfo.of(self.cfg.ft.to_dict())))
        with self._signals_raise():
            self._rs = open_rendezvous_store(self.cfg.rdzv)
        self._rdzv = Rendezvous(self._rs, self.cfg.rdzv, RestartPolicy(self.cfg.max_restarts), self.events)
        if not self._rs.is_host:  # the host holds the store itself; the others may be cut off from it
            self._contact = StoreContact(self._rs, self.cfg.rdzv.store_timeout, self.cfg.rdzv.keepalive_interval,
                                         self._on_store_lost)
            self._contact.start()
        if self.monitors is not None and self.cfg.ft is not None:
            self._stragglers = StragglerAggregator(self.cfg.ft, self.monitors, self.events, self._rs,
                                                   self.cfg.rdzv.run_id, self.cfg.node_name, self._rdzv.node_id)
        health = NodeHealthChecks(self.cfg.ft or FaultToleranceConfig(), self.cfg.run_log_dir)
        self._claim_local_session()
        while True:
            code = self._health_verdict(health)  # before every round: a bad node sits out instead of failing it
            if code is not None:
                detail = ("shared storage failed its check" if code == exit_codes.STORAGE_FAILED
                          else "node health check failed")
                self.events.emit(JobEnd(status=_end_status(code), exit_code=code, detail=detail,
                                        seconds=round(time.monotonic() - t0, 3),
                                        failures=[JobFailure.of(f) for f in self.failures]))
                return code
            if self._contact is not None:
                self._contact.arm()  # from here until the round's stop record is read
            try:
                with self._signals_raise():
                    result = self._rdzv.next_round()
            except JobFinished as fin:
                self.events.emit(JobEnd(status="already_finished", detail=str(fin)))
                return exit_codes.OK
            code = self._run_round(result)
            if code is not None:
                self.events.emit(JobEnd(status=_end_status(code), exit_code=code, detail=self._end_detail,
                                        seconds=round(time.monotonic() - t0, 3),
                                        failures=[JobFailure.of(f) for f in self.failures]))
                return code

    def _claim_local_session(self) -> None:
        """--local-ckpt-dir: make the job's session (with nvrx's marker) before any rank does, so that success
        removes only a directory nvrx made; a user's existing ROOT/RUN_ID is used but never removed."""
        root = self.cfg.workers.base_env.get(LOCAL_CKPT_DIR_ENV)
        try:
            self._owns_local_session = claim_job_session(root, self.cfg.rdzv.run_id)
        except OSError as exc:  # the ranks will say it too, when they cannot save there
            log.warning("--local-ckpt-dir %s: cannot create the job's session there (%s)", root, exc.strerror or exc)

    def _health_verdict(self, health: NodeHealthChecks) -> int | None:
        """Run the node health checks; None: this node joins the round, else the exit code it leaves with.

        A failed check of the node leaves with exit 16 (resume elsewhere): the other agents go on within
        --nnodes MIN:MAX (a standby takes its place) and `nvrx resume` excludes this node from the next Slurm
        job. A failed check of shared storage only (full, read-only, too slow) is not the node's fault: one line
        naming the path, exit 18, and the event says the node is ok, so no node is ever excluded for it.
        """
        excluded = self._stragglers.excluded() if self._stragglers is not None else None
        if excluded:  # the straggler exclusion policy: a failed check like any other (exit 16, resume avoids it)
            self.events.emit(NodeHealth(ok=False, seconds=0.0, action="sits out", checks=[
                HealthCheckInfo(name="straggler", status="failed", detail=excluded, seconds=0.0)]))
            log.error("node %s leaves the job (exit %d): %s", self.cfg.node_name, exit_codes.RESUME_ELSEWHERE, excluded)
            return exit_codes.RESUME_ELSEWHERE
        report = health.run()
        storage = report.storage_failures() if report.node_ok else []
        action = "joins" if report.ok else "stops: shared storage failed" if storage else "sits out"
        self.events.emit(NodeHealth(ok=report.node_ok, seconds=report.seconds, action=action, checks=[
            HealthCheckInfo(name=r.name, status=r.status, detail=r.detail, seconds=r.seconds) for r in report.results]))
        for r in report.warnings():
            log.warning("node health check %s: %s", r.name, r.detail)
        if storage:
            path = self.cfg.ft.storage_healthcheck_path if self.cfg.ft is not None else None
            log.error("shared storage %s failed its check (%s): the job stops with exit %d; this is not node %s's "
                      "fault and no node is excluded for it", path, storage[0].detail, exit_codes.STORAGE_FAILED,
                      self.cfg.node_name)
            return exit_codes.STORAGE_FAILED
        if not report.ok:
            log.error("node %s failed its health checks (%s): it leaves the job (exit %d); the other nodes go on "
                      "if --nnodes allows", self.cfg.node_name, report.summary(), exit_codes.RESUME_ELSEWHERE)
            return exit_codes.RESUME_ELSEWHERE
        return None

    # ------------------------------------------------------------ one round

    def _run_round(self, result: RoundResult) -> int | None:
        """Start and supervise the ranks of one round. None means: go to the next round."""
        nproc = self.cfg.workers.nproc_per_node
        self._round_error_files = {lr: self.error_files.path_for(result.restart_count, lr) for lr in range(nproc)}
        self._rerun_notes = {lr: os.path.join(os.path.dirname(path), "rerun_exit.json")
                             for lr, path in self._round_error_files.items()}
        for path in self._rerun_notes.values():
            rerun_exit.remove_note(path)
        self._hold = self._peer_hold = None
        if self._net_env is None:
            from nvrx.launcher.agent.store import rank_network_env

            self._net_env = rank_network_env(self._rdzv.info.addr, self.cfg.workers.base_env)
            if self._rs is not None and self._rs.launch:  # with NVRX_ROUND: fences checkpoints (nvrx/ckpt/fence.py)
                self._net_env["NVRX_LAUNCH"] = self._rs.launch
        specs = [RankSpec(lr, result.rank_offset + lr,
                          build_rank_env(self.cfg, result, lr, {**self._net_env, **self._monitor_env(lr),
                                                                rerun_exit.ENV: self._rerun_notes[lr]},
                                         self._round_error_files[lr]))
                 for lr in range(nproc)]
        self._drop_stale_requests()
        # Beat before the ranks start: waiting for the fork server can outlast keepalive_timeout on a loaded node,
        # and its neighbours would report it lost.
        self._rdzv.start_keepalive(result)
        try:
            self.workers.start(specs, attempt=result.restart_count, stop=self._stop_requested)
        except BaseException:
            self._rdzv.stop_keepalive()
            raise
        self._absorbed: list[RankExit] = []  # --inprocess: failed ranks the Wrapper of the others continues without
        self._rank_succeeded = False
        if self.monitors is not None and not self.monitors.started:
            # Once, after the first ranks: monitors outlive rank restarts, and ranks attach to them in
            # the background, so starting them here keeps them off the ranks' start-up critical path.
            self.monitors.start(stop=self._stop_requested)
        watch = self._watch_stop(result.round)
        if self._stragglers is not None:
            self._stragglers.start(result)
        try:
            record = self._supervise(result, watch)
        finally:
            if self._stragglers is not None:
                self._stragglers.stop()
            # cut off from the store, the keepalive thread is blocked in a store request: do not wait for it
            self._rdzv.stop_keepalive(join=not self._store_is_lost())
        if self._contact is not None:
            self._contact.disarm()  # the stop record is read: the store's host may end the job and go away
        return self._conclude(result, record)

    def _watch_stop(self, round_no: int) -> _StopWatch:
        wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
        watch = _StopWatch(wake_fd=wake_r)

        def run() -> None:
            try:
                watch.record = self._rdzv.wait_stop(round_no)
            except BaseException as exc:  # store lost: the main loop reports it
                watch.error = exc
            watch.done.set()
            # The main loop may have seen `done` on another wake-up and closed its end already (EPIPE).
            with contextlib.suppress(OSError):
                os.write(wake_w, b"x")
            os.close(wake_w)

        threading.Thread(target=run, name=f"stop-watch-{round_no}", daemon=True).start()
        return watch

    def _supervise(self, result: RoundResult, watch: _StopWatch) -> StopRecord:
        """Wait for: a local rank failing, the round's stop record, or a signal. Returns the stop record."""
        wake_fd = watch.wake_fd
        self._state = RoundState.RUNNING
        try:
            if self._monitors_failed(result, stopping=False):
                # RUNNING -> FAILED: a monitor given up on while an earlier round was ending fails this one at once
                self._transition(result, RoundState.FAILED)
            while True:
                monitor_fds = self.monitors.fds() if self.monitors is not None else []
                wake_in = self.monitors.wake_in() if self.monitors is not None else None
                for hold in (self._hold, self._peer_hold):  # waiting for another node to end the round: bounded
                    if hold is not None:
                        left = max(0.0, hold[0] - time.monotonic())
                        wake_in = left if wake_in is None else min(wake_in, left)
                exits = self.workers.wait([wake_fd, self._sig_r, self._lost_r, *monitor_fds], timeout=wake_in)
                try:
                    if self._store_is_lost():
                        raise self._store_lost_error()
                    self._step(result, exits)
                    if watch.done.is_set():
                        if watch.error is not None:
                            raise watch.error
                        assert watch.record is not None
                        return watch.record
                except RendezvousError as err:
                    done = self._succeeded_without_store(result, err)
                    if done is None:
                        raise
                    return done
        finally:
            os.close(wake_fd)

    def _succeeded_without_store(self, result: RoundResult, err: RendezvousError) -> StopRecord | None:
        """The store lost after every local rank exited 0 and this node said so: its work is done (the store host
        ended the job before this node read the end; its linger for the others is bounded). Ends this node with 0
        and a warning, as torchrun's agent does when its exit barrier fails. None in any other state."""
        if self._state is not RoundState.SUCCEEDED:
            return None
        log.warning("every rank of this node exited 0, but the job's end could not be read: %s; ending with 0",
                    str(err).splitlines()[0])
        return StopRecord(result.round, StopKind.SUCCEEDED, self._node, StopDetail(describe=str(err).splitlines()[0]),
                          result.restart_count, False)

    def _step(self, result: RoundResult, exits: list[RankExit]) -> None:
        """Act on one wake-up of the supervising loop (rank exits, a signal, a monitor event) and move the state."""
        if self._monitors_failed(result, stopping=self._state is not RoundState.RUNNING):
            # RUNNING -> FAILED: a rank monitor keeps dying (the stop is reported inside _monitors_failed)
            self._transition(result, RoundState.FAILED)
        if self._drain_signal_pipe() and self._state is not RoundState.INTERRUPTED:
            # any -> INTERRUPTED: a handled signal; it wins over the exits it may have caused
            self._transition(result, RoundState.INTERRUPTED)
            self._forward_signal(result)
        if self.monitors is not None:
            for request in self.monitors.workload_requests():
                self._workload_request(result, request)
        failed = [e for e in exits if e.failed]
        if self.cfg.workers.inprocess:
            failed = self._inprocess_failures(exits, failed, result)
        if failed and self._state is not RoundState.INTERRUPTED:
            # RUNNING/FAILED -> FAILED: a local rank failed; the first stop record of the round stands
            self._transition(result, RoundState.FAILED)
            if not self._resume_elsewhere(result, failed):
                self._rdzv.report_stop(result.round, StopKind.FAILED, self._failure_detail(result, failed[0]))
        elif self._hold is not None and time.monotonic() >= self._hold[0]:
            # the suspected node never ended the round: end it as a plain exit 16 (the job ends, resume elsewhere)
            log.warning("no stop record from the suspected node after %.0f s: ending the job with %d",
                        RERUN_HOLD, exit_codes.RESUME_ELSEWHERE)
            ex, self._hold = self._hold[1], None
            self._rdzv.report_stop(result.round, StopKind.FAILED, self._failure_detail(result, ex))
        elif (self._peer_hold is not None and self._state is RoundState.RUNNING
              and time.monotonic() >= self._peer_hold[0]):
            # RUNNING -> FAILED: no node named the rank it lost: a node is gone with its agent
            req, self._peer_hold = self._peer_hold[1], None
            self._transition(result, RoundState.FAILED)
            self._rdzv.report_stop(result.round, StopKind.FAILED, self._peer_failure_detail(result, req))
        elif self._state is RoundState.RUNNING and not self.workers.unreported():
            # RUNNING -> SUCCEEDED: every local rank exited 0; the last node to say so ends the round
            self._transition(result, RoundState.SUCCEEDED)
            self._rdzv.node_succeeded(result.round)

    def _resume_elsewhere(self, result: RoundResult, failed: list[RankExit]) -> bool:
        """Local ranks exited 16 (resume on other hardware): let only the suspected node leave, if the job can
        go on without it. True when handled here; False for the usual stop (the job ends with the code).

        The rank's re-run note names the suspected node(s); without one, this node is the one asking. A node
        that is not suspected does not end the round: the suspected node's agent decides (below), within
        RERUN_HOLD. The suspected node ends the round with ``leaves`` when a standby or the remaining nodes
        keep the job within --nnodes MIN:MAX: it then exits 16 alone (`_conclude`), as a node failing its
        health check does, and the others start the next round in place (not a restart of the budget).
        """
        if any(ex.exitcode != exit_codes.RESUME_ELSEWHERE for ex in failed):
            return False
        ex = failed[0]
        note = rerun_exit.read_note(self._rerun_notes.get(ex.local_rank))
        suspects = sorted(set(note.nodes)) if note is not None else [self._node]
        if self._node not in suspects:
            if self._hold is None:
                log.info("rank %d exited %d to re-run step %s on other hardware than %s: waiting for that node to "
                         "end the round", ex.global_rank, ex.exitcode, note.step if note else "?", ", ".join(suspects))
                self._hold = (time.monotonic() + self.cfg.workers.term_timeout + RERUN_HOLD, ex)
            return True
        detail = self._failure_detail(result, ex)
        why = self._swap_refused(result, len(suspects), same_size=note is not None)
        if why is not None:
            if len(result.nodes) > 1:  # (a one-node job has nobody to go on: nothing to say)
                log.warning("node %s cannot leave the job for a standby (%s): the job ends with %d", self._node,
                            why, exit_codes.RESUME_ELSEWHERE)
        else:
            step = f" to re-run step {note.step} on other hardware" if note is not None else ""
            detail = replace(detail, no_restart=None, leaves=suspects,
                             describe=f"{detail.describe}: node(s) {', '.join(suspects)} leave the job{step}; the "
                                      "other nodes go on in place")
        self._rdzv.report_stop(result.round, StopKind.FAILED, detail)
        return True

    def _swap_refused(self, result: RoundResult, leaving: int, same_size: bool = False) -> str | None:
        """Why LEAVING nodes cannot leave the running job (None: they can): too few nodes would be left, or
        this node hosts the rendezvous store the others need. SAME_SIZE (a re-run of a step): standbys must
        fill every place, since the step is re-run by the same ranks on the same number of nodes."""
        if self._rs is not None and self._rs.is_host:
            return "it hosts the rendezvous store"
        if leaving >= len(result.nodes):
            return "every node of the round is suspected"
        standbys = self._rdzv.standbys(result.round)
        need = len(result.nodes) if same_size else self.cfg.rdzv.min_nodes
        if len(result.nodes) - leaving + standbys < need:
            what = "the re-run needs" if same_size else "--nnodes needs at least"
            return f"{len(result.nodes) - leaving} node(s) and {standbys} standby would be left, {what} {need}"
        return None

    def _drop_stale_requests(self) -> None:
        """Workload control requests that arrived after the previous round ended must not end the new one."""
        for req in self.monitors.workload_requests() if self.monitors is not None else []:
            # a survivor's failed collective after the round ended on the rank's own exit is expected, not news
            (log.debug if req.get("action") == PEER_FAILED else log.warning)(
                "ignoring local rank %s's request to %s: it came after its round ended",
                req.get("local_rank"), req.get("action"))

    def _workload_request(self, result: RoundResult, req: dict[str, Any]) -> None:
        """A rank asked through its monitor to exclude this node or to shut down (spec 001): act at once.

        Like a rank exiting with the steering code, without waiting for it to exit: ExcludeThisNode ends the
        job with exit 16 (``nvrx resume`` avoids this node), ShutdownWorkload with 93 (no restart, no requeue).
        """
        action, lr = req.get("action"), int(req["local_rank"])
        rank = result.rank_offset + lr
        if action == PEER_FAILED:
            if self._state is RoundState.RUNNING and self._peer_hold is None:
                log.info("rank %d (local %d): a collective failed because a peer is gone (%s)", rank, lr,
                         req.get("description"))
                self._peer_hold = (time.monotonic() + PEER_FAILED_GRACE, req)
            return
        steer = {"ExcludeThisNode": exit_codes.RESUME_ELSEWHERE, "ShutdownWorkload": exit_codes.DO_NOT_REQUEUE}.get(
            str(action))
        if steer is None or self._state is not RoundState.RUNNING:
            log.info("rank %d asked to %s (%s): %s", rank, action, req.get("description"),
                     "nothing to do" if steer is None else "the round is already ending")
            return
        what = "exclude node " + self.cfg.node_name if steer == exit_codes.RESUME_ELSEWHERE else "shut the job down"
        describe = f"rank {rank} (local {lr}) asked to {what} through its monitor: {req.get('description')}"
        log.error("%s", describe)
        self._transition(result, RoundState.FAILED)  # RUNNING -> FAILED: the job ends with the rank's steering code
        pid = req.get("pid")
        detail = StopDetail(rank=rank, local_rank=lr, group_rank=result.group_rank,
                            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                            describe=describe, round=result.round, steer=steer, no_restart=True)
        if steer == exit_codes.RESUME_ELSEWHERE and self._swap_refused(result, 1) is None:
            # only this node leaves: a standby or the remaining nodes go on (_conclude)
            detail = replace(detail, no_restart=None, leaves=[self._node])
        self._rdzv.report_stop(result.round, StopKind.FAILED, detail)

    def _transition(self, result: RoundResult, new: RoundState) -> None:
        """Enter NEW; logged (debug) so a round's path through the states can be followed in the agent log."""
        if new is not self._state:
            log.debug("round %d: %s -> %s", result.round, self._state.value, new.value)
        self._state = new

    def _monitors_failed(self, result: RoundResult, stopping: bool) -> bool:
        """Restart dead monitors; True once one keeps dying, after ending the job with that reason.

        A rank whose monitor cannot be kept alive runs unwatched, and a job that then "succeeds" hides it;
        a restart of the job would not help either (monitors outlive rounds), so the job fails for good.
        """
        if self.monitors is None:
            return False
        self.monitors.restart_dead()
        failure = self.monitors.failure
        if failure is None or stopping:  # a round already ending reports this in the next one
            return False
        if self._monitor_failure_round != result.round:  # once per round: another node's stop may win it
            self._monitor_failure_round = result.round
            detail = StopDetail(local_rank=failure["local_rank"], rank=result.rank_offset + failure["local_rank"],
                                group_rank=result.group_rank, round=result.round, describe=failure["describe"],
                                monitor_failed=True, no_restart=True)
            self._rdzv.report_stop(result.round, StopKind.FAILED, detail)
        return True

    def _inprocess_failures(self, exits: list[RankExit], failed: list[RankExit],
                            result: RoundResult) -> list[RankExit]:
        """--inprocess (spec "Known issues" 6): a failed rank does not stop the job; the Wrapper in the other
        ranks restarts without it. The node fails only once all its ranks ended and none of them ended well."""
        self._rank_succeeded = self._rank_succeeded or any(not e.failed for e in exits)
        steering = [ex for ex in failed if ex.exitcode in exit_codes.STEERING_CODES]
        if steering:
            return steering  # the rank asks for something a restart in place cannot give
        for ex in failed:
            self._absorbed.append(ex)
            self.events.emit(InprocessRankLost(rank=ex.global_rank, local_rank=ex.local_rank, pid=ex.pid,
                                               exitcode=ex.exitcode, signal=ex.signal, round=result.round))
        if self.workers.unreported() or self._rank_succeeded or not self._absorbed:
            return []
        return self._absorbed[-1:]

    def _monitor_env(self, local_rank: int) -> dict[str, str]:
        return self.monitors.rank_env(local_rank) if self.monitors is not None else {}

    def _failure_detail(self, result: RoundResult, ex: RankExit) -> StopDetail:
        hang = self.monitors.hang_reason(ex.local_rank, ex.pid) if self.monitors is not None else None
        describe = ex.describe()
        error = read_error_file(self._round_error_files.get(ex.local_rank))
        if error is not None:  # the rank's own words first line only: describe is one line
            first = (error.message.strip().splitlines() or [""])[0]
            describe += f": {first[:200]}" if first else ""
        if hang:
            where = f" in section {hang['section']!r}" if hang.get("section") else ""
            describe += (f" by its monitor: {str(hang.get('reason')).replace('_', ' ')}{where} after "
                         f"{float(hang.get('elapsed') or 0):.1f} s (timeout {hang.get('timeout')} s)")
            first = self._stalled_first(ex.local_rank) if hang.get("reason") == "heartbeat_timeout" else None
            if first is not None:
                hang = {**hang, "stalled_first": result.rank_offset + first[0]}
                describe += (f"; rank {result.rank_offset + first[0]} (local {first[0]}) stopped making progress "
                             f"{first[1]:.2f} s earlier")
        steering = ex.exitcode in exit_codes.STEERING_CODES
        # A steering code asks the resume logic for something a restart in place cannot give: end the job with it.
        return StopDetail(rank=ex.global_rank, local_rank=ex.local_rank, group_rank=result.group_rank, pid=ex.pid,
                          exitcode=ex.exitcode, signal=ex.signal, abandoned=ex.abandoned, tail=list(ex.tail),
                          describe=describe, round=result.round, hang=HangInfo.of(hang) if hang else None,
                          error=RankErrorInfo.of(error.to_fields()) if error is not None else None,
                          no_restart=True if steering else None, steer=ex.exitcode if steering else None)

    def _peer_failure_detail(self, result: RoundResult, req: dict[str, Any]) -> StopDetail:
        """The stop of a round in which only a surviving rank's failed collective tells that a peer is gone: who
        is lost is not known yet (the next rendezvous finds out), so no rank is named as lost."""
        lr = int(req["local_rank"])
        rank = result.rank_offset + lr
        pid = req.get("pid")
        describe = (f"rank {rank} (local {lr})'s collective failed because a peer is gone "
                    f"({str(req.get('description'))[:200]}); no node named a lost rank within {PEER_FAILED_GRACE:g} s "
                    "(a node lost with its agent?)")
        return StopDetail(peer_failed=rank, pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                          describe=describe, round=result.round)

    def _stalled_first(self, local_rank: int) -> tuple[int, float] | None:
        """Another local rank whose progress stopped before LOCAL_RANK's (the likelier culprit), and by how much."""
        progress = self.monitors.last_progress() if self.monitors is not None else {}
        mine = progress.get(local_rank)
        if mine is None:
            return None
        earlier = {lr: mine - t for lr, t in progress.items() if lr != local_rank and t < mine}
        if not earlier:
            return None
        lr = max(earlier, key=earlier.get)
        return lr, earlier[lr]

    def _forward_signal(self, result: RoundResult) -> None:
        """First handled signal: pass it to the ranks once and tell the other nodes to stop too."""
        signum = self._pending_signal or signal.SIGTERM
        name = signal.Signals(signum).name
        self.events.emit(AgentSignalEvent(signal=name, phase="running", round=result.round))
        self.workers.signal_all(signum)
        self._rdzv.report_stop(result.round, StopKind.INTERRUPTED, StopDetail(signal=name, signum=int(signum)))

    def _conclude(self, result: RoundResult, record: StopRecord) -> int | None:
        """Act on the round's stop record: finish, give up, or stop ranks for the next round."""
        if record.kind is StopKind.SUCCEEDED:
            self.workers.stop()  # nothing should be left; bounded anyway
            # the job's own local checkpoints (--local-ckpt-dir) will not be restored any more; kept on failure
            if self._owns_local_session:  # only a session nvrx made (its marker), never a user's own directory
                remove_job_session(self.cfg.workers.base_env.get(LOCAL_CKPT_DIR_ENV), self.cfg.rdzv.run_id)
            return exit_codes.OK
        if record.kind is StopKind.INTERRUPTED:
            signum = int(record.detail.signum or signal.SIGTERM)
            if self._state is not RoundState.INTERRUPTED:  # another node was signalled: pass the same signal on, once
                self.workers.signal_all(signum)
            self._let_ranks_finish(self.cfg.workers.term_timeout)
            self.workers.stop(grace=0.0)
            return exit_codes.interrupted(signum)
        self._save_on_failure(result, record)  # --jit-ckpt: the survivors save before they are stopped
        self.workers.stop()
        if record.kind in FAULT_KINDS:
            named = {} if record.detail.rank is not None else {"node": record.by_node}  # who said so
            self.failures.append({**named, **record.detail.to_fields(), "round": record.round, "kind": record.kind})
        if record.give_up:
            steer = record.detail.steer
            return steer if steer in exit_codes.STEERING_CODES else exit_codes.FAILED
        leaves = record.detail.leaves or []
        if record.kind is StopKind.FAILED and self._node in leaves:
            if self._rs is not None and self._rs.is_host:  # the others need its store: it stays (and re-runs here)
                log.warning("node %s is suspected but hosts the rendezvous store: it stays in the job", self._node)
                return None
            self._end_detail = "left the job: its rank exited 16 (resume on other hardware); the others go on"
            log.error("node %s leaves the job (exit %d): %s", self._node, exit_codes.RESUME_ELSEWHERE,
                      record.detail.describe)
            return exit_codes.RESUME_ELSEWHERE
        return None

    def _save_on_failure(self, result: RoundResult, record: StopRecord) -> None:
        """--jit-ckpt: ask this node's surviving ranks, through their monitors, for a just-in-time checkpoint of
        their last completed step (nvrx.ckpt.jit), bounded by --jit-ckpt-timeout; one log line says the outcome, and a
        jit_checkpoint event records it for `nvrx inspect` (which merges the nodes' events into one line per fault)."""
        timeout = self.cfg.jit_ckpt_timeout
        if timeout is None or self.monitors is None or record.kind not in FAULT_KINDS:
            return
        from nvrx.launcher.agent import jit_request

        nproc = self.cfg.workers.nproc_per_node
        lost = jit_request.lost_ranks(record.kind.value, record.detail, nproc)
        asked = [lr for lr in range(nproc) if result.rank_offset + lr not in lost]
        started = time.monotonic()
        request: dict[str, Any] = {"round": result.round, "lost": lost, "world_size": result.world_size}
        out = None
        if record.detail.peer_failed is not None:  # who is lost is unknown: one node's live rank saves for everyone
            alive = set(self.workers.alive())
            asked = [lr for lr in asked if lr in alive]
            out = self._claim_jit_save(result, asked, request)
        if out is None:
            targets = [(lr, *self.monitors.paths(lr)[:1], self.monitors.tokens[lr]) for lr in asked]
            out = jit_request.outcome(jit_request.request_saves(targets, request, timeout))
        waited = time.monotonic() - started
        # a save, or a node that left it to another's rank or had no saver (the user is told), is not an error
        (log.error if out.outcome == "failed" else log.warning)("%s (%.2f s)", out.line, waited)
        self.events.emit(JitCheckpoint(
            round=result.round, fault=record.kind.value, lost=lost, outcome=out.outcome, step=out.step,
            seconds=out.seconds, waited=round(waited, 4), path=out.path, reason=out.reason,
            answers=[JitAnswer(local_rank=lr, rank=result.rank_offset + lr, outcome=what, reason=why)
                     for lr, what, why in out.answers]))

    def _claim_jit_save(self, result: RoundResult, live: list[int], request: dict[str, Any]) -> Any:
        """The round's JIT saver is unknown (no lost rank named): the first node to claim it in the store saves,
        from its lowest live rank (set in REQUEST). The outcome when this node does not save, else None."""
        from nvrx.launcher.agent import jit_request

        if not live:
            return jit_request.skipped("no live local rank to ask")
        try:
            won = self._rdzv.claim(result.round, "jit")
        except RendezvousError as exc:
            return jit_request.skipped(f"cannot claim the save in the rendezvous store: {str(exc).splitlines()[0]}")
        if not won:
            return jit_request.skipped("a rank of another node saves the replicated state")
        request["saver"] = result.rank_offset + min(live)
        return None

    def _let_ranks_finish(self, grace: float) -> None:
        """After a forwarded stop signal, give ranks the grace period to save and exit on their own."""
        deadline = time.monotonic() + grace
        while self.workers.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.workers.wait([], timeout=left)

    # ------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        for sig in self.cfg.signals_to_handle:
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # not in the main thread, or not catchable here
                log.debug("cannot handle %s", sig)
        self._start_signal_rescue()

    def _start_signal_rescue(self) -> None:
        """Python runs signal handlers in the main thread only, between two bytecodes: while that thread waits in
        a store request in C++ (cut off from the store, for up to the connection's timeout) a SIGTERM would wait
        too. The C-level handler writes each signal's number to the wakeup fd at once; a thread reads it there
        and, if the store is not answering, ends the job itself (_rescue_signal)."""
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread (an embedding caller): no rescue
            os.close(r)
            os.close(w)
            return
        self._wakeup_fds = (r, w)
        threading.Thread(target=self._signal_rescue_loop, args=(r,), name="nvrx-signal-rescue", daemon=True).start()

    def _signal_rescue_loop(self, fd: int) -> None:
        import select

        while not self._ended.is_set():
            try:
                readable, _, _ = select.select([fd], [], [], 0.5)
                data = os.read(fd, 64) if readable else b""
            except OSError:
                return
            handled = [b for b in data if b in {int(s) for s in self.cfg.signals_to_handle}]
            if handled:
                self._rescue_signal(handled[-1])

    def _rescue_signal(self, signum: int) -> None:
        """A handled signal arrived. While the store answers, the main thread acts on it (it is never blocked
        long). Cut off from the store, it may be blocked in a request: give it a moment, then forward the signal
        to the ranks from here (unless the main thread already did), let them have --term-timeout, kill the rest
        and end the process with 128+signal."""
        contact = self._contact
        if contact is None:  # the store's host: its store is in this process and always answers
            return
        cut_off = max(1.0, 3 * contact.interval)  # this long without an answer: the store is out of reach
        arrived = time.monotonic()
        while contact.silent_for() < cut_off or time.monotonic() - arrived < STORE_LOST_EXIT_GRACE:
            if self._ended.wait(0.1):
                return
        name = signal.Signals(signum).name
        log.error("%s received while cut off from the rendezvous store (no answer for %.1f s): stopping this "
                  "node's ranks without it", name, contact.silent_for())
        if self._pending_signal is None:  # the main thread never ran its handler
            self.workers.signal_all(signum)
        grace_end = time.monotonic() + self.cfg.workers.term_timeout
        while time.monotonic() < grace_end and not all(_gone(pid) for pid in self.workers.running_pids()):
            if self._ended.wait(0.05):
                return
        self.workers.signal_all(signal.SIGKILL)
        self._end_from_thread(exit_codes.interrupted(signum),
                              f"{name}: this node stopped its ranks while cut off from the rendezvous store")

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self._wakeup_fds is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._old_wakeup_fd)

    @contextlib.contextmanager
    def _signals_raise(self) -> Iterator[None]:
        """While blocked in rendezvous there are no ranks to forward to: a signal ends the agent."""
        if self._pending_signal is not None:
            raise AgentSignal(self._pending_signal)
        self._raise_on_signal = True
        try:
            yield
        finally:
            self._raise_on_signal = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._raise_on_signal:
            self._pending_signal = signum
            raise AgentSignal(signum)
        if self._pending_signal is not None:
            if signum == self._pending_signal and time.monotonic() - self._signal_time < DUPLICATE_SIGNAL_WINDOW:
                return  # the same signal sent to every process of the step (Slurm): not a second request
            # A second signal while stopping: do not wait for the grace period any longer.
            self.workers.signal_all(signal.SIGKILL)
            return
        self._pending_signal = signum
        self._signal_time = time.monotonic()
        try:
            os.write(self._sig_w, b"s")
        except BlockingIOError:
            pass

    def _stop_requested(self) -> bool:
        """A handled signal arrived: starting more ranks or monitors only delays the stop."""
        return self._pending_signal is not None

    def _drain_signal_pipe(self) -> bool:
        got = False
        while True:
            try:
                if not os.read(self._sig_r, 64):
                    break
                got = True
            except BlockingIOError:
                break
        return got

    # ------------------------------------------------------------ losing the rendezvous store (a partition)

    def _store_is_lost(self) -> bool:
        return self._contact is not None and self._contact.lost.is_set()

    def _store_lost_error(self) -> StoreLost:
        rs, timeout = self._rs, self.cfg.rdzv.store_timeout
        where = f"{rs.host}:{rs.port}" if rs is not None else "?"
        return StoreLost(f"cut off from the rendezvous store at {where}: no answer for {timeout:g} s "
                         f"(store_timeout); this node stopped its ranks and leaves the job (exit {exit_codes.FAILED}); "
                         "the other nodes go on without it if --nnodes allows")

    def _on_store_lost(self, silent: float) -> None:
        """The StoreContact watcher thread: nothing answered for store_timeout. Stop this node's ranks at once
        (SIGKILL: they belong to a round the others have left or are leaving; a graceful save now would be a
        second copy of the job writing checkpoints) and wake the main thread, which ends the job with exit 1.

        The main thread may itself be blocked in a store request (reporting a rank's failure, joining a round)
        and never look: after STORE_LOST_EXIT_GRACE this thread ends the process. Its children (fork server,
        monitors, checkpoint writers) die with it (parent-death signal)."""
        log.error("no answer from the rendezvous store for %.1f s (store_timeout %g s): stopping this node's ranks",
                  silent, self.cfg.rdzv.store_timeout)
        self.workers.signal_all(signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.write(self._lost_w, b"x")
        if self._ended.wait(STORE_LOST_EXIT_GRACE + self.cfg.workers.kill_timeout):
            return
        code = exit_codes.interrupted(self._pending_signal) if self._pending_signal is not None else exit_codes.FAILED
        log.error("the agent is blocked in a rendezvous store request; ending it now")
        self._end_from_thread(code, str(self._store_lost_error()))

    def _end_from_thread(self, code: int, detail: str) -> None:
        """End the process from a helper thread while the main thread is blocked in C++: the job's end event,
        one line, then exit. The fork server, monitors and checkpoint writers die with the agent."""
        with contextlib.suppress(Exception):
            self.events.emit(JobEnd(status=_end_status(code), exit_code=code, detail=detail,
                                    seconds=round(time.monotonic() - self._t0, 3),
                                    failures=[JobFailure.of(f) for f in self.failures]))
            self.events.close()
        with contextlib.suppress(Exception):
            os.write(2, f"nvrx: error: {detail}\n".encode())
        os._exit(code)

    # ------------------------------------------------------------ shutdown

    def _close_stores(self, grace: float = STORE_CLOSE_GRACE) -> None:
        """Close the rendezvous and its store connections, but never let that hold up the agent's exit.

        Ranks and monitors are already gone here; what is left are TCPStore objects whose teardown runs in
        C++ and, with the store's host dead, has been seen to block the exit for over a minute (rarely,
        under load). So it runs in a daemon thread with a bound; the CLI leaves with os._exit anyway.
        """
        def close_all() -> None:
            for closer in (self._rdzv, self._rs):
                if closer is not None:
                    try:
                        closer.close()
                    except Exception:
                        log.debug("close failed", exc_info=True)

        closing = threading.Thread(target=close_all, name="store-close", daemon=True)
        closing.start()
        closing.join(grace)
        if closing.is_alive():
            log.warning("closing the rendezvous store connections took over %.0f s; leaving them to process exit",
                        grace)

    def _shutdown(self) -> None:
        """Leave nothing running: ranks, fork server, stores."""
        try:
            self.workers.close()
            if self.monitors is not None:
                self.monitors.close()
            self.error_files.remove()
        finally:
            if self._contact is not None:
                self._contact.close()
            # cut off, the connections cannot be closed politely (nobody answers): leave them to process exit
            self._close_stores(0.0 if self._store_is_lost() else STORE_CLOSE_GRACE)
            for fd in (self._sig_r, self._sig_w, self._lost_r, self._lost_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
