"""`nvrx resume`: decide after each launch whether the run is finished, should go on, or should give up,
and act on it: launch again inside the allocation, or submit the continuation job (sbatch / requeue).

The decision (`decide`, `precheck`) is pure: state + outcome + limits -> new state + Decision. The driver
(`ResumeDriver`) runs attempts as subprocesses, forwards a stop signal to the running launch once, keeps
the state file (nvrx.launcher.resume.state) and writes `resume_*` events to ``<state-dir>/resume.jsonl``.
Nothing here reads os.environ or argv: the CLI builds a ResumeConfig (Slurm facts included).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from nvrx.common import exit_codes
from nvrx.common.process import die_with_parent
from nvrx.common.signals import DEFAULT_SIGNALS, parse_signals

from nvrx.events import (EventLog, ResumeAttemptEnd, ResumeAttemptStart, ResumeDecision, ResumeEnd, ResumeLimits,
                             ResumeReset, ResumeSignal, ResumeStart, ResumeStateRecovered, ResumeSubmit,
                             read_events)
from nvrx.slurm import submit as slurm_submit
from nvrx.launcher.resume.progress import ProgressSource, read_progress
from nvrx.launcher.resume.state import Loaded, ResumeError, ResumeState, StateStore
from nvrx.slurm.nodes import SlurmFacts, find_bad_node, is_job_node
from nvrx.slurm.submit import SlurmSetupError, SubmitError, SubmitSettings

log = logging.getLogger("nvrx.resume")

FINISHED = "finished"
CONTINUE = "continue"
GIVE_UP = "give_up"
_ACTION_EXIT = {FINISHED: exit_codes.RESUME_FINISHED, CONTINUE: exit_codes.RESUME_CONTINUE,
                GIVE_UP: exit_codes.RESUME_GIVE_UP}

# The signals an agent stops gracefully on (its default --signals-to-handle): 128+these means "interrupted".
STOP_SIGNALS = frozenset(parse_signals(DEFAULT_SIGNALS))

# Causes of an attempt's end (recorded in the state and the events).
CLEAN_EXIT = "clean_exit"  # every rank exited 0 but the finished flag is absent
INTERRUPTED = "interrupted"
FAILED = "failed"
RESUME_ELSEWHERE = "resume_elsewhere"
VALIDATION_FAILED = "validation_failed"
DO_NOT_REQUEUE = "do_not_requeue"
USAGE_ERROR = "usage_error"
STORAGE_FAILED = "storage_failed"  # shared storage failed the agents' check: relaunch here, exclude no node
LOST = "lost"  # the driver died while the attempt ran; its exit code is unknown
_FAILURE_CAUSES = frozenset({FAILED, RESUME_ELSEWHERE, VALIDATION_FAILED, USAGE_ERROR, STORAGE_FAILED})
_STOP_CAUSES = {
    VALIDATION_FAILED: f"a rank reported that the result failed validation (exit {exit_codes.VALIDATION_FAILED})",
    DO_NOT_REQUEUE: f"a rank asked not to be requeued (exit {exit_codes.DO_NOT_REQUEUE})",
}
_USAGE_REASON = (f"the launch reported a usage error (exit {exit_codes.USAGE}; its own message says what to fix): "
                 "not launching it again")


# ==================================================================== decision (pure)

@dataclass(frozen=True)
class Limits:
    """Budgets of one run; 0 means no limit."""

    max_attempts: int = 10
    max_failures: int = 3
    max_no_progress: int = 3  # only applies when progress is tracked


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, as seen after it exited."""

    exit_code: int
    finished: bool  # the finished flag file exists
    progress: int | None = None  # newest iteration after the attempt (None: nothing found)
    progress_before: int | None = None  # newest iteration before it (baseline of the first attempt)
    tracked: bool = False  # a progress source is configured
    exclude: str | None = None  # node(s) to avoid if the attempt asks for different hardware
    record: dict[str, Any] = field(default_factory=dict)  # extra fields for the history entry
    rerun: bool = False  # it exited 16 for the re-run state machine: not a restart without progress


@dataclass(frozen=True)
class Decision:
    action: str  # FINISHED / CONTINUE / GIVE_UP
    reason: str
    new_job: bool = False  # continuing needs a new allocation (interrupted, or other hardware)

    @property
    def exit_code(self) -> int:
        return _ACTION_EXIT[self.action]


def classify(exit_code: int) -> str:
    """The cause of an attempt's end from the launch's exit code (see nvrx.common.exit_codes)."""
    if exit_code == exit_codes.OK:
        return CLEAN_EXIT
    if exit_code == exit_codes.USAGE:
        return USAGE_ERROR
    if exit_code == exit_codes.RESUME_ELSEWHERE:
        return RESUME_ELSEWHERE
    if exit_code == exit_codes.VALIDATION_FAILED:
        return VALIDATION_FAILED
    if exit_code == exit_codes.DO_NOT_REQUEUE:
        return DO_NOT_REQUEUE
    if exit_code == exit_codes.STORAGE_FAILED:
        return STORAGE_FAILED
    if exit_codes.interrupted_signal(exit_code) in STOP_SIGNALS:
        return INTERRUPTED
    return FAILED


def _limit_reason(state: ResumeState, limits: Limits, tracked: bool) -> str | None:
    if limits.max_failures and state.failures >= limits.max_failures:
        return f"{state.failures} failed attempts reached --max-failures {limits.max_failures}"
    if tracked and limits.max_no_progress and state.no_progress >= limits.max_no_progress:
        at = "no iteration found" if state.last_progress is None else f"iteration stuck at {state.last_progress}"
        return (f"{state.no_progress} consecutive attempts made no progress ({at}), "
                f"--max-no-progress {limits.max_no_progress}")
    if limits.max_attempts and state.attempts >= limits.max_attempts:
        return f"{state.attempts} attempts reached --max-attempts {limits.max_attempts}"
    return None


def precheck(state: ResumeState, finished: bool, limits: Limits, tracked: bool) -> Decision | None:
    """Before launching: is there anything left to do? None means launch."""
    if finished:
        return Decision(FINISHED, "the finished flag exists: the run is already finished")
    if state.stopped:
        return Decision(GIVE_UP, f"the run was stopped earlier: {state.stopped}; pass --reset to run it again")
    reason = _limit_reason(state, limits, tracked)
    return Decision(GIVE_UP, reason) if reason else None


def decide(state: ResumeState, outcome: Outcome, limits: Limits) -> tuple[ResumeState, Decision]:
    """Record one ended attempt in the state and decide: finished, continue, or give up (with why)."""
    cause = classify(outcome.exit_code)
    state = _count(state, outcome, cause)
    if outcome.finished:
        return replace(state, finished=True), Decision(FINISHED, "the finished flag exists: training is complete")
    if state.stopped:
        return state, Decision(GIVE_UP, f"the run was stopped earlier: {state.stopped}; pass --reset to run it again")
    if cause in _STOP_CAUSES:
        reason = _STOP_CAUSES[cause]
        return replace(state, stopped=reason), Decision(GIVE_UP, reason)
    if cause == USAGE_ERROR:  # counted as a failure, not sticky: the fixed command may run again
        return state, Decision(GIVE_UP, _USAGE_REASON)
    reason = _limit_reason(state, limits, outcome.tracked)
    if reason:
        return state, Decision(GIVE_UP, reason)
    ended = _describe(cause, outcome.exit_code)
    budget = f"attempt {state.attempts}" + (f"/{limits.max_attempts}" if limits.max_attempts else "")
    budget += f", failures {state.failures}" + (f"/{limits.max_failures}" if limits.max_failures else "")
    if cause == RESUME_ELSEWHERE:
        where = f" without {outcome.exclude}" if outcome.exclude else ""
        if outcome.rerun:
            where += f" to re-run step {outcome.record.get('rerun', {}).get('step')} (re-run state machine)"
        return state, Decision(CONTINUE, f"{ended}: resume on other hardware{where} ({budget})", new_job=True)
    return state, Decision(CONTINUE, f"{ended} ({budget})", new_job=cause == INTERRUPTED)


def _count(state: ResumeState, outcome: Outcome, cause: str) -> ResumeState:
    no_progress, last = state.no_progress, state.last_progress
    if outcome.tracked and not outcome.rerun:  # a re-run of one step is not a restart storm
        baseline = last if last is not None else outcome.progress_before
        if outcome.progress is not None and (baseline is None or outcome.progress > baseline):
            no_progress, last = 0, outcome.progress
        else:
            no_progress, last = no_progress + 1, baseline
    excluded = state.excluded_nodes
    if cause == RESUME_ELSEWHERE and outcome.exclude and outcome.exclude not in excluded:
        excluded = (*excluded, outcome.exclude)
    record = {"attempt": state.attempts + 1, "exit_code": outcome.exit_code, "cause": cause,
              "progress": outcome.progress, "finished": outcome.finished, **outcome.record}
    return replace(state, attempts=state.attempts + 1, failures=state.failures + (cause in _FAILURE_CAUSES),
                   no_progress=no_progress, last_progress=last, last_exit_code=outcome.exit_code,
                   last_cause=cause, excluded_nodes=excluded, running=None).with_attempt(record)


def _describe(cause: str, code: int) -> str:
    sig = exit_codes.interrupted_signal(code)
    return {
        CLEAN_EXIT: "the ranks exited 0 but the finished flag is absent",
        INTERRUPTED: f"interrupted by {sig.name if sig else code}",
        FAILED: f"failed (exit {code}" + (f", {sig.name}" if sig else "") + ")",
        RESUME_ELSEWHERE: f"a rank asked to resume on different hardware (exit {exit_codes.RESUME_ELSEWHERE})",
        STORAGE_FAILED: f"shared storage failed its check (exit {exit_codes.STORAGE_FAILED}; not a node's fault, "
                        "no node excluded)",
    }.get(cause, f"ended with exit {code}")


def settle_lost_attempt(state: ResumeState) -> ResumeState:
    """An attempt left 'running' by a driver that was killed counts as an attempt (not a failure)."""
    if not state.running:
        return state
    record = {**state.running, "attempt": state.attempts + 1, "exit_code": None, "cause": LOST}
    return replace(state, attempts=state.attempts + 1, last_exit_code=None, last_cause=LOST,
                   running=None).with_attempt(record)


# ==================================================================== config

STOPPED_BY_USER = "stopped on purpose with nvrx resume --stop"


@dataclass(frozen=True)
class ResumeConfig:
    """Everything `nvrx resume` needs, built once by the CLI."""

    state_dir: Path
    finished_flag: Path
    env: Mapping[str, str]  # environment of the launches and of sbatch/scontrol (PATH included)
    command: tuple[str, ...] = ()  # the launch to run each attempt (empty: record or check mode)
    exit_code: int | None = None  # record mode: the exit code of a launch that already ran
    check_only: bool = False
    reset: bool = False
    stop: bool = False  # stop mode: mark the run stopped by the user, so pending continuations give up
    limits: Limits = Limits()
    progress: ProgressSource = ProgressSource()
    submit: SubmitSettings | None = None
    slurm: SlurmFacts = SlurmFacts()
    cwd: Path | None = None
    launch_log_dir: Path | None = None  # the launches' --log-dir: where to find the node that exited 16


# ==================================================================== signals

def signal_reached_child(sender_comm: str | None, parent_comm: str | None) -> bool:
    """Whether the launch most likely got the signal we got, so forwarding it would be a second one
    (which an agent takes as "stop now, no grace"). Slurm's step daemon signals every process of a step
    at once (time limit, preemption); only a batch shell started by it directly (`exec nvrx resume`)
    gets `--signal=B:...` signals alone."""
    return sender_comm == "slurmstepd" and parent_comm != "slurmstepd"


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _child_setup(parent: int, mask: set[int]) -> Callable[[], None]:
    """Runs in the launch process before exec: own process group (terminal signals reach only the driver,
    which forwards them once), SIGTERM if the driver dies, the driver's original signal mask."""

    def setup() -> None:
        os.setpgid(0, 0)
        die_with_parent(parent, signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return setup


# ==================================================================== the driver

class ResumeDriver:
    """One invocation of `nvrx resume`: load the state, run/record attempts, decide, maybe submit."""

    def __init__(self, cfg: ResumeConfig, runner: slurm_submit.Runner = slurm_submit.run_bounded) -> None:
        self.cfg = cfg
        self.store = StateStore(cfg.state_dir)
        self.runner = runner
        self.events: Any = None
        self._signal: signal.Signals | None = None
        self._script: Path | None = None
        self._orig_mask: set[int] = set()

    def run(self) -> int:
        """The driver's exit code (0 finished, 3 continue, 4 give up). Raises ResumeError / SubmitError."""
        self.store.open(lock=not self.cfg.check_only)
        try:
            self._check_submit_setup()
            try:
                loaded = self.store.load(lambda: _read_snapshots(self.store.events_path))
            except ResumeError as exc:
                if not self.cfg.reset:
                    raise
                loaded = Loaded(ResumeState(), note=f"{exc}; starting from zero (--reset)")
            self.events = EventLog(None if self.cfg.check_only else self.store.events_path, source="resume")
            return self._run(loaded)
        finally:
            if self.events is not None:
                self.events.close()
            self.store.close()

    def _run(self, loaded: Any) -> int:
        cfg = self.cfg
        if loaded.note:
            log.warning("%s", loaded.note)
            self.events.emit(ResumeStateRecovered(source=loaded.source, note=loaded.note,
                                                  corrupt_copy=str(loaded.corrupt_copy) if loaded.corrupt_copy else None))
        state = loaded.state
        if cfg.reset:
            state = replace(ResumeState(created=time.time()), seq=state.seq, jobs=state.jobs,
                            submitted=state.submitted, history=state.history)
            self.events.emit(ResumeReset())
        if cfg.slurm.run_key and cfg.slurm.run_key not in state.jobs:
            state = replace(state, jobs=(*state.jobs, cfg.slurm.run_key))
        state = settle_lost_attempt(state)
        mode = ("check" if cfg.check_only else "stop" if cfg.stop else "record" if cfg.exit_code is not None
                else "loop")
        self.events.emit(ResumeStart(mode=mode, pid=os.getpid(), job_id=cfg.slurm.job_id, node=cfg.slurm.node_name,
                                     state_dir=str(cfg.state_dir), finished_flag=str(cfg.finished_flag),
                                     limits=ResumeLimits.of(vars(cfg.limits)),
                                     submit=cfg.submit.method if cfg.submit else None, command=list(cfg.command)))
        blocked = self._block_signals()
        try:
            state, decision = self._decide(mode, state)
            if decision.action == CONTINUE and cfg.submit is not None and mode != "check":
                state = self._submit(state)
        finally:
            self._unblock_signals(blocked)
        log.info("%s: %s", {FINISHED: "finished", CONTINUE: "continue", GIVE_UP: "giving up"}[decision.action],
                 decision.reason)
        self.events.emit(ResumeEnd(action=decision.action, reason=decision.reason, exit_code=decision.exit_code))
        return decision.exit_code

    def _decide(self, mode: str, state: ResumeState) -> tuple[ResumeState, Decision]:
        cfg = self.cfg
        if mode == "record":
            outcome = _with_rerun(self._outcome(cfg.exit_code or 0, None, {}), state, cfg)
            state, decision = decide(state, outcome, cfg.limits)
            return self._commit(state, decision), decision
        if mode == "stop":
            decision = Decision(GIVE_UP, STOPPED_BY_USER)
            return self._commit(replace(state, stopped=STOPPED_BY_USER), decision), decision
        early = precheck(state, cfg.finished_flag.exists(), cfg.limits, cfg.progress.tracked)
        if mode == "check":
            decision = early or Decision(CONTINUE, f"attempts so far {state.attempts}, failures {state.failures}"
                                                  + (" (the last one was lost with its driver)"
                                                     if state.last_cause == LOST else ""))
            self.events.emit(ResumeDecision(action=decision.action, reason=decision.reason, check=True))
            return state, decision
        if early is not None:
            return self._commit(state, early), early
        return self._loop(state)

    # ------------------------------------------------------------ the in-allocation loop

    def _loop(self, state: ResumeState) -> tuple[ResumeState, Decision]:
        cfg = self.cfg
        while True:
            attempt = state.attempts + 1
            self._signal = self._signal or self._pending_stop_signal()
            if self._signal is not None:  # stopped between attempts: do not start another one
                decision = Decision(CONTINUE, f"stopped by {self._signal.name} before attempt {attempt}", new_job=True)
                return self._commit(state, decision), decision
            before = read_progress(cfg.progress) if cfg.progress.tracked else None
            running = {"attempt": attempt, "job_id": cfg.slurm.job_id, "node": cfg.slurm.node_name,
                       "start": round(time.time(), 3)}
            state = self.store.save(replace(state, running=running))
            self.events.emit(ResumeAttemptStart(attempt=attempt, job_id=cfg.slurm.job_id, node=cfg.slurm.node_name,
                                                command=list(cfg.command), progress=before))
            log.info("attempt %d: %s", attempt, _shown(cfg.command))
            t0 = time.monotonic()
            code = self._run_attempt(attempt)
            extra = {"job_id": cfg.slurm.job_id, "node": cfg.slurm.node_name, "start": running["start"],
                     "seconds": round(time.monotonic() - t0, 3)}
            outcome = _with_rerun(self._outcome(code, before, extra), state, cfg)
            state, decision = decide(state, outcome, cfg.limits)
            if self._signal is not None and decision.action == CONTINUE:
                decision = Decision(CONTINUE, f"stopped by {self._signal.name}: {decision.reason}", new_job=True)
            self.events.emit(ResumeAttemptEnd(attempt=attempt, exit_code=code, cause=state.last_cause,
                                              progress=state.history[-1].get("progress"), finished=state.finished,
                                              **extra))
            state = self._commit(state, decision)
            if decision.action != CONTINUE or decision.new_job:
                return state, decision
            log.info("relaunching: %s", decision.reason)

    def _outcome(self, code: int, before: int | None, extra: dict[str, Any]) -> Outcome:
        cfg = self.cfg
        submit = cfg.submit
        return Outcome(exit_code=code, finished=cfg.finished_flag.exists(),
                       progress=read_progress(cfg.progress) if cfg.progress.tracked else None,
                       progress_before=before, tracked=cfg.progress.tracked,
                       exclude=self._exclude(code, submit.exclude_scope if submit else "node", extra.get("start")),
                       record=extra)

    def _exclude(self, code: int, scope: str, since: float | None) -> str | None:
        """After exit 16: the node to avoid (the one whose rank exited 16), or the job's nodes (scope job)."""
        cfg = self.cfg
        if code != exit_codes.RESUME_ELSEWHERE:
            return None
        bad = find_bad_node(cfg.launch_log_dir, cfg.slurm.job_id, since) if scope == "node" else None
        if bad and not is_job_node(bad, cfg.slurm.nodelist):
            # e.g. a launch outside Slurm's topology (--standalone) names its log after the host name
            log.warning("exit %d came from a rank on %s, which is not a node of this job (%s); not using it",
                        code, bad, cfg.slurm.nodelist)
            bad = None
        target = cfg.slurm.exclude_target(scope, bad)
        if bad:
            log.info("exit %d came from a rank on node %s (agent log under %s)", code, bad, cfg.launch_log_dir)
        elif target is None and scope == "node" and cfg.slurm.job_id:
            log.warning("exit %d: no agent log under %s names the node whose rank asked for other hardware; "
                        "excluding no node (pass --launch-log-dir, or --exclude-scope job to avoid all of this "
                        "job's nodes)", code, cfg.launch_log_dir)
        return target

    def _commit(self, state: ResumeState, decision: Decision) -> ResumeState:
        state = self.store.save(state)
        self.events.emit(ResumeDecision(action=decision.action, reason=decision.reason, new_job=decision.new_job,
                                        attempts=state.attempts, failures=state.failures,
                                        no_progress=state.no_progress, last_progress=state.last_progress,
                                        last_cause=state.last_cause, excluded_nodes=list(state.excluded_nodes),
                                        state=state.counts()))
        return state

    def _run_attempt(self, attempt: int) -> int:
        """Run the launch once; forward the first stop signal we get to it. Returns its exit code
        (a launch killed by signal N is reported as 128+N, as a shell would)."""
        cfg = self.cfg
        env = dict(cfg.env)
        env["NVRX_RESUME_ATTEMPT"] = str(attempt)
        waitset = {*STOP_SIGNALS, signal.SIGCHLD}
        try:
            child = subprocess.Popen(list(cfg.command), env=env, cwd=cfg.cwd, stdin=subprocess.DEVNULL,
                                     preexec_fn=_child_setup(os.getpid(), self._orig_mask))
        except OSError as exc:
            raise ResumeError(f"cannot run {cfg.command[0]}: {exc.strerror}") from None
        forwarded = False
        while True:
            info = signal.sigtimedwait(waitset, 1.0)
            code = child.poll()
            if code is not None:
                return code if code >= 0 else exit_codes.interrupted(-code)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            sig = signal.Signals(info.si_signo)
            if self._signal is None:
                self._signal = sig
            reached = signal_reached_child(_comm(info.si_pid), _comm(os.getppid()))
            forward = not forwarded and not reached
            if forward:
                forwarded = True
                try:
                    child.send_signal(sig)
                except ProcessLookupError:
                    pass
            log.info("got %s: %s", sig.name, "passed it to the launch" if forward else
                     "the launch got it too" if reached else "already passed one on")
            self.events.emit(ResumeSignal(signal=sig.name, forwarded=forward, sender_pid=info.si_pid, attempt=attempt))

    # ------------------------------------------------------------ signals

    def _block_signals(self) -> set[int]:
        """Stop signals and SIGCHLD are taken synchronously (sigtimedwait): no handler can interrupt a
        state write or a submission half-way; the launch gets the original mask back."""
        self._orig_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {*STOP_SIGNALS, signal.SIGCHLD})
        return self._orig_mask

    def _pending_stop_signal(self) -> signal.Signals | None:
        info = signal.sigtimedwait(STOP_SIGNALS, 0)
        return signal.Signals(info.si_signo) if info is not None else None

    def _unblock_signals(self, mask: set[int]) -> None:
        while signal.sigtimedwait({*STOP_SIGNALS, signal.SIGCHLD}, 0) is not None:
            pass  # consumed: the decision already accounts for them
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    # ------------------------------------------------------------ across jobs

    def _check_submit_setup(self) -> None:
        """Before anything runs: the tool, the job id and the script a continuation needs."""
        sub, slurm = self.cfg.submit, self.cfg.slurm
        if sub is None:
            return
        try:
            slurm_submit.find_tool(sub.tool, self.cfg.env, sub.flag)
            if not slurm.job_id:
                raise SlurmSetupError(f"{sub.flag} needs the Slurm job id: run it inside the batch job "
                                      "(SLURM_JOB_ID) or pass --job-id")
            if sub.method == "sbatch" and sub.script is not None and not sub.script.is_file():
                raise SlurmSetupError(f"--sbatch-script {sub.script} does not exist")
            if sub.method == "sbatch":
                self._script = sub.script or slurm_submit.batch_script_of(slurm.job_id, self.cfg.env, sub.timeout,
                                                                         self.runner)
        except SlurmSetupError as exc:
            raise ResumeError(str(exc)) from None

    def _submit(self, state: ResumeState) -> ResumeState:
        """Submit the continuation (once per job execution); record it before and after."""
        sub, slurm = self.cfg.submit, self.cfg.slurm
        assert sub is not None and slurm.job_id
        done = [s for s in state.submitted if s.get("from_job") == slurm.run_key and s.get("ok")]
        if done:
            log.info("a continuation (job %s) was already submitted from this job", done[-1].get("job_id"))
            return state
        env = slurm_submit.submit_env(self.cfg.env)
        cwd = slurm.submit_dir if slurm.submit_dir and slurm.submit_dir.is_dir() else self.cfg.cwd
        excluded = list(state.excluded_nodes)
        try:
            tool = slurm_submit.find_tool(sub.tool, env, sub.flag)
        except SlurmSetupError as exc:
            raise SubmitError(str(exc)) from None
        if sub.method == "sbatch":
            assert self._script is not None
            cmd = slurm_submit.sbatch_command(tool, slurm.job_id, self._script, excluded, sub.sbatch_args)
        else:
            cmd = [tool, "requeue", slurm.job_id]
        entry: dict[str, Any] = {"method": sub.method, "from_job": slurm.run_key, "t": round(time.time(), 3),
                                 "command": cmd, "exclude": excluded, "ok": None}
        # Saved first: a requeue ends this very job, and we may not live to record the result.
        state = self.store.save(replace(state, submitted=(*state.submitted, entry)))
        self.events.emit(_submit_event("submitting", entry))
        try:
            out = slurm_submit.call(cmd, env, sub.timeout, cwd, self.runner)
            job_id = slurm_submit.parse_sbatch_job_id(out) if sub.method == "sbatch" else slurm.job_id
            if sub.method == "requeue" and excluded:
                slurm_submit.exclude_from_pending(tool, slurm.job_id, excluded, env, sub.timeout, self.runner)
        except SubmitError as exc:
            entry = {**entry, "ok": False, "error": str(exc)}
            state = self.store.save(replace(state, submitted=(*state.submitted[:-1], entry)))
            self.events.emit(_submit_event("failed", entry))
            raise
        entry = {**entry, "ok": True, "job_id": job_id}
        state = self.store.save(replace(state, submitted=(*state.submitted[:-1], entry)))
        self.events.emit(_submit_event("submitted", entry, state.counts()))
        if sub.method == "sbatch":
            log.info("submitted the continuation: job %s (%s)", job_id, " ".join(cmd[1:]))
        else:
            log.info("requeued job %s", job_id)
        return state


def _shown(command: Sequence[str]) -> str:
    """The command as the user wrote it (`nvrx launch ...`, not the interpreter path)."""
    if list(command[1:5]) == ["-P", "-m", "nvrx", "launch"]:
        command = ["nvrx", "launch", *command[5:]]
    return " ".join(command)


def _submit_event(status: str, entry: Mapping[str, Any], state: dict[str, Any] | None = None) -> ResumeSubmit:
    """The resume_submit event of a submission ENTRY (as kept in the state; its time is the event's)."""
    return ResumeSubmit(status=status, method=entry["method"], from_job=entry.get("from_job"),
                        command=list(entry["command"]), exclude=list(entry["exclude"]), ok=entry.get("ok"),
                        job_id=entry.get("job_id"), error=entry.get("error"), state=state)


# Written by the ranks' re-run state machine (nvrx.launcher.rank.rerun.report.RESUME_RECORD) into the state dir.
RERUN_RECORD = "rerun.json"
_RERUN_KEYS = ("id", "step", "state", "diagnosis", "exit_code", "suspects")


def _with_rerun(outcome: Outcome, state: ResumeState, cfg: ResumeConfig) -> Outcome:
    """OUTCOME with the re-run state machine's record of this attempt, if it wrote one: kept in the attempt's
    history entry (which step, which node/rank/result was suspected, the diagnosis). An exit 16 the machine
    asked for (re-run the step on other hardware) is not counted as a restart without progress, and the node
    to avoid is the suspected one: every rank exits 16 then, so the agents' logs cannot tell which."""
    rec = _read_rerun_record(cfg.state_dir / RERUN_RECORD)
    if rec is None or any(isinstance(h.get("rerun"), dict) and h["rerun"].get("id") == rec["id"]
                          for h in state.history):
        return outcome  # none, or an earlier attempt's
    if rec.get("attempt") not in (None, state.attempts + 1):
        return outcome
    summary = {k: rec.get(k) for k in _RERUN_KEYS}
    if rec.get("diagnosis"):
        who = ", ".join(f"rank {s.get('rank')} on {s.get('node')}" for s in rec.get("suspects") or []
                        if isinstance(s, dict))
        log.warning("re-run verdict for step %s: %s (%s)", rec.get("step"), rec["diagnosis"], who or "?")
    rerun = rec.get("exit_code") == outcome.exit_code == exit_codes.RESUME_ELSEWHERE
    nodes = sorted({str(s.get("node")) for s in rec.get("suspects") or [] if isinstance(s, dict) and s.get("node")
                    and is_job_node(str(s["node"]), cfg.slurm.nodelist)})
    scope = cfg.submit.exclude_scope if cfg.submit else "node"
    exclude = ",".join(nodes) if rerun and nodes and scope == "node" else outcome.exclude
    return replace(outcome, record={**outcome.record, "rerun": summary}, rerun=rerun, exclude=exclude)


def _read_rerun_record(path: Path) -> dict[str, Any] | None:
    """The record at PATH, or None (absent, or not one: then a warning; it never stops the driver)."""
    try:
        if path.stat().st_size > 1 << 20:
            raise ValueError("larger than 1 MiB")
        rec = json.loads(path.read_text())
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise ValueError("not a re-run record")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    return rec


_SNAPSHOTS = {ResumeDecision.EV: ResumeDecision.F.state, ResumeSubmit.EV: ResumeSubmit.F.state}


def _read_snapshots(path: Path) -> list[dict[str, Any]]:
    """State snapshots from resume.jsonl: the third copy of the counts, used when both files are bad."""
    out: list[dict[str, Any]] = []
    try:
        for item in read_events(path):
            key = _SNAPSHOTS.get(item["ev"]) if isinstance(item, dict) else None
            if key is not None and isinstance(item.get(key), dict):
                out.append(item[key])
    except OSError:
        return []
    return out
