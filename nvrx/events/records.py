"""The event records: every event nvrx writes, as a small frozen class (the schema of the JSON lines).

Every event is a small frozen record class below (``RdzvRound``, ``HangDetected``, ...). Writers emit
records (``events.emit(RdzvRound(round=r, ...))``); ``EventLog.emit`` takes nothing else. Readers get
the field names from the same classes (``RdzvRound.F.waited``), and the field-type table the reader
checks every event against (``EVENT_FIELDS``, used by ``field_problem``) is derived from the classes'
annotations, so a field renamed or retyped on one side cannot silently drift from the other.

One file per writer (``agent-<node>.jsonl``, ``monitor-<node>-<local rank>.jsonl``, the resume driver's
``resume.jsonl``). Every line is one JSON object: ``v`` (schema version), ``t`` (unix time), ``src``
(writer), ``ev`` (event name), then the record's fields; fields whose value is None are left out (readers
treat absent and null alike). Lines are written whole, one ``write`` each, so a reader following a live
run never sees a torn line except at a crash, which readers skip. The format is the one schema version 1
always had: logs written before the records existed read the same.
"""

import logging
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping, TypeVar

SCHEMA_VERSION = 1
log = logging.getLogger("nvrx.events")
ENVELOPE = ("v", "t", "src", "ev")

R = TypeVar("R", bound="Record")


# ================================================================ records


class Record:
    """A typed structure of the event schema: an event (``Event``) or an object nested in one.

    ``F`` holds the field names as attributes (``RdzvRound.F.waited == "waited"``): readers look fields
    up through it, so a renamed field fails loudly where it is read instead of reading as absent.
    """

    F: ClassVar[Any]
    _DUMP: ClassVar[tuple[tuple[str, int], ...]]       # (field, 0 plain | 1 record | 2 list of records)
    _OF: ClassVar[tuple[tuple[str, Any], ...]]         # (field, converter from decoded JSON or None)

    def to_fields(self) -> dict[str, Any]:
        """The record as JSON-ready fields (nested records as objects); None values are left out."""
        out: dict[str, Any] = {}
        for name, mode in self._DUMP:
            value = getattr(self, name)
            if value is None:
                continue
            if mode == 1:
                value = value.to_fields()
            elif mode == 2:
                value = [x.to_fields() for x in value]
            out[name] = value
        return out

    @classmethod
    def of(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record from decoded JSON or a plain dict (unknown keys are ignored, missing ones are None).

        For writers that hold a dict built elsewhere (a stop record's detail from the store, a config's
        ``to_dict()``). A key the record lacks is dropped with a warning: it would never reach the log.
        """
        unknown = data.keys() - cls.F.__dict__.keys()
        if unknown:
            log.warning("%s has no field(s) %s: not logged", cls.__name__, ", ".join(sorted(map(str, unknown))))
        kw = {}
        for name, convert in cls._OF:
            value = data.get(name)
            if value is not None and convert is not None:
                value = convert(value)
            kw[name] = value
        return cls(**kw)


class Event(Record):
    """An event record: ``EV`` is its name on the wire, ``SOURCE`` the writer (agent, monitor, resume)."""

    EV: ClassVar[str]
    SOURCE: ClassVar[str]


RECORDS: dict[str, type[Event]] = {}   # event name -> record class, every event of the schema
NESTED: list[type[Record]] = []        # the structures nested in events


def _finish(cls: type) -> type:
    """Make CLS a frozen keyword-only dataclass and give it its field names, dump plan and converters."""
    cls = dataclass(frozen=True, kw_only=True, eq=False)(cls)
    types_ = {f.name: f.type for f in fields(cls)}  # real types: this module does not postpone annotations
    cls.F = types.SimpleNamespace(**{n: n for n in types_})
    cls._DUMP = tuple((n, _dump_mode(tp)) for n, tp in types_.items())
    cls._OF = tuple((n, _converter(tp)) for n, tp in types_.items())
    return cls


def event(name: str, source: str) -> Callable[[type], type]:
    """Class decorator: an event record named NAME on the wire, written by SOURCE."""

    def wrap(cls: type) -> type:
        if name in RECORDS:
            raise TypeError(f"event {name!r} is defined twice")
        cls.EV, cls.SOURCE = name, source
        cls = _finish(cls)
        bad = {f.name for f in fields(cls)} & set(ENVELOPE)
        if bad:
            raise TypeError(f"{cls.__name__}: field names {sorted(bad)} are taken by the line's envelope")
        RECORDS[name] = cls
        return RECORDS[name]

    return wrap


def nested(cls: type) -> type:
    """Class decorator: a typed object nested in events."""
    cls = _finish(cls)
    NESTED.append(cls)
    return cls


def _members(tp: Any) -> list[Any]:
    """The non-None members of a union type (or [tp])."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _record_class(tp: Any) -> type[Record] | None:
    return tp if isinstance(tp, type) and issubclass(tp, Record) else None


def _dump_mode(tp: Any) -> int:
    (inner,) = _members(tp)[:1] or [None]
    if _record_class(inner):
        return 1
    if typing.get_origin(inner) is list and _record_class(typing.get_args(inner)[0]):
        return 2
    return 0


def _converter(tp: Any) -> Callable[[Any], Any] | None:
    (inner,) = _members(tp)[:1] or [None]
    sub = _record_class(inner)
    if sub is not None:
        return lambda v: sub.of(v) if isinstance(v, Mapping) else v
    if typing.get_origin(inner) is list:
        item = _record_class(typing.get_args(inner)[0])
        if item is not None:
            return lambda v: [item.of(x) if isinstance(x, Mapping) else x for x in v]
    return None


# ---------------------------------------------------------------- nested structures


@nested
class TimeoutsInfo(Record):
    """The timeouts a monitor enforces, in seconds (None: not checked): ``nvrx.monitors.timeouts.Timeouts``."""

    initial_heartbeat: float | None = None
    heartbeat: float | None = None
    sections: dict[str, float | None] | None = None
    out_of_section: float | None = None


@nested
class FtConfigInfo(Record):
    """The fault-tolerance settings of a launch: ``FaultToleranceConfig.to_dict()`` (the test checks the keys)."""

    workload_check_interval: float | None = None
    initial_rank_heartbeat_timeout: float | None = None
    rank_heartbeat_timeout: float | None = None
    safety_factor: float | None = None
    rank_termination_signal: str | None = None
    log_level: int | str | None = None       # a name, or a number without a standard name
    rank_section_timeouts: dict[str, float | None] | None = None
    rank_out_of_section_timeout: float | None = None
    # NVRx's further settings (accepted; most are not acted on by nvrx, see nvrx.monitors.ft_config.NOT_ACTIVE)
    node_health_check_interval: float | None = None
    restart_check_interval: float | None = None
    enable_nic_monitor: bool | None = None
    enable_nic_healthcheck: bool | None = None
    enable_dist_storage_healthcheck: bool | None = None
    storage_healthcheck_path: str | None = None
    pci_topo_file: str | None = None
    link_down_path_template: str | None = None
    link_state_path_template: str | None = None
    skip_section_response: bool | None = None
    segment: int | None = None
    numa_bind_strict: bool | None = None
    gpu_memory_reclaim_timeout: float | None = None
    gpu_memory_tolerance_mb: float | None = None
    gpu_memory_poll_interval: float | None = None
    check_remaining_processes: bool | None = None
    max_no_progress_cycles: int | None = None
    min_progress_iterations: int | None = None
    checkpoint_iteration_file: str | None = None
    install_exception_hook: bool | None = None
    num_warmup_iterations: int | None = None
    attribution_endpoint: str | None = None
    attribution_stop_action: str | None = None
    attribution_export_url: str | None = None
    cycle_info_dir: str | None = None
    segment_health_check_dir: str | None = None
    node_health_check_hook: str | None = None
    node_health_check_timeout: float | None = None
    node_health_min_free_memory_mb: float | None = None
    node_health_min_free_disk_mb: float | None = None
    auto_heartbeat: bool | None = None
    straggler_report_interval: float | None = None
    straggler_threshold: float | None = None
    straggler_sustain_reports: int | None = None
    straggler_exclude_after_reports: int | None = None
    heartbeat_timeout_auto: str | None = None
    heartbeat_timeout_auto_multiple: float | None = None
    heartbeat_timeout_auto_min: float | None = None
    heartbeat_timeout_auto_percentile: float | None = None
    heartbeat_timeout_auto_warmup_beats: int | None = None
    heartbeat_timeout_auto_warmup_seconds: float | None = None
    heartbeat_timeout_auto_settle_seconds: float | None = None


@_finish
class _Hang(Record):
    """What a monitor found when it declared its rank hung (shared by the event and the stop detail)."""

    rank: int | None = None              # the monitor's (local) rank
    global_rank: int | None = None
    pid: int | None = None
    generation: int | None = None
    reason: str | None = None            # section_timeout | heartbeat_timeout | auto_heartbeat_timeout | no_first_heartbeat | out_of_section_timeout
    section: str | None = None
    elapsed: float | None = None         # seconds since the last progress
    timeout: float | None = None
    signal: str | None = None            # what the monitor sent the rank
    timeouts: TimeoutsInfo | None = None


@nested
class HangInfo(_Hang):
    """A hang as the agent puts it into a stop record: the monitor's ``hang_detected`` event, with its time."""

    t: float | None = None               # when the monitor detected it (the event's time)
    stalled_first: int | None = None     # another global rank whose progress stopped earlier (likelier culprit)


@nested
class RankErrorInfo(Record):
    """A failed rank's own error file (torchrun's ``TORCHELASTIC_ERROR_FILE``, written by ``@record``), read back."""

    file: str | None = None
    message: str | None = None           # "<ExceptionType>: <text>"
    exc_type: str | None = None
    traceback: str | None = None
    timestamp: int | None = None         # when the rank recorded it (unix seconds)
    error_code: int | None = None


@nested
class StopDetail(Record):
    """Why a round stopped (``rdzv_stop.detail``); which fields are set depends on the stop's kind."""

    rank: int | None = None              # failed: the failed rank (global) ...
    local_rank: int | None = None
    group_rank: int | None = None        # ... and its node's group rank (also node_left)
    pid: int | None = None
    exitcode: int | None = None
    signal: str | None = None            # failed: the signal that ended the rank; interrupted: the signal received
    signum: int | None = None
    abandoned: bool | None = None        # the rank survived SIGKILL
    tail: list[str] | None = None        # its last output lines
    describe: str | None = None          # the agent's one-line description
    round: int | None = None
    hang: HangInfo | None = None         # the monitor killed it as hung
    error: RankErrorInfo | None = None   # the exception the rank recorded in its error file
    steer: int | None = None             # a steering exit code: no restart in place
    no_restart: bool | None = None
    monitor_failed: bool | None = None   # a rank monitor kept dying
    node: str | None = None              # node_left / scale_up / interrupted: the node
    nodes: int | None = None             # succeeded: how many nodes finished
    leaves: list[str] | None = None      # failed, steer 16: the node(s) leaving; the others go on in place
    peer_failed: int | None = None       # failed: the rank whose collective failed because an unnamed peer is gone


@nested
class JobFailure(StopDetail):
    """One fault stop as ``job_end.failures`` lists it (the stop's detail with its kind)."""

    kind: str | None = None


@nested
class ResumeLimits(Record):
    """The resume driver's budgets (0: no limit)."""

    max_attempts: int | None = None
    max_failures: int | None = None
    max_no_progress: int | None = None


# ---------------------------------------------------------------- agent events


@event("agent_start", "agent")
class AgentStart(Event):
    pid: int
    nproc: int
    nnodes: int | str                     # "MIN:MAX"
    max_restarts: int
    run_id: str


@event("ft_config", "agent")
class FtConfig(Event):
    config: FtConfigInfo


@event("fork_server_ready", "agent")
class ForkServerReady(Event):
    seconds: float
    pid: int
    import_seconds: float | None = None
    threads: int | None = None


@event("fork_server_fallback", "agent")
class ForkServerFallback(Event):
    reason: str


@event("monitor_spawned", "agent")
class MonitorSpawned(Event):
    local_rank: int
    pid: int


@event("monitor_died", "agent")
class MonitorDied(Event):
    local_rank: int
    pid: int
    returncode: int | None = None


@event("monitor_gave_up", "agent")
class MonitorGaveUp(Event):
    """A rank monitor died too often to restart it again: its rank would run unwatched, so the job fails."""

    local_rank: int
    pid: int
    returncode: int | None = None
    deaths: int
    window: float
    last_line: str | None = None          # the last line of its log
    log: str | None = None                # its log file


@event("monitor_stuck", "agent")
class MonitorStuck(Event):
    pid: int


@event("rdzv_join", "agent")
class RdzvJoin(Event):
    round: int
    node_id: str


@event("rdzv_round", "agent")
class RdzvRound(Event):
    round: int
    group_rank: int
    nodes: list[str]
    world_size: int
    restart_count: int
    waited: float                         # seconds this agent spent in the rendezvous


@event("rdzv_standby", "agent")
class RdzvStandby(Event):
    round: int
    node_id: str
    reason: str
    nodes: int


@event("rdzv_stop", "agent")
class RdzvStop(Event):
    round: int
    kind: str                             # failed | node_left | succeeded | scale_up | interrupted
    by_node: str
    detail: StopDetail
    restart_count: int
    give_up: bool


@event("rdzv_bad_record", "agent")
class RdzvBadRecord(Event):
    """A value in the rendezvous store that nvrx did not write (garbage, or forged by another program)."""

    key: str
    problem: str                          # what is wrong with it, in a few words
    action: str                           # "ignored" | "job ends"


@event("rdzv_forged_record", "agent")
class RdzvForgedRecord(Event):
    """A control record in the rendezvous store whose signature does not check (written without the job secret,
    or copied from another key, round or run): ignored. torch's TCPStore does not say which client wrote a key,
    so only what the record itself claims is known."""

    key: str
    problem: str                          # what is wrong with the signature, in a few words
    claims: str | None                    # the node the record names (untrusted), if any
    action: str                           # "ignored" | "job ends"
    suppressed: int                       # ignored records not logged before this one (rate limit)


@nested
class HealthCheckInfo(Record):
    """One node health check's outcome."""

    name: str                             # gpu | memory | disk | storage | nic | hook
    status: str                           # ok | failed | skipped
    detail: str
    seconds: float


@event("node_health", "agent")
class NodeHealth(Event):
    """The node health checks an agent ran before joining a round; a failing node sits the round out."""

    ok: bool
    seconds: float
    checks: list[HealthCheckInfo]
    action: str                           # "joins" | "sits out"


@event("straggler", "agent")
class StragglerEvent(Event):
    """A rank flagged as a straggler (or recovered), by the agent that compares all ranks (group rank 0)."""

    rank: int                             # global rank
    node: str                             # its node (host name)
    metric: str                           # the section, or "<heartbeat>"
    state: str                            # straggler | recovered
    relative: float | None = None         # its median / the other ranks' median (1.5 = 50 % slower)
    individual: float | None = None       # its median / its own earlier median
    median: float                         # seconds
    peers: float | None = None            # the other ranks' median, seconds
    since: float                          # unix time of the first slow report of this streak
    reports: int                          # consecutive slow reports
    round: int
    exclude: bool | None = None           # the exclusion policy will keep its node out of the next round


@event("rank_start", "agent")
class RankStart(Event):
    local_rank: int
    rank: int
    pid: int
    attempt: int
    how: str                              # fork | spawn
    seconds: float


@event("rank_exit", "agent")
class RankExit(Event):
    local_rank: int
    rank: int
    pid: int
    exitcode: int | None = None
    signal: str | None = None
    attempt: int
    abandoned: bool = False


@event("rank_stuck", "agent")
class RankStuck(Event):
    """A rank that did not die after SIGKILL (stuck in the kernel): abandoned."""

    local_rank: int
    rank: int
    pid: int
    attempt: int
    state: str | None = None              # its process state, e.g. "D (disk sleep)"
    status: str | None = None             # psutil's status


@event("agent_killed_rank", "agent")
class AgentKilledRank(Event):
    """The agent SIGKILLed a rank still running when its stop's grace (--term-timeout) ran out."""

    local_rank: int
    rank: int
    pid: int
    attempt: int
    signal: str                           # SIGKILL
    after: str                            # the signal that asked it to stop, which it ignored
    waited: float                         # seconds since that signal


@event("inprocess_rank_lost", "agent")
class InprocessRankLost(Event):
    """--inprocess: a rank ended; the other ranks' Wrapper restarts in process without it (no stop record)."""

    rank: int
    local_rank: int
    pid: int | None = None
    exitcode: int | None = None
    signal: str | None = None
    round: int


@nested
class JitAnswer(Record):
    """One surviving local rank's answer to a just-in-time checkpoint request (``jit_checkpoint.answers``)."""

    local_rank: int
    rank: int | None = None               # its global rank
    outcome: str                          # saved | skipped | failed
    reason: str | None = None             # why it did not save (skipped / failed)


@event("jit_checkpoint", "agent")
class JitCheckpoint(Event):
    """``nvrx launch --jit-ckpt``: what this node's surviving ranks answered when asked, after a fault, to save their
    last completed step (``nvrx.ckpt.jit``); `nvrx inspect` shows one line per fault, merged over the nodes."""

    round: int                            # the round the fault stopped
    fault: str                            # the stop's kind it answers: failed | node_left
    lost: list[int]                       # the global ranks lost (the failed rank, or the ranks of the node that left)
    outcome: str                          # saved (a rank of this node saved) | skipped (left to another rank) | failed
    step: int | None = None               # the steps done at the fault: those saved, or not saved (and why)
    seconds: float | None = None          # the save, as the saving rank measured it
    waited: float                         # the whole request: asking until every answer (or the bound)
    path: str | None = None               # the checkpoint saved
    reason: str | None = None             # why nothing was saved here: the rank's words, one line
    answers: list[JitAnswer]


@event("agent_signal", "agent")
class AgentSignal(Event):
    signal: str
    phase: str                            # rendezvous | running
    round: int | None = None


@event("job_end", "agent")
class JobEnd(Event):
    status: str                           # succeeded | failed | interrupted | steered | already_finished
    exit_code: int | None = None
    seconds: float | None = None
    detail: str | None = None             # an agent error (e.g. the rendezvous store was lost)
    failures: list[JobFailure] | None = None


# ---------------------------------------------------------------- rank monitor events
# ``rank`` in a monitor's events is its local rank; ``global_rank`` the attached rank's RANK.


@event("monitor_start", "monitor")
class MonitorStart(Event):
    rank: int
    pid: int
    socket: str
    timeouts: TimeoutsInfo
    check_interval: float


@event("monitor_exit", "monitor")
class MonitorExit(Event):
    rank: int
    reason: str


@event("monitor_auth_failed", "monitor")
class MonitorAuthFailed(Event):
    rank: int
    op: Any = None                        # free-form: the op of a rejected (untrusted) request, as sent


@event("monitor_takeover_refused", "monitor")
class MonitorTakeoverRefused(Event):
    rank: int
    pid: int                              # the process that tried to take over
    holder: int                           # the live rank process that keeps the session


@event("monitor_attach", "monitor")
class MonitorAttach(Event):
    rank: int
    global_rank: int | None = None
    pid: int
    generation: int
    armed: bool
    reattach: bool


@event("monitor_connect", "monitor")
class MonitorConnect(Event):
    rank: int
    global_rank: int | None = None
    pid: int
    generation: int
    timeouts: TimeoutsInfo


@event("monitor_disconnect", "monitor")
class MonitorDisconnect(Event):
    rank: int
    pid: int
    generation: int
    reason: str


@event("first_heartbeat", "monitor")
class FirstHeartbeat(Event):
    rank: int
    pid: int
    delay: float                          # seconds from the rank's start to its first heartbeat


@event("heartbeat_stats", "monitor")
class HeartbeatStats(Event):
    """Cumulative per rank process, written at most every 30 s and once at its end."""

    rank: int
    count: int                            # explicit heartbeats so far
    max_interval: float
    since_last: float | None = None       # seconds since the last explicit heartbeat (None: none yet)
    auto_since_last: float | None = None  # seconds since the last automatic heartbeat (None: none beat)


@event("section_open", "monitor")
class SectionOpen(Event):
    rank: int
    section: str
    open_for: float


@event("section_close", "monitor")
class SectionClose(Event):
    """Closes of one section since the last such event (written at most every 10 s per section)."""

    rank: int
    section: str
    closes: int
    last_duration: float
    max_duration: float
    total: float | None = None            # their exact total, when a monitor knows it


@event("hang_detected", "monitor")
class HangDetected(_Hang, Event):
    """The monitor declared its rank hung and is about to signal it: the one record of a hang's cause.

    The agent reads it back from the monitor's event file to explain the rank's exit (the stop
    record's ``detail.hang``, see ``nvrx.launcher.agent.rank_monitors.MonitorGroup.hang_reason``).
    """


@event("rank_terminated", "monitor")
class RankTerminated(Event):
    rank: int
    pid: int
    signal: str
    reason: str
    error: str | None = None              # the signal could not be sent (the process was gone)


@event("rank_killed", "monitor")
class RankKilled(Event):
    """The monitor SIGKILLed a hung rank still alive GRACE seconds after the termination signal."""

    rank: int
    pid: int
    signal: str
    after: str
    grace: float
    error: str | None = None


@event("timeouts_set", "monitor")
class TimeoutsSet(Event):
    rank: int
    updated: bool
    timeouts: TimeoutsInfo
    path: str


@event("timeouts_loaded", "monitor")
class TimeoutsLoaded(Event):
    rank: int
    timeouts: TimeoutsInfo
    global_rank: int | None = None
    path: str | None = None               # loaded from this state file ...
    source: str | None = None             # ... or given by the rank ("rank")


@event("heartbeat_timeout_auto", "monitor")
class HeartbeatTimeoutAuto(Event):
    """The automatic heartbeat timeout was derived or widened (``nvrx.monitors.auto_timeout``), and from what."""

    rank: int
    global_rank: int | None = None
    mode: str                             # suggest (reported only) | set (enforced)
    timeout: float                        # the new automatic timeout (seconds)
    previous: float | None = None         # the one it replaces (None: the first after warm-up)
    reason: str                           # warm-up done | longer gap observed
    percentile: float                     # of the steady gaps the bound is a multiple of (100: the longest)
    basis: float                          # that percentile's gap (its bucket's upper edge), seconds
    longest_gap: float                    # the longest steady gap between heartbeats (its bucket's upper edge)
    p50: float
    p99: float
    gaps: int                             # steady gaps observed
    observed_s: float                     # over this many seconds (settling phases after a start left out)
    multiple: float
    floor: float
    configured: float | None = None       # rank_heartbeat_timeout: the bound never goes above it
    capped: bool = False                  # the bound reached the configured timeout, which stays in force


@event("heartbeat_timeout_auto_deferred", "monitor")
class HeartbeatTimeoutAutoDeferred(Event):
    """A rank passed its automatic timeout busy (its main thread runnable, on the CPU or in disk wait, or a local
    peer working): not a hang yet; looked at again every automatic timeout, the configured one bounds the gap."""

    rank: int
    global_rank: int | None = None
    pid: int
    elapsed: float                        # seconds since its last liveness mark
    timeout: float                        # the automatic timeout it passed
    state: str                            # the main thread's scheduler state (R, S, D)
    cpu_fraction: float | None = None     # of the gap spent on the CPU by the main thread
    why: str                              # busy how, in words (runnable, on the CPU, a local peer working)
    fallback: float | None = None         # the configured timeout: the bound of this gap


@event("timeouts_state_ignored", "monitor")
class TimeoutsStateIgnored(Event):
    rank: int
    path: str
    error: str


@nested
class TimingInfo(Record):
    """One metric of a rank over one report window (``nvrx.monitors.straggler``): a section or heartbeat intervals."""

    metric: str                           # a section name, or "<heartbeat>" for heartbeat intervals
    median: float                         # seconds
    samples: int


@event("rank_timing", "monitor")
class RankTiming(Event):
    """A rank monitor's timing summary of its rank over one straggler report interval (the aggregator's input)."""

    rank: int
    global_rank: int | None = None
    pid: int
    window: float                         # seconds the summary covers
    timings: list[TimingInfo]


@event("checkpoint_complete", "monitor")
class CheckpointComplete(Event):
    """A checkpoint of nvrx's own checkpointers became complete (published / written on every rank), as the rank
    reported it (``nvrx.common.checkpoint_report.report_checkpoint``); `nvrx inspect` counts redone work from it.
    The line's time is when the monitor heard of it: about the completion."""

    rank: int
    global_rank: int | None = None
    pid: int
    step: int | None = None               # the training step (iteration) the checkpoint holds
    tier: str                             # global (DCP on shared storage) | local | jit | ...
    taken: float | None = None            # unix time the state was taken: progress after it is not in it
    path: str | None = None


@event("checkpoint_interval", "monitor")
class CheckpointInterval(Event):
    """``PeriodicCheckpointer(every_steps="auto")`` chose a checkpoint interval (``nvrx.ckpt.interval``), as rank 0
    reported it when the choice changed; `nvrx inspect` shows the last one and why."""

    rank: int
    global_rank: int | None = None
    pid: int
    every_steps: int                      # the interval chosen, in steps
    seconds: float | None = None          # the optimum in seconds of training (None: no failure rate known)
    save_cost_s: float | None = None      # what a save blocked training for (measured)
    step_s: float | None = None           # a training step (measured)
    drain_s: float | None = None          # a save's copy + write + publish (measured): the interval's floor
    mtbf_s: float | None = None           # mean time between failures used (seen or configured)
    restart_s: float | None = None        # a restart's cost (measured by earlier rounds), if known
    expected_goodput: float | None = None
    why: str


@event("workload_control", "monitor")
class WorkloadControl(Event):
    """A rank asked, through its monitor, to exclude its node or to shut the workload down (spec 001)."""

    rank: int
    global_rank: int | None = None
    pid: int
    action: str                           # ExcludeThisNode | ShutdownWorkload | Continue
    description: str
    forwarded: bool                       # handed to the agent (False: no agent channel, or it was full)


# ---------------------------------------------------------------- resume driver events


@event("resume_start", "resume")
class ResumeStart(Event):
    mode: str                             # loop | record | stop | check
    pid: int
    job_id: str | None = None
    node: str | None = None
    state_dir: str
    finished_flag: str
    limits: ResumeLimits
    submit: str | None = None
    command: list[str]


@event("resume_attempt_start", "resume")
class ResumeAttemptStart(Event):
    attempt: int
    job_id: str | None = None
    node: str | None = None
    command: list[str]
    progress: int | None = None


@event("resume_attempt_end", "resume")
class ResumeAttemptEnd(Event):
    attempt: int
    exit_code: int
    cause: str
    progress: int | None = None
    finished: bool
    job_id: str | None = None
    node: str | None = None
    start: float | None = None
    seconds: float | None = None


@event("resume_decision", "resume")
class ResumeDecision(Event):
    action: str                           # finished | continue | give_up
    reason: str
    check: bool | None = None
    new_job: bool | None = None
    attempts: int | None = None
    failures: int | None = None
    no_progress: int | None = None
    last_progress: int | None = None
    last_cause: str | None = None
    excluded_nodes: list[str] | None = None
    state: dict[str, Any] | None = None   # free-form here: a state snapshot, validated by ResumeState.from_dict


@event("resume_submit", "resume")
class ResumeSubmit(Event):
    status: str                           # submitting | submitted | failed
    method: str                           # sbatch | requeue
    from_job: str | None = None
    command: list[str]
    exclude: list[str]
    ok: bool | None = None
    job_id: str | None = None
    error: str | None = None
    state: dict[str, Any] | None = None   # free-form here: a state snapshot, validated by ResumeState.from_dict


@event("resume_signal", "resume")
class ResumeSignal(Event):
    signal: str
    forwarded: bool
    sender_pid: int | None = None
    attempt: int


@event("resume_end", "resume")
class ResumeEnd(Event):
    action: str
    reason: str
    exit_code: int


@event("resume_state_recovered", "resume")
class ResumeStateRecovered(Event):
    source: str | None = None
    note: str
    corrupt_copy: str | None = None


@event("resume_reset", "resume")
class ResumeReset(Event):
    pass


# ---------------------------------------------------------------- re-run state machine events
# Written by rank 0 of a job using nvrx.launcher.rank.rerun.RerunStateMachine, to
# ``<run log dir>/rerun-<node>-<rank>.jsonl``: one event per decision, with every suspect rank in it.


@nested
class RerunSuspect(Record):
    """One rank whose result was rejected: where it ran, what was rejected, and what the re-runs gave."""

    rank: int
    node: str
    device: int | None = None             # the CUDA device (None on a CPU-only rank)
    message: str                          # the validate_result message ("loss is NaN")
    call: int | None = None               # which call with that message in the step (1, 2, ...)
    result: str                           # the rejected result (repr of the float: JSON has no NaN)
    rerun_result: str | None = None       # what the latest re-run gave at the same call
    rerun_node: str | None = None         # where that re-run ran


@event("rerun_suspected", "rerun")
class RerunSuspected(Event):
    """A step's result was rejected on some rank(s): the step is re-run in place."""

    step: int
    suspects: list[RerunSuspect]


@event("rerun_attempt", "rerun")
class RerunAttempt(Event):
    """A re-run of the suspected step ended: in place or from the checkpoint, reproduced or not, and what next."""

    step: int
    where: str                            # in_place | from_checkpoint
    reproduced: bool
    same_hardware: bool | None = None     # from_checkpoint: it landed on the suspected node again
    next: str                             # verdict | checkpoint_and_exit | exit_again
    suspects: list[RerunSuspect]


@event("rerun_verdict", "rerun")
class RerunVerdict(Event):
    """The diagnosis of a rejected result and what the job does about it."""

    step: int
    diagnosis: str                        # correct_result | transient_error | persistent_error
    action: str                           # continue | exit
    exit_code: int | None = None          # 17 when a correct (deterministic) result was fatal
    fatal: bool
    suspects: list[RerunSuspect]


@event("rerun_stats", "rerun")
class RerunStats(Event):
    """Determinism statistics (mode report_determinism_stats): each step ran twice; the relative differences."""

    step: int                             # the last step counted (the report covers stats_interval steps)
    message: str                          # the validate_result message the numbers are for
    count: int                            # comparisons over all ranks
    nonzero: int                          # how many differed at all
    max_diff: float
    mean_diff: float
    buckets: dict[str, int] | None = None  # how many differences fell in each range ("0", "<1e-9", ...)
