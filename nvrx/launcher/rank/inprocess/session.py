"""One call of a wrapped function: the resources it needs and the restart loop of the spec.

    store; initial barrier; rank assignment; rank filter
    loop: iteration barrier; initialize; health check; run (active) or idle (spare); completion barrier
          on a fault anywhere: abort; finalize; health check; termination barrier; rank assignment; rank filter

Rank bookkeeping: ranks are identified by their *initial* rank in the store. Every barrier decision
lists the members that made it; the iteration barrier's payloads tell every rank the new rank of
every member, so the ranks that left an iteration are known in the numbering rank assignment uses.

The wrapped function's process group: the active rank 0 hosts a fresh TCPStore for every iteration
and the Wrapper points ``MASTER_ADDR``/``MASTER_PORT`` at it (with ``TORCHELASTIC_USE_AGENT_STORE=True``,
so every rank is a client), and sets ``RANK``/``WORLD_SIZE`` to the active rank and world size. A plain
``init_process_group()`` therefore works on every iteration without stale keys from the last one.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable

from nvrx.launcher.rank.inprocess import gloo_unblock, pg_graveyard
from nvrx.launcher.rank.inprocess.abort import forget_partial_init
from nvrx.launcher.rank.inprocess.barrier import StoreBarrier, empty_decision
from nvrx.launcher.rank.inprocess.call_wrapper import CallWrapper, set_current
from nvrx.launcher.rank.inprocess.exceptions import (ConfigurationError, HealthCheckError, InprocessError, RankTerminated,
                                                RestartInterrupt, StoreUnavailable, swallow_location)
from nvrx.launcher.rank.inprocess.interruption import InterruptGate
from nvrx.launcher.rank.inprocess.log_setup import set_context
from nvrx.launcher.rank.inprocess.monitor_process import READY_TIMEOUT as MONITOR_READY_TIMEOUT
from nvrx.launcher.rank.inprocess.monitor_process import InprocessMonitorProcess
from nvrx.launcher.rank.inprocess.monitor_thread import InprocessMonitorThread
from nvrx.launcher.rank.inprocess.progress import ProgressRecorder
from nvrx.launcher.rank.inprocess.rank_assignment import RankAssignmentCtx, RankDiscarded
from nvrx.launcher.rank.inprocess.settings import RestartSettings
from nvrx.launcher.rank.inprocess.state import Mode, State, as_state
from nvrx.launcher.rank.inprocess.store import PREFIX, StoreMixin, TCPStore, first_line, unreachable_class
from nvrx.common.errors import NvrxError
from nvrx.common.files import atomic_write

log = logging.getLogger(__name__)

_sessions = itertools.count()
_active = threading.local()
ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
LINGER_TIMEOUT = 30.0  # how long a store-hosting rank waits for the others to read the final decision
GRAVEYARD_WAIT = 0.5  # at an iteration start, how long to wait for gloo workers to go idle before freeing old groups


def _previous_session(session: str) -> str | None:
    """The name of the previous top-level call's session (sessions are numbered per process), if any."""
    return str(int(session) - 1) if session.isdigit() and int(session) > 0 else None


def active_session() -> "RestartSession | None":
    """The RestartSession of a Wrapper call running in this thread, if any (a nested Wrapper defers to it)."""
    return getattr(_active, "session", None)


class _Restart(NvrxError):
    """Internal: the iteration ended without completing; carries why."""


class RestartSession:
    """One call of a wrapped function with its restart loop: runs FN under SETTINGS; ``run()`` returns FN's
    result on active ranks (None on spares).

    YIELDS_TO_SCRIPT_WRAPPER (nvrx launch --inprocess): a Wrapper the script applies itself runs its own
    session inside this one (see ``defer``) instead of only calling its function.
    """

    def __init__(self, settings: RestartSettings, fn: Callable[..., Any], call_wrapper_param: str | None,
                 args: tuple[Any, ...], kwargs: dict[str, Any], parent: "RestartSession | None" = None,
                 yields_to_script_wrapper: bool = False) -> None:
        self.settings = settings
        self.yields_to_script_wrapper = yields_to_script_wrapper
        self.parent = parent  # the launcher's session this one runs inside (see defer())
        self.fn = fn
        self.param = call_wrapper_param
        self.args = args
        self.kwargs = kwargs
        self.saved_env = {k: os.environ.get(k) for k in ENV_KEYS}
        self.rank, self.world_size = _torchrun_rank()
        self.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.session = parent.child_session_name() if parent is not None else str(next(_sessions))
        self.members: frozenset[int] = frozenset(range(self.world_size))
        self.current_rank: dict[int, int] = {r: r for r in range(self.world_size)}  # initial -> current
        self.hostnames: dict[int, str] = {}
        self.host = socket.gethostname()
        self.result: Any = None
        self.store: StoreMixin | None = None
        self.gate: InterruptGate | None = None
        self.recorder: ProgressRecorder | None = None
        self.monitor_process: InprocessMonitorProcess | None = None
        self.monitor_thread: InprocessMonitorThread | None = None
        self.call_wrapper: CallWrapper | None = None
        self.pg_server: Any = None
        self.state = State.initial(self.rank, self.world_size)
        self.timings: dict[str, float] = {}
        self.finished = False
        self.left = False  # recorded as terminated by our own hand
        # An exception that ends this rank rather than the iteration (a failed health check before the run, the
        # end of a script's own Wrapper: see defer()), and the reason the others are given; see _why_rank_ends().
        self.ending: tuple[BaseException, str] | None = None
        self._assignments = 0  # rank assignments run (names their store exchanges)
        self._gathers = 0
        self._children = 0  # script Wrappers run inside the current iteration (names their store sessions)

    # ------------------------------------------------------------ set-up and tear-down

    def run(self) -> Any:
        set_context(initial_rank=self.rank, iteration=0)
        try:
            self._open()
            result = self._loop()
            self._call_completion()
            return result
        except BaseException as exc:
            if self.store is not None and not self.finished:  # let the others go on without waiting for us
                self._leave_job(f"the Wrapper ended on this rank ({type(exc).__name__})")
            self._call_terminate(exc)
            raise
        finally:
            self._close()

    def _call_completion(self) -> None:
        """The ``completion`` component, on a rank whose call succeeded; its exceptions are only logged."""
        if self.settings.completion is None:
            return
        try:
            self.settings.completion(self.state.freeze())
        except Exception:
            log.exception("completion %r failed (the call itself succeeded)", self.settings.completion)

    def _call_terminate(self, exc: BaseException) -> None:
        """The ``terminate`` component, on a rank the Wrapper ends with EXC; its own exception is chained to EXC."""
        if self.settings.terminate is None:
            return
        try:
            self.settings.terminate(self.state.freeze())
        except BaseException as failed:
            raise failed from exc

    def _open(self) -> None:
        settings = self.settings
        self.gate = InterruptGate()
        self.gate.install()
        self.recorder = ProgressRecorder(settings.progress_watchdog_interval)
        # A fresh interpreter (see monitor_process): it starts while this rank opens its store.
        logfile = _logfile(settings.monitor_process_logfile, self.rank)
        self.monitor_process = InprocessMonitorProcess(logfile).start()
        self._write_pidfile()
        self.store = self._make_store()
        self.monitor_process.configure(self._monitor_config())
        self.recorder.start()
        try:
            client = self.store.new_client()
        except Exception:
            client = self.store
        self.monitor_thread = InprocessMonitorThread(
            client, self.gate, self.recorder, self._abort_from_monitor, rank=self.rank,
            interval=settings.monitor_thread_interval, last_call_wait=settings.last_call_wait,
            soft_timeout=settings.soft_timeout, rendezvous_timeout=settings.barrier_timeout,
            on_rendezvous=self._note_rendezvous).start()
        self.call_wrapper = CallWrapper(self.gate, self.recorder)
        self.call_wrapper.state = self.state
        self._make_current()
        self._wait_for_monitor_process()

    def _wait_for_monitor_process(self) -> None:
        """Before the initial barrier: from then on the other ranks watch this rank's heartbeats, which its
        monitor process writes."""
        assert self.monitor_process is not None
        try:
            self.monitor_process.wait_ready(MONITOR_READY_TIMEOUT)
        except RuntimeError as exc:  # MonitorNotReady included
            raise InprocessError(str(exc)) from None

    def _note_rendezvous(self) -> None:
        """(monitor thread) The main thread waits in init_process_group: the monitor process holds off the hard
        timeout while these notes come."""
        process = self.monitor_process
        if process is not None:
            process.send({"cmd": "rendezvous"})

    def _make_store(self) -> StoreMixin:
        settings = self.settings
        kwargs = dict(settings.store_kwargs)
        if self.parent is not None and self.parent.store is not None and _default_store(settings):
            # A script's Wrapper under nvrx launch: the default store would connect to MASTER_ADDR, which now
            # names the launcher Wrapper's per-iteration store on rank 0; share the launcher's store (the
            # agent's) instead, under this session's own keys, so losing rank 0 does not lose it.
            with self.parent.store.errors_as_unavailable():
                store = self.parent.store.new_client()
            store.use_session(self.session)
            return store
        try:
            store = settings.store_factory(**kwargs)
        except ConfigurationError:
            raise
        except Exception as exc:
            raise StoreUnavailable(f"could not open the in-process restart store ({first_line(exc)})") from None
        if not isinstance(store, StoreMixin):
            raise ConfigurationError(f"store_factory returned {type(store).__name__}, which does not subclass "
                                     "nvrx.launcher.rank.inprocess.store.StoreMixin")
        if unreachable_class(type(store)):
            raise ConfigurationError(f"store_factory: {unreachable_class(type(store))}")
        if "_factory_kwargs" not in vars(store):
            store._factory_kwargs = kwargs
        store.use_session(self.session)
        return self._past_the_previous_server(store, kwargs)

    def _past_the_previous_server(self, store: StoreMixin, kwargs: dict[str, Any]) -> StoreMixin:
        """A connection to this call's store, not to the previous call's.

        A store hosted by a rank listens on the same port in consecutive calls of the wrapped function, and
        its host closes the previous call's server only after every rank has left that call: a rank starting
        the next call at once may reach the closing server. That one still holds the previous call's keys (a
        new server is empty), so connect again until the new one answers.
        """
        previous = _previous_session(self.session)
        if previous is None or getattr(store, "_hosting", False) or not getattr(store, "rank_hosted", False):
            return store
        stale_key = f"{PREFIX}/{previous}/left"
        deadline = time.monotonic() + LINGER_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if not store.check([stale_key]):  # type: ignore[attr-defined]
                    return store
            except Exception:
                log.debug("the previous call's store closed while checking it", exc_info=True)
            time.sleep(0.02)
            try:
                store = self.settings.store_factory(**kwargs)
            except Exception as exc:
                raise StoreUnavailable(f"could not open the in-process restart store ({first_line(exc)})") from None
            store.use_session(self.session)
        raise StoreUnavailable(f"the in-process restart store at {store.describe()} still serves the previous call "
                               f"after {LINGER_TIMEOUT:g} s; its host (rank 0) did not start this call's store")

    def _monitor_config(self) -> dict[str, Any]:
        settings = self.settings
        assert self.store is not None and self.recorder is not None
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "store": self.store.client_spec(),
                "slot": str(self.recorder.path), "interval": settings.monitor_process_interval,
                "heartbeat_interval": settings.heartbeat_interval,
                "heartbeat_timeout": settings.heartbeat_timeout, "hard_timeout": settings.hard_timeout,
                "termination_grace_time": settings.termination_grace_time}

    def _make_current(self) -> None:
        set_current(self.call_wrapper)
        _active.session = self

    def _close(self) -> None:
        _active.session = None
        set_current(None)
        for step in (self._stop_monitor_thread, self._stop_monitor_process, self._remove_pidfile, self._stop_pg_server,
                     self._linger_if_hosting, self._close_recorder, self._release):
            try:
                step()
            except Exception:
                log.debug("clean-up step %s failed", step.__name__, exc_info=True)
        if self.gate is not None:
            self.gate.uninstall()
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def _release(self) -> None:
        """Drop every resource this call owns, so that each is freed when the call returns.

        torch's TCPStore has no close(): its server stops (and its port is free for the next call of the
        wrapped function) only when the last reference goes. References held here, by the monitor thread or
        by the CallWrapper would otherwise wait for the garbage collector.
        """
        self.store = None
        self.monitor_thread = None
        self.monitor_process = None
        self.recorder = None
        if self.call_wrapper is not None:
            self.call_wrapper.release()
        self.call_wrapper = None
        self.pg_server = None

    def _pidfile(self) -> Path | None:
        template = self.settings.monitor_process_pidfile
        return Path(template.format(rank=self.rank)) if template else None

    def _write_pidfile(self) -> None:
        """``monitor_process_pidfile``: the monitor process's pid, written atomically, removed at the end."""
        path = self._pidfile()
        if path is None or self.monitor_process is None:
            return
        # a reader never sees a half-written pid; not fsynced (it names a live process: no use after a crash)
        atomic_write(path, f"{self.monitor_process.pid}\n".encode(), mode=0o644, durable=False)

    def _remove_pidfile(self) -> None:
        path = self._pidfile()
        if path is not None:
            path.unlink(missing_ok=True)

    def _stop_monitor_thread(self) -> None:
        if self.monitor_thread is not None:
            self.monitor_thread.stop()

    def _stop_monitor_process(self) -> None:
        if self.monitor_process is not None:
            self.monitor_process.stop()

    def _close_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.close()

    def _linger_if_hosting(self) -> None:
        """A rank hosting the store outlives the others' use of it.

        After a success it waits (bounded) until the others have read the final decision. A host that leaves
        the job while the others go on (excluded by the rank assignment, a failed health check) serves the
        store until every other rank has finished or been recorded as terminated: without it they could not
        continue.
        """
        store = self.store
        if store is None or not getattr(store, "_hosting", False):
            return
        if self.finished:
            deadline = time.monotonic() + LINGER_TIMEOUT
            while store.counter("left") < len(self.members) and time.monotonic() < deadline:
                time.sleep(0.005)
        elif self.left:
            log.info("rank %s left the job but hosts the store: serving it until the other ranks end", self.rank)
            while store.counter("left") + len(store.terminated()) < self.world_size:
                time.sleep(0.05)

    # ------------------------------------------------------------ the loop

    def _loop(self) -> Any:
        settings = self.settings
        decision = self._barrier("initial", self.members, {"host": self.host}, settings.barrier_timeout)
        assert self.monitor_process is not None
        self.monitor_process.send({"cmd": "watch"})
        self._require_member(decision, "the initial barrier")
        self.hostnames = {r: p["host"] for r, p in decision["payloads"]}
        gone = self.members - frozenset(decision["members"])
        self.members = frozenset(decision["members"])
        if gone:
            log.warning("ranks %s did not arrive; starting without them", sorted(gone))
        self._assign(frozenset(gone))
        iteration = 0
        fn_exception: BaseException | None = None
        while True:
            self.state = self.state.replace(iteration=iteration, fn_exception=fn_exception)
            set_context(iteration=iteration)
            try:
                fault_base = self._start_iteration(iteration)
                result = self._run_iteration(iteration, fault_base)
            except _Restart as why:
                fn_exception = why.__cause__ if isinstance(why.__cause__, BaseException) else None
                if fn_exception is not None:
                    why.__cause__ = None
                self.state = self.state.replace(fn_exception=fn_exception)  # finalize/health check see it
                self._restart(iteration, str(why))
                iteration += 1
                continue
            self._finish()
            return result

    def _start_iteration(self, iteration: int) -> int:
        """Iteration barrier; set the environment; returns the fault count this iteration starts from."""
        settings = self.settings
        t0 = time.monotonic()
        state = self.state
        assert self.store is not None
        if state.active_rank == 0:
            self._host_pg_store(iteration)
        payload = {"rank": state.rank, "world_size": state.world_size, "active": state.active_rank,
                   "active_world_size": state.active_world_size, "host": self.host}
        decision = self._barrier(f"iteration/{iteration}", self.members, payload, settings.barrier_timeout)
        self._require_member(decision, f"iteration barrier {iteration}")
        payloads = {r: p for r, p in decision["payloads"]}
        self.members = frozenset(decision["members"])
        self.current_rank = {r: p["rank"] for r, p in payloads.items()}
        self.hostnames = {p["rank"]: p["host"] for p in payloads.values()}
        sizes = {(p["world_size"], p["active_world_size"]) for p in payloads.values()}
        if len(sizes) != 1:
            raise ConfigurationError(f"ranks disagree on the world size after rank assignment ({sorted(sizes)}); "
                                     "rank_assignment and rank_filter must give the same result on every rank")
        self.timings["iteration_barrier"] = time.monotonic() - t0
        missing = set(range(state.world_size)) - set(self.current_rank.values())
        if missing:
            raise _Restart(f"rank(s) {sorted(missing)} were lost before iteration {iteration} started")
        if state.active:
            self._point_env_at_pg_store(iteration)
        pg_graveyard.release_if_idle(wait=GRAVEYARD_WAIT)
        forget_partial_init()  # whatever the abort component was: every rank names its next group alike
        gloo_unblock.mark_iteration_start()
        return int(decision["fault_base"])

    def _run_iteration(self, iteration: int, fault_base: int) -> Any:
        """Initialize, health check, run or idle, completion barrier; _Restart unless all ranks completed."""
        self._children = 0
        gate, recorder, monitor = self.gate, self.recorder, self.monitor_thread
        assert gate is not None and recorder is not None and monitor is not None and self.call_wrapper is not None
        self.call_wrapper.state = self.state
        self.call_wrapper.restart_timings = dict(self.timings)
        before = RestartInterrupt.last
        exc: BaseException | None = None
        decision: dict[str, Any] | None = None
        delivered: RestartInterrupt | None = None
        ran = False
        gate.open()
        recorder.start_iteration()
        # An interrupt can land anywhere until the gate is closed, including just after the iteration's own
        # code ended: the loop catches such a late one and closes again (the iteration's code runs once).
        while True:
            try:
                if not ran:
                    ran = True
                    try:
                        monitor.arm(iteration, fault_base)
                        self._initialize_and_check()
                        if self.state.active:
                            self.result = self.fn(*self.args, **self._kwargs())
                        decision = self._completion_barrier(iteration)
                    except BaseException as caught:
                        exc = caught
                    delivered = RestartInterrupt.last if RestartInterrupt.last is not before else None
                raised = gate.close()
                break
            except RestartInterrupt:
                continue
        monitor.disarm()
        recorder.end_iteration()
        try:
            return self._outcome(iteration, exc, decision, raised, delivered)
        finally:  # drop the frames (tensors, process groups) the interrupt's traceback holds
            RestartInterrupt.last = None
            if delivered is not None:
                _clear_frames(delivered)

    def _outcome(self, iteration: int, exc: BaseException | None, decision: dict[str, Any] | None, raised: bool,
                 delivered: RestartInterrupt | None) -> Any:
        """What the end of an iteration means: its result, a _Restart, or the end of the Wrapper.

        DELIVERED is the interrupt that reached the iteration's code, if one did.
        """
        assert self.monitor_thread is not None
        if self.monitor_thread.store_lost:
            raise StoreUnavailable(f"the in-process restart store at {self._store_name()} stopped answering "
                                   f"({self.monitor_thread.store_lost}); the job cannot continue without it")
        if delivered is not None and exc is not delivered and not _caused_by(exc, delivered):
            log.debug("the wrapped function suppressed the restart exception (%s)", swallow_location(delivered))
        if exc is None and decision is not None and _completed(decision):
            return self.result
        ends = self._why_rank_ends(exc) if exc is not None else None
        if ends is not None:
            self._leave_job(ends)
            raise exc
        held = self._decide_incomplete(iteration)
        if _completed(held):
            return self.result  # every rank had finished; the interrupt came too late to matter
        if exc is None:
            why = "completion barrier timed out" if decision and decision.get("timed_out") else "a fault elsewhere"
            if delivered is not None:
                why = "the wrapped function suppressed the restart exception"
            raise _Restart(why)
        local = not raised and not isinstance(exc, RestartInterrupt) and self._record_local_fault(iteration, exc)
        _clear_frames(exc)
        if local:
            raise _Restart(f"{type(exc).__name__} on this rank") from exc
        raise _Restart("a fault elsewhere")

    def _why_rank_ends(self, exc: BaseException) -> str | None:
        """Why EXC ends the Wrapper on this rank (the reason the others are given), or None: it ends the iteration.

        It ends the rank when it comes from an exception recorded in ``self.ending`` (the spec has an
        unhealthy rank re-raise the health check's exception rather than restart; a script's own Wrapper
        that gave up has decided), or when it is no ``Exception`` (``RetriesExhausted``, ``SystemExit``, ...).
        """
        if self.ending is not None and _caused_by(exc, self.ending[0]):
            return f"{self.ending[1]}: {type(exc).__name__}: {str(exc)[:200]}"
        if not isinstance(exc, (Exception, RestartInterrupt)):
            return f"{type(exc).__name__} ended the Wrapper on this rank"
        return None

    def _initialize_and_check(self) -> None:
        settings = self.settings
        if settings.initialize is not None:
            out = settings.initialize(self.state.freeze())
            self.state = as_state(out) if out is not None else self.state
            assert self.call_wrapper is not None
            self.call_wrapper.state = self.state
        if settings.health_check is not None:
            try:
                self._health_check()
            except RestartInterrupt:
                raise  # a fault elsewhere reached us during the check: a restart, not a verdict on this rank
            except BaseException as exc:  # this rank leaves for good; the others restart without it
                log.error("health check failed before iteration %d: %s: %s; this rank leaves the job and does not "
                          "rejoin", self.state.iteration, type(exc).__name__, exc)
                self.ending = (exc, "health check failed")
                raise

    def _kwargs(self) -> dict[str, Any]:
        if self.param is None or self.param in self.kwargs:
            return self.kwargs
        return {**self.kwargs, self.param: self.call_wrapper}

    def _completion_barrier(self, iteration: int) -> dict[str, Any]:
        assert self.store is not None
        barrier = StoreBarrier(self.store, f"completion/{iteration}", self.rank, self.members,
                               self.settings.completion_timeout, leading=self.state.active, mark_absent=False)
        with self.store.errors_as_unavailable():
            decision = barrier.wait()
        if decision.get("timed_out") and self.rank == min(decision.get("members") or [self.rank]):
            absent = decision.get("absent")
            self.store.record_fault(self.rank, iteration, f"completion timeout: ranks {absent} did not finish within "
                                                          f"{self.settings.completion_timeout:g} s of the others")
        return decision

    def _decide_incomplete(self, iteration: int) -> dict[str, Any]:
        assert self.store is not None
        with self.store.errors_as_unavailable():
            return self.store.decide(f"completion/{iteration}", empty_decision(aborted=True))

    def _record_local_fault(self, iteration: int, exc: BaseException) -> bool:
        """Record EXC as this rank's fault; False when EXC looks like the consequence of a fault another rank
        recorded first (a collective broken by the peer's abort). Any other exception is a fault of its own
        and is recorded even when another rank failed first: concurrent faults are all reported."""
        assert self.store is not None and self.monitor_thread is not None
        with self.store.errors_as_unavailable():
            earlier = self._faults_elsewhere(wait=self.settings.last_call_wait) if _looks_secondary(exc) else []
            if earlier:
                log.info("%s (%s) after the fault on rank %s; restarting", type(exc).__name__,
                         (str(exc).splitlines() or [""])[0][:120], earlier[0]["rank"])
                return False
            log.warning("fault in iteration %d: %s: %s", iteration, type(exc).__name__, exc,
                        exc_info=(type(exc), exc, _user_frames(exc.__traceback__)))
            self.store.record_fault(self.rank, iteration, f"{type(exc).__name__}: {str(exc)[:200]}")
        return True

    def _faults_elsewhere(self, wait: float) -> list[dict[str, Any]]:
        """Faults other ranks recorded in this iteration, waiting up to WAIT for the first one."""
        assert self.store is not None and self.monitor_thread is not None
        deadline = time.monotonic() + wait
        while True:
            faults = [f for f in self.store.faults()[self.monitor_thread.fault_base:] if f.get("rank") != self.rank]
            if faults or time.monotonic() >= deadline:
                return faults
            time.sleep(0.005)

    # ------------------------------------------------------------ a script's own Wrapper (nvrx launch --inprocess)

    def child_session_name(self) -> str:
        """Store namespace of the next script Wrapper run in this iteration: the same on every rank that runs
        the script, however many times this session restarted it."""
        self._children += 1
        return f"{self.session}.{self.state.iteration}.{self._children}"

    def defer(self, run_child: Callable[[], Any]) -> Any:
        """Run a script's own Wrapper (RUN_CHILD) with this session's monitoring suspended.

        Under ``nvrx launch --inprocess`` this session runs the whole script; when the script calls a
        function it wrapped itself, that Wrapper's configuration is the user's intent, so it runs a full
        session of its own (its components, timeouts, restarts) while this one stands aside: no fault
        polling, no soft/hard timeout, no interrupt. Faults recorded here meanwhile were the child's to
        handle and are not replayed afterwards. If the child ends with an exception, that ends this rank
        too (``_outcome``): the user's Wrapper decided, and re-running the script would override it.
        """
        gate, monitor, recorder, store = self.gate, self.monitor_thread, self.recorder, self.store
        assert gate is not None and monitor is not None and recorder is not None and store is not None
        _log_deferral_once(self)
        monitor.disarm()
        if gate.close():  # a restart of the script was already under way: let it happen first
            raise RestartInterrupt("a fault was recorded before the script's Wrapper started; restarting")
        recorder.end_iteration()
        try:
            result = run_child()
        except BaseException as exc:  # retries exhausted, rank removed, unhealthy: the user's Wrapper decided
            self.ending = (exc, "the script's Wrapper ended")
            raise
        finally:
            self._make_current()
            set_context(initial_rank=self.rank, iteration=self.state.iteration)
        with store.errors_as_unavailable():
            fault_base = store.fault_count()
        recorder.start_iteration()
        gate.open()
        monitor.arm(self.state.iteration, fault_base)
        return result

    # ------------------------------------------------------------ the restart path

    def _restart(self, iteration: int, why: str) -> None:
        settings = self.settings
        assert self.gate is not None and self.store is not None
        t0 = time.monotonic()
        began = time.time()
        log.info("restarting after iteration %d: %s", iteration, why)
        try:
            self.gate.abort_once(lambda: self._abort(self.state))
        except Exception:
            log.exception("abort failed; continuing the restart")
        self._stop_pg_server()
        t1 = time.monotonic()
        step = "finalize"
        try:
            if settings.finalize is not None:
                out = settings.finalize(self.state.freeze())
                self.state = as_state(out) if out is not None else self.state
            step = "health check"
            self._health_check()
        except BaseException as exc:
            self._leave_job(f"{step} failed: {type(exc).__name__}: {exc}")
            raise
        t2 = time.monotonic()
        decision = self._barrier(f"termination/{iteration}", self.members, None, settings.barrier_timeout)
        self._require_member(decision, f"termination barrier {iteration}")
        t3 = time.monotonic()
        kept = frozenset(decision["members"])
        if self.members - kept:
            reasons = self.store.termination_reasons()
            log.info("continuing without rank(s) %s", "; ".join(
                f"{r} ({reasons.get(r, 'did not arrive')})" for r in sorted(self.members - kept)))
        gone = frozenset(self.current_rank[r] for r in self.members - kept if r in self.current_rank)
        gone |= frozenset(range(self.state.world_size)) - frozenset(self.current_rank.values())
        self.members = kept
        self._assign(gone)
        self.timings = {"began": began, "abort": t1 - t0, "finalize_health_check": t2 - t1,
                        "termination_barrier": t3 - t2, "rank_assignment": time.monotonic() - t3}

    def _health_check(self) -> None:
        """The health check; an ``Exception`` it raises becomes a ``HealthCheckError`` (its cause), as in NVRx."""
        check = self.settings.health_check
        if check is None:
            return
        try:
            out = check(self.state.freeze())
        except HealthCheckError:
            raise
        except Exception as exc:
            raise HealthCheckError(f"health check {check!r} failed: {type(exc).__name__}: {exc}") from exc
        if out is not None:
            self.state = as_state(out)

    def _abort(self, state: State) -> None:
        """The configured abort, then stop this iteration's process-group store if this rank hosts it.

        Stopping that store is what frees ranks blocked in ``init_process_group``: gloo's rendezvous
        waits in C++ on the store for a rank that will never arrive (one that left, say, after a failed
        health check), where neither the abort nor the restart exception reaches it; with the store
        gone the wait fails at once. The store is replaced at the next iteration anyway.
        """
        try:
            if self.settings.abort is not None:
                self.settings.abort(state.freeze())
        finally:
            self._stop_pg_server()

    def _abort_from_monitor(self) -> None:
        self._abort(self.state)

    def _assign(self, gone: frozenset[int]) -> None:
        """Rank assignment and rank filter; a rank left without a rank leaves the job.

        The assignment sees the state with ``mode=INITIALIZED``: when nothing in it chooses the active ranks
        (``ActivateAllRanks``, ``MaxActiveWorldSize``, ``Tree``, ...; e.g. a bare ``ShiftRanks()``), every rank
        is active, and the deprecated ``rank_filter`` may then choose.
        """
        settings = self.settings
        state = self.state
        self._assignments += 1
        ctx = RankAssignmentCtx(state.replace(mode=Mode.INITIALIZED), self.store, set(gone), dict(self.hostnames),
                                gather=self._gather, initial=self._assignments == 1)
        try:
            out = settings.rank_assignment(ctx)
        except RankDiscarded as exc:
            self._leave_job(f"excluded by rank assignment ({exc})")
            raise
        if not isinstance(out, RankAssignmentCtx):
            raise ConfigurationError(f"rank_assignment returned {type(out).__name__}, not a RankAssignmentCtx")
        if out.terminated_ranks:
            raise ConfigurationError("rank_assignment left gaps in the rank numbering; compose it with ShiftRanks(), "
                                     "e.g. Compose(ShiftRanks(), FilterCountGroupedByKey(...))")
        new = as_state(out.state)
        if new.rank is None:
            self._leave_job("excluded by rank assignment")
            raise RankTerminated(f"rank {self.rank} was excluded by rank assignment ({settings.rank_assignment!r}); "
                                 "it does not rejoin")
        if new.mode is Mode.INITIALIZED:
            new = new.replace(active_rank=new.rank, active_world_size=new.world_size, mode=Mode.ACTIVE)
        if settings.rank_filter is not None:
            new = as_state(settings.rank_filter(new))
        if not 0 <= new.rank < new.world_size or not 0 < new.active_world_size <= new.world_size:
            raise ConfigurationError(f"rank assignment/filter produced rank {new.rank} of {new.world_size} with "
                                     f"{new.active_world_size} active ranks; there must be at least one active rank")
        changed = (new.rank, new.world_size, new.active_rank, new.active_world_size) != (
            state.rank, state.world_size, state.active_rank, state.active_world_size)
        self.state = new
        role = (f"active rank {new.active_rank} of {new.active_world_size}" if new.active
                else f"spare ({new.active_world_size} active)")
        level = logging.INFO if changed or state.iteration == 0 else logging.DEBUG
        log.log(level, "rank %s of %s, %s", new.rank, new.world_size, role)

    def _gather(self, name: str, fn: Callable[[State], Any]) -> dict[int, Any]:
        """For rank assignments: ``fn(state)`` of every live rank, by current rank, through a store barrier."""
        self._gathers += 1
        payload = fn(self.state)
        decision = self._barrier(f"assign/{self._assignments}/{self._gathers}/{name}", self.members, payload,
                                 self.settings.barrier_timeout)
        self._require_member(decision, f"the {name} exchange")
        return {self.current_rank.get(r, r): value for r, value in decision["payloads"]}

    def _leave_job(self, reason: str) -> None:
        """Record (once) that this rank leaves, so the others continue without waiting for it."""
        if self.store is None or self.left:
            return
        self.left = True
        try:
            self.store.mark_terminated([self.rank], reason)
            self.store.record_fault(self.rank, self.state.iteration, reason)
        except Exception:
            log.debug("could not record leaving the job", exc_info=True)

    def _finish(self) -> None:
        assert self.store is not None
        self.finished = True
        with self.store.errors_as_unavailable():
            self.store.mark_done()
            self.store.add(self.store.key("left"), 1)  # type: ignore[attr-defined]

    # ------------------------------------------------------------ barriers and membership

    def _barrier(self, name: str, members: frozenset[int], payload: Any, timeout: float) -> dict[str, Any]:
        assert self.store is not None
        barrier = StoreBarrier(self.store, name, self.rank, members, timeout)
        with self.store.errors_as_unavailable():
            return barrier.wait(payload)

    def _require_member(self, decision: dict[str, Any], where: str) -> None:
        if self.rank in decision["members"]:
            return
        assert self.store is not None
        reason = self.store.termination_reasons().get(self.rank, f"too late for {where}")
        self._leave_job(reason)
        raise RankTerminated(f"rank {self.rank} was removed from the job ({reason}); it does not rejoin")

    def _store_name(self) -> str:
        return self.store.describe() if self.store is not None else "?"

    # ------------------------------------------------------------ the wrapped function's process-group store

    def _host_pg_store(self, iteration: int) -> None:
        from nvrx.common.net import start_store_server

        self._stop_pg_server()
        addr = _address_towards(self.master_addr)
        self.pg_server, port = start_store_server(addr)
        assert self.store is not None
        with self.store.errors_as_unavailable():
            self.store.publish_pg_store(iteration, addr, port)

    def _point_env_at_pg_store(self, iteration: int) -> None:
        assert self.store is not None
        with self.store.errors_as_unavailable():
            where = self.store.pg_store(iteration)
        if where is None:
            raise _Restart(f"active rank 0 did not publish the process-group store of iteration {iteration}")
        host, port = where
        state = self.state
        os.environ.update(RANK=str(state.active_rank), WORLD_SIZE=str(state.active_world_size), MASTER_ADDR=host,
                          MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")

    def _stop_pg_server(self) -> None:
        server, self.pg_server = self.pg_server, None
        if server is not None:
            del server  # the TCPStore server stops when its last reference goes


def _torchrun_rank() -> tuple[int, int]:
    values = {}
    for name in ("RANK", "WORLD_SIZE"):
        raw = os.environ.get(name, "")
        if not raw.strip().isdigit():
            raise ConfigurationError(f"{name}={raw!r}: the in-process Wrapper needs the torchrun environment (RANK, "
                                     "WORLD_SIZE, MASTER_ADDR, MASTER_PORT); run under nvrx launch or torchrun")
        values[name] = int(raw)
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if not 0 <= rank < world:
        raise ConfigurationError(f"RANK={rank} is not below WORLD_SIZE={world}")
    return rank, world


def _logfile(template: str | None, rank: int) -> str | None:
    return template.format(rank=rank) if template else None


def _address_towards(host: str) -> str:
    """This machine's address on the route to HOST (loopback when HOST is local)."""
    try:
        target = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
    except (socket.gaierror, IndexError):
        return "127.0.0.1"
    family, addr = target[0], target[4][0]
    if addr.startswith("127.") or addr == "::1":
        return addr
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((addr, 9))  # UDP connect sends nothing; it only picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


_PEER_LOST = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "connection reset")


def _looks_secondary(exc: BaseException) -> bool:
    """A collective that failed because a peer's connection went away: probably another rank's fault."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(phrase in text for phrase in _PEER_LOST)


def _completed(decision: dict[str, Any]) -> bool:
    return not decision.get("aborted") and not decision.get("timed_out")


def _caused_by(exc: BaseException | None, cause: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 50:
        if exc is cause:
            return True
        exc = exc.__context__
        seen += 1
    return False


_LAUNCHER_DIR = str(Path(__file__).resolve().parents[2]) + os.sep  # nvrx/launcher/


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the first frame that is not the launcher's (Wrapper, bootstrap)."""
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(_LAUNCHER_DIR):
        tb = tb.tb_next
    return tb


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals the traceback holds (tensors, process groups) so they can be freed now."""
    try:
        traceback.clear_frames(exc.__traceback__)
    except Exception:
        pass


def _default_store(settings: RestartSettings) -> bool:
    return settings.store_factory is TCPStore and not settings.store_kwargs


_deferral_logged = threading.Event()


def _log_deferral_once(session: RestartSession) -> None:
    """Say once per process that the script's Wrapper is in charge, and what of the launcher's no longer applies."""
    if _deferral_logged.is_set():
        return
    _deferral_logged.set()
    log.info("the script wraps its entry point in its own Wrapper: that Wrapper's settings apply to it (restarts, "
             "timeouts, components); nvrx launch --inprocess restarts the script only for faults outside it")
    if session.state.active_world_size < session.state.world_size:
        log.warning("--inprocess-spares: the %d spare rank(s) wait in the launcher's Wrapper and are not used by the "
                    "script's own Wrapper; to keep spares, give that Wrapper a rank_filter (e.g. "
                    "MaxActiveWorldSize) and launch without --inprocess-spares",
                    session.state.world_size - session.state.active_world_size)
