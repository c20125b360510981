"""What happened in a run: fold the agents', monitors' and resume driver's events into small state.

``Timeline`` reads event files (whole, or incrementally for ``--follow``) and keeps, per agent file,
monitor file and round, just what ``nvrx.inspection.run_report.make_report`` needs to tell a person what
happened: jobs (one ``nvrx launch`` of a run across its nodes), rendezvous rounds, stops with their
details, rank sessions with heartbeat and section tallies, hangs, timeouts, and the resume driver's
decisions as timeline entries.

Every event record of ``nvrx.events`` has a reader here (``AGENT_HANDLERS``, ``MONITOR_HANDLERS``,
``RESUME_LEVEL``) or is listed in ``NOT_SHOWN`` with the reason; fields are read through the records'
field names (``RdzvRound.F.waited``). ``tests/unit/test_event_contract.py`` holds both sides together.

This is the backend: it produces data, the CLI renders it. A timeline ``Entry`` is either a finished
sentence (``text``) or, for the resume driver's events and other writers' events, a structured entry:
its ``form`` names how to word it and ``fields`` holds the event's fields; ``nvrx.nvrx_cli.inspect_text``
words those, and does all human formatting of times. Numbers inside the sentences kept here are plain:
seconds as a number of seconds, rounded (no minutes or hours). Every entry's level (ok / info / warn /
error) is decided here, the resume events' too (``RESUME_LEVEL``): it is a fact about the event (how an
attempt or a decision turned out), the same for every renderer, and what a script filters the
``--json`` timeline on; only the sentence is the renderer's.

Definitions:

* **job**: the agent files of one run dir whose lifetimes overlap (every node's agent of one launch).
* **wall time**: first event of the first job to the last event of the last job; the gaps between
  the jobs of a resume chain (queueing, restarts of the allocation) are included.
* **uptime** = time all ranks of a round were running (its last ``rank_start`` to the round's stop),
  summed over rounds, / wall time. It counts a hung rank and work that is later redone as up.
* **goodput** = kept progress time / wall time, from the first progress source present:

  1. the step section (``--step-section``; by default ``step``, else ``iteration``): per rank process
     the time in that section (monitors log section closes at a bounded rate as ``closes`` +
     ``last_duration``, so a batch counts ``closes x last_duration``, or the exact ``total``);
  2. heartbeats, explicit or else automatic (``--ft-param-auto-heartbeat``): per rank process the span
     from its first progress (first heartbeat; the process start for automatic beats) to its last
     (the last beat the monitor saw, or the last progress before a detected hang).

  Per round the mean over its ranks, capped at the round's running time, summed over rounds.
  **Recompute**: a round that did not succeed (a fault, a preemption, a scale-up) is redone from the
  last checkpoint, so the progress a rank process made after its last checkpoint is not kept. A
  checkpoint is a close of the checkpoint section (``--ckpt-section``, default ``checkpointing``);
  when a run has no such section, recompute cannot be told and all progress counts (the report says
  so). Without any progress source there is no goodput: uptime is not a substitute.
* **time lost per fault**: from the fault to all ranks of the next round running (its last
  ``rank_start``); for an interruption or a job that gave up, to the next job's ranks running. The
  fault's moment: a crash is the failing rank's exit; a hang is its last progress (detection time minus
  the elapsed time the monitor measured); a node that left is that node's last logged event.

Reading streams: files are folded line by line into small per-session/per-round state, so a 100 MB log
dir never sits in memory as dicts. Lines that are not events are counted (with the first few quoted)
and skipped; unknown events are counted per source and name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from nvrx.events import (
    AgentKilledRank, AgentSignal, AgentStart, Event, FirstHeartbeat, ForkServerFallback, ForkServerReady, FtConfig,
    HangDetected, HeartbeatStats, HeartbeatTimeoutAuto, HeartbeatTimeoutAutoDeferred, InprocessRankLost, JobEnd,
    MonitorAttach, MonitorAuthFailed, MonitorConnect,
    MonitorDied, MonitorDisconnect, MonitorExit, MonitorGaveUp, MonitorSpawned, MonitorStart, MonitorStuck,
    MonitorTakeoverRefused, RankExit, RankKilled, RankStart, RankStuck, RankTerminated, RdzvBadRecord,
    RdzvForgedRecord, RdzvJoin, RdzvRound, RdzvStandby, RdzvStop, ResumeAttemptEnd, ResumeAttemptStart,
    ResumeDecision, ResumeEnd, ResumeReset,
    ResumeSignal, ResumeStart, ResumeStateRecovered, ResumeSubmit, SectionClose, SectionOpen, StopDetail,
    TimeoutsLoaded, TimeoutsSet, TimeoutsStateIgnored, decode_event, field_problem,
)
from nvrx.events import SCHEMA_VERSION
from nvrx.events import RerunAttempt, RerunStats, RerunSuspected, RerunVerdict
from nvrx.events import HealthCheckInfo, NodeHealth
from nvrx.events import CheckpointComplete, CheckpointInterval, RankTiming, StragglerEvent, WorkloadControl
from nvrx.events import JitCheckpoint
from nvrx.monitors.straggler import metric_text
from nvrx.inspection.event_files import (Damage, EventFile, event_name, first_event_time, iso, raw_string,
                                             read_chunk)

STEP_SECTIONS = ("step", "iteration")  # the default progress sections, in order of preference
CKPT_SECTION = "checkpointing"          # the spec's name for the checkpoint section

# The hot handlers' field names, bound once (a renamed record field fails at import, not silently).
_SC_SECTION, _SC_CLOSES, _SC_LAST, _SC_MAX, _SC_TOTAL = (SectionClose.F.section, SectionClose.F.closes,
                                                        SectionClose.F.last_duration, SectionClose.F.max_duration,
                                                        SectionClose.F.total)
_HB = HeartbeatStats.F


@dataclass(frozen=True)
class Filters:
    """What the report covers: one global rank, events from a time on, and the progress/checkpoint sections.

    STEP_SECTION None: ``step``, else ``iteration`` (the first a run has).
    """

    rank: int | None = None
    since: float | None = None
    step_section: str | None = None
    ckpt_section: str = CKPT_SECTION
    node: str | None = None               # only this node's entries, ranks and timeouts (its name or node id)


# ------------------------------------------------------------------ folded state


@dataclass
class RoundState:
    """One rendezvous round of a job, merged over the agents that took part."""

    job: "JobState"
    number: int
    t: float
    nodes: list[str] = field(default_factory=list)
    world_size: int | None = None
    restart_count: int | None = None
    waited: float | None = None
    running_at: float | None = None       # the last rank_start of the round, over all nodes
    stop: dict[str, Any] | None = None    # the rdzv_stop fields (RdzvStop.F names)
    stop_t: float | None = None
    stop_agent: "AgentFile | None" = None
    exits: dict[int, float] = field(default_factory=dict)  # rank pid -> exit time


@dataclass
class JobState:
    """One `nvrx launch` of a run across its nodes: agent files of one run dir whose lives overlap."""

    index: int
    run_dir: Path
    start: float
    run_id: str | None = None
    agents: list["AgentFile"] = field(default_factory=list)
    rounds: dict[int, RoundState] = field(default_factory=dict)
    ends: list[dict[str, Any]] = field(default_factory=list)  # job_end fields (JobEnd.F names) + t, node
    left_nodes: set[str] = field(default_factory=set)  # reported gone (node_left): they write no job_end
    jit: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # round -> its nodes' jit_checkpoint fields

    @property
    def info(self) -> dict[str, Any]:
        return next((a.info for a in self.agents if a.info), {})

    @property
    def ft_config(self) -> dict[str, Any] | None:
        return next((a.ft_config for a in self.agents if a.ft_config), None)

    @property
    def last_t(self) -> float:
        return max([a.last_t for a in self.agents] + [self.start])

    @property
    def open(self) -> bool:
        """Some agent has neither ended nor been reported gone by the others (node_left)."""
        return any(not a.ended and a.node_id not in self.left_nodes for a in self.agents)


@dataclass
class AgentFile:
    """One agent's event file: which job and round it is in, and its ranks' pids (to name monitor sessions)."""

    ef: EventFile
    job: JobState | None = None
    node_id: str | None = None
    round: RoundState | None = None
    first_t: float | None = None
    last_t: float = 0.0
    ended: bool = False
    info: dict[str, Any] = field(default_factory=dict)       # agent_start fields (AgentStart.F names)
    ft_config: dict[str, Any] | None = None                   # FtConfigInfo fields
    pids: dict[int, tuple[int, RoundState | None]] = field(default_factory=dict)  # rank pid -> (global rank, round)
    global_of_local: dict[int, int] = field(default_factory=dict)  # local rank -> its latest global rank

    name: str = ""  # the node's one name in the report (Timeline._name_agents)
    run_id: str | None = None


@dataclass
class HealthFold:
    """The nodes of one round that passed their health checks: one timeline entry, kept up to date."""

    job: int
    round: int
    t: float
    nodes: int = 0
    low: float = math.inf
    high: float = 0.0
    first: str = ""
    detail: str = ""
    entry: "Entry | None" = None

    def add(self, node: str, seconds: float) -> None:
        self.nodes += 1
        self.low, self.high = min(self.low, seconds), max(self.high, seconds)
        self.first = self.first or node
        if self.entry is not None:
            self.entry.text = self.text()

    def text(self) -> str:
        low, high = _ms(self.low), _ms(self.high)
        if low == high:
            span = low
        elif low.endswith(" ms") and high.endswith(" ms"):
            span = f"{low[:-3]}-{high}"
        else:
            span = f"{low}-{high}"
        if self.nodes == 1:
            return f"node {self.first} passed its health checks in {span} ({self.detail})"
        return f"{self.nodes} nodes passed their health checks in {span} ({self.detail})"


@dataclass
class SectionTally:
    """One section of one rank session, from the monitor's rate-limited section events."""

    closes: int = 0
    max_s: float = 0.0
    last_s: float | None = None
    total_s: float = 0.0
    open_for: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"closes": self.closes, "max_s": rounded(self.max_s, 6), "last_s": rounded(self.last_s, 6),
                "total_s_est": rounded(self.total_s)}


@dataclass
class RankSession:
    """One rank process watched by one monitor (from connect/attach to disconnect)."""

    node: str | None
    local_rank: int
    pid: int | None
    generation: Any
    t: float
    global_rank: int | None = None
    end_t: float | None = None
    end_reason: str | None = None
    hb_count: int = 0
    hb_base: int = 0
    hb_max_interval: float | None = None
    first_delay: float | None = None
    first_hb_t: float | None = None       # when the monitor saw the first explicit heartbeat
    last_hb_t: float | None = None        # the last explicit heartbeat the monitor saw
    last_auto_t: float | None = None      # the last automatic heartbeat it saw (None: no automatic beats)
    sections: dict[str, SectionTally] = field(default_factory=dict)
    ckpt_t: float | None = None           # the state time of the last complete checkpoint (or checkpoint section close)
    totals_at_ckpt: dict[str, float] = field(default_factory=dict)  # section totals at that close
    ckpts: list[tuple[float, float, Any, str, Any]] = field(default_factory=list)  # (t, taken, step, tier, path)
    timeouts: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None    # HangDetected fields + t

    @property
    def auto(self) -> bool:
        return self.last_auto_t is not None


@dataclass
class MonitorFile:
    """One rank monitor's event file: its sessions (one per rank process) and the timeouts it logged."""

    ef: EventFile
    session: RankSession | None = None
    sessions: list[RankSession] = field(default_factory=list)
    configured: dict[str, Any] | None = None   # timeouts in force at monitor start
    loaded: dict[str, Any] | None = None
    computed: dict[str, Any] | None = None     # the last timeouts_set
    computed_t: float | None = None
    auto: dict[str, Any] | None = None         # the last heartbeat_timeout_auto (fields + t)
    auto_deferred: int = 0                     # gaps that passed the automatic timeout busy
    restarts: int = 0
    last_t: float = 0.0
    deferred_hb: tuple[int, bytes] | None = None                       # see _defer()
    deferred_open: dict[str, tuple[int, bytes]] = field(default_factory=dict)


@dataclass
class Entry:
    """One line of the timeline (KEY identifies it across --follow polls).

    TEXT is a finished sentence, or None for a structured entry: FORM names how the renderer words it
    (``nvrx.nvrx_cli.inspect_text.FORMS``: an event name of ``nvrx.events``, ``job_end``, or ``event`` for
    any event listed field by field) and FIELDS holds what it needs. ``to_dict()`` leaves such an entry's
    ``text`` None; the renderers (the JSON one too) fill it in.
    """

    key: tuple
    t: float
    kind: str
    text: str | None
    level: str = "info"          # info | warn | error | ok
    job: int | None = None
    round: int | None = None
    rank: int | None = None
    tail: list[str] = field(default_factory=list)
    form: str | None = None
    fields: dict[str, Any] | None = None
    node: str | None = None      # the node the entry is about (--node filters on it)
    repeats: int = 0             # the same event logged again this many times (folded into this entry)

    def to_dict(self) -> dict[str, Any]:
        out = {"t": self.t, "time": iso(self.t), "kind": self.kind, "level": self.level, "text": self.text,
               "job": self.job, "round": self.round, "rank": self.rank, "node": self.node}
        if self.tail:
            out["tail"] = self.tail
        if self.repeats:
            out["repeats"] = self.repeats
        return out


# ------------------------------------------------------------------ the builder

Handler = Callable[[Any, dict[str, Any]], None]


class Timeline:
    """Feeds on event files (whole, or incrementally for --follow) and builds a Report on demand."""

    def __init__(self, filters: Filters | None = None) -> None:
        self.filters = filters or Filters()
        self.files: list[EventFile] = []
        self.damage = Damage()
        self.unknown: dict[str, int] = {}
        self.lines = 0
        self.readable = 0  # events folded (or counted as unknown): 0 after reading means nothing usable
        self.jobs: list[JobState] = []
        self.agents: dict[Path, AgentFile] = {}
        self.monitors: dict[Path, MonitorFile] = {}
        self.others: list[Entry] = []         # resume driver and other notable one-off events
        self.hangs: list[tuple[MonitorFile, dict[str, Any]]] = []
        self.live = False  # --follow: an open job extends to the present (its agents write rarely)
        self._node_lists: dict[bytes, list[Any]] = {}  # see _decode_round
        self._said: set[tuple] = set()
        self._noted: dict[tuple, Entry] = {}
        self.other_versions: dict[str, int] = {}  # schema version -> events skipped
        self.names: dict[str, str] = {}  # an agent file's <host>-<pid> -> the node's name in the report
        self.ckpt_reported = False  # some rank reported a complete checkpoint (checkpoint_complete events)
        self.ckpt_interval: dict[str, Any] | None = None  # the last checkpoint_interval event's fields, with its time
        self.health: list[tuple[int, int, str, float, bool, float]] = []  # (job, round, node, t, ok, seconds)
        self.health_ok: dict[tuple[int, int], HealthFold] = {}
        self.stragglers: dict[tuple, Entry] = {}  # (job, rank, metric, since) -> its entry, updated per report
        skip = {cls.EV: _skip for cls in NOT_SHOWN}
        self._agent_handlers: dict[str, Handler] = {
            **{c.EV: _skip for c in NOT_SHOWN if c.SOURCE == "agent"},
            **{cls.EV: fn.__get__(self) for cls, fn in AGENT_HANDLERS.items()}}
        self._monitor_handlers: dict[str, Handler] = {
            **{c.EV: _skip for c in NOT_SHOWN if c.SOURCE == "monitor"},
            **{cls.EV: fn.__get__(self) for cls, fn in MONITOR_HANDLERS.items()}}
        self._not_shown = skip

    # ---- input
    def add_files(self, files: Iterable[EventFile]) -> list[EventFile]:
        """Register new files; agent files are ordered by their first event so jobs form in time order."""
        known = {ef.path for ef in self.files}
        new = [ef for ef in files if ef.path not in known]
        order = {"agent": 0, "monitor": 1, "resume": 2, "other": 3}
        times = {ef.path: first_event_time(ef) for ef in new if ef.kind == "agent"}  # other files: path order
        new.sort(key=lambda ef: (order.get(ef.kind, 9), times.get(ef.path) or math.inf, str(ef.path)))
        for ef in new:
            self.files.append(ef)
            if ef.kind == "agent":
                self.agents[ef.path] = AgentFile(ef)
            elif ef.kind == "monitor":
                self.monitors[ef.path] = MonitorFile(ef)
        if any(ef.kind == "agent" for ef in new):
            self._name_agents()
        return new

    def node_of(self, m: MonitorFile) -> str:
        """The name of a monitor file's node (its agent's)."""
        return self.names.get(str(m.ef.node), str(m.ef.node))

    def _name_agents(self) -> None:
        """One name per node, before and after it joined a round: its host (the agent file's ``<host>-<pid>`` less
        the pid), or ``<host>-<pid>`` where several agents of a run dir share a host (one machine, many agents)."""
        hosts: dict[tuple[Path, str], int] = {}
        for a in self.agents.values():
            key = (a.ef.run_dir, host_of(str(a.ef.node)))
            hosts[key] = hosts.get(key, 0) + 1
        for a in self.agents.values():
            host = host_of(str(a.ef.node))
            a.name = host if hosts[(a.ef.run_dir, host)] == 1 else str(a.ef.node)
            self.names[str(a.ef.node)] = a.name


    def consume(self, ef: EventFile, final: bool = True, budget: int | None = None) -> int:
        """Fold EF's unread lines (all of them if BUDGET is None, else about BUDGET bytes); returns lines."""
        owner: Any = self.agents.get(ef.path) or self.monitors.get(ef.path)
        table = (self._agent_handlers if isinstance(owner, AgentFile) else
                 self._monitor_handlers if isinstance(owner, MonitorFile) else {})
        lazy = isinstance(owner, MonitorFile) and final and not self.live and self.filters.since is None
        is_agent = isinstance(owner, AgentFile)
        n = 0
        while True:
            start = ef.offset
            first, lines = read_chunk(ef, final)
            if ef.error is not None:
                self.damage.add(ef, 0, ef.error)
                ef.error = None
            n += len(lines)
            last_t = owner.last_t if owner is not None else 0.0
            for i, raw in enumerate(lines, first + 1):
                if not raw or raw.isspace():
                    continue
                if lazy and _defer(owner, i, raw):
                    continue
                try:
                    e = decode_event(raw) if not is_agent or len(raw) < _BIG_LINE else self._decode_round(raw)
                except ValueError as exc:
                    self.damage.add(ef, i, _damage_reason(raw, exc))
                    continue
                v = e.get("v", SCHEMA_VERSION)
                if v != SCHEMA_VERSION:  # another nvrx's schema: its fields may mean other things; counted, skipped
                    key = _short(v, 20)
                    self.other_versions[key] = self.other_versions.get(key, 0) + 1
                    continue
                if e["t"] > last_t:
                    last_t = e["t"]
                if owner is None:  # the resume driver's and other writers' files
                    self._generic(ef, e, i)
                    self.readable += 1
                    continue
                ev = e["ev"]
                if lazy and ev in _SESSION_BOUNDARIES:
                    self._apply_deferred(owner)
                handler = table.get(ev)
                if handler is None:
                    key = f"{_short(e.get('src', ef.kind), 40)}/{_short(ev, 40)}"
                    self.unknown[key] = self.unknown.get(key, 0) + 1
                    self.readable += 1
                    continue
                if self._apply(owner, handler, e, i) and lazy and ev == _SECTION_CLOSE and owner.deferred_open:
                    owner.deferred_open.pop(e.get(_SC_SECTION), None)  # a (well-typed) close supersedes the open
            if owner is not None:
                owner.last_t = max(owner.last_t, last_t)
            self.lines += len(lines)
            if ef.offset == start or (budget is not None and ef.offset - start >= budget):
                break
            if ef.offset >= ef.size and not ef.pending:
                break
        if lazy:
            self._apply_deferred(owner)
        return n

    def _decode_round(self, raw: bytes) -> dict[str, Any]:
        """Decode a long agent line; a node list another agent's line already had is not decoded again.

        Every agent of a round logs the same ``nodes`` list (thousands of ids at scale): most of an agent file's
        bytes. Its bytes are looked up among the lists seen (each one checked once by a full decode); a line is
        then decoded with an empty list in its place and given the known list. Anything else: a full decode.
        """
        i = raw.find(_NODES_KEY)
        j = raw.find(b"]", i) if i >= 0 else -1
        known = self._node_lists.get(raw[i + len(_NODES_KEY) - 1:j + 1]) if j > 0 else None
        if known is None:
            e = decode_event(raw)
            nodes = e.get(RdzvRound.F.nodes)
            if j > 0 and e.get("ev") == RdzvRound.EV and isinstance(nodes, list) and len(self._node_lists) < 64:
                segment = raw[i + len(_NODES_KEY) - 1:j + 1]
                try:
                    if json.loads(segment) == nodes:
                        self._node_lists[segment] = nodes
                except ValueError:
                    pass
            return e
        e = decode_event(raw[:i + len(_NODES_KEY)] + raw[j:])
        if e.get("ev") != RdzvRound.EV or e.get(RdzvRound.F.nodes) != []:  # the key was not the field itself
            return decode_event(raw)
        e[RdzvRound.F.nodes] = known
        return e

    def _apply(self, owner: Any, handler: Handler, e: dict[str, Any], lineno: int) -> bool:
        """Fold one event (True); a record whose fields have the wrong types is skipped as a corrupt line."""
        problem = field_problem(e)
        if problem is not None:
            self.damage.add(owner.ef, lineno, f"{e['ev']} event: {problem}")
            return False
        try:
            handler(owner, e)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            self.damage.add(owner.ef, lineno, f"{e['ev']} event with unexpected fields ({exc})")
            return False
        self.readable += 1
        return True

    def _apply_deferred(self, m: MonitorFile) -> None:
        """Parse and fold the lines _defer() held back (the last heartbeat_stats, unclosed section_open)."""
        pending = list(m.deferred_open.values())
        if m.deferred_hb is not None:
            pending.append(m.deferred_hb)
        m.deferred_open.clear()
        m.deferred_hb = None
        for lineno, raw in sorted(pending):
            try:
                e = decode_event(raw)
            except ValueError as exc:
                self.damage.add(m.ef, lineno, _damage_reason(raw, exc))
                continue
            v = e.get("v", SCHEMA_VERSION)
            if v != SCHEMA_VERSION:
                self.other_versions[_short(v, 20)] = self.other_versions.get(_short(v, 20), 0) + 1
                continue
            m.last_t = max(m.last_t, e["t"])
            handler = self._monitor_handlers.get(e["ev"])
            if handler is not None:
                self._apply(m, handler, e, lineno)

    def read_all(self) -> None:
        for ef in list(self.files):
            self.consume(ef, final=True)

    # ---- agent events
    def _on_agent_start(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = AgentStart.F
        a.run_id = a.run_id or e.get(f.run_id)
        job = self._job_for(a, e["t"])
        a.info = {k: e.get(k) for k in (f.nproc, f.nnodes, f.max_restarts, f.run_id)}
        job.run_id = job.run_id or e.get(f.run_id)

    def _on_ft_config(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])
        config = e.get(FtConfig.F.config)
        if isinstance(config, dict):
            a.ft_config = config

    def _on_fork_server_ready(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])

    def _on_rdzv_join(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])
        a.node_id = a.node_id or e.get(RdzvJoin.F.node_id)

    def _on_rdzv_round(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = RdzvRound.F
        rd = self._round(self._job_for(a, e["t"]), e[f.round], e["t"])
        rd.t = min(rd.t, e["t"])
        nodes = e.get(f.nodes)
        if nodes and nodes != rd.nodes:  # every agent logs the same list: one copy per round
            if rd.nodes and a.node_id is not None and a.node_id not in rd.nodes and ("mixed", id(rd)) not in self._said:
                self._said.add(("mixed", id(rd)))
                self._note(("mixed", rd.job.index, rd.number), e["t"], "mixed_runs",
                           f"round {rd.number} of job {rd.job.run_id or '?'} was logged with two different node lists "
                           f"(node {a.name} is not in the first): two runs with the same run id in {a.ef.run_dir}? "
                           "Their rounds are mixed in this report; give each run its own --log-dir", level="warn",
                           job=rd.job.index)
            rd.nodes = list(nodes)
        rd.world_size = e.get(f.world_size, rd.world_size)
        rd.restart_count = e.get(f.restart_count, rd.restart_count)
        rd.waited = e.get(f.waited, rd.waited)
        a.round = rd

    @staticmethod
    def _round(job: JobState, number: Any, t: float) -> RoundState:
        """Round NUMBER of JOB, created at time T if this is its first event."""
        r = int(number)
        rd = job.rounds.get(r)
        if rd is None:
            rd = job.rounds[r] = RoundState(job, r, t)
        return rd

    def _on_rdzv_standby(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = RdzvStandby.F
        job = self._job_for(a, e["t"])
        self._note(("standby", job.index, e.get(f.round), a.ef.node), e["t"], "standby",
                   f"node {node_name(e.get(f.node_id), self.names) if e.get(f.node_id) else a.name} waits as a standby: round {e.get(f.round)} "
                   f"is running with {e.get(f.nodes)} node(s) ({e.get(f.reason)})", job=job.index, node=a.name)

    def _on_rank_start(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = RankStart.F
        rd = a.round
        pid = e.get(f.pid)
        if isinstance(pid, int):
            a.pids[pid] = (int(e[f.rank]), rd)
        if isinstance(e.get(f.local_rank), int):
            a.global_of_local[e[f.local_rank]] = int(e[f.rank])
        if rd is not None:
            rd.running_at = e["t"] if rd.running_at is None else max(rd.running_at, e["t"])

    def _on_rank_exit(self, a: AgentFile, e: dict[str, Any]) -> None:
        pid = e.get(RankExit.F.pid)
        if a.round is not None and isinstance(pid, int):
            a.round.exits.setdefault(pid, e["t"])

    def _on_rank_stuck(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = RankStuck.F
        job = self._job_for(a, e["t"])
        self._note(("stuck", a.ef.path, e.get(f.pid)), e["t"], "rank_stuck",
                   f"rank {e.get(f.rank)} (pid {e.get(f.pid)}) did not die after SIGKILL "
                   f"(state {e.get(f.state)}); abandoned", level="error", job=job.index, rank=e.get(f.rank),
                   node=a.name)

    def _on_agent_killed_rank(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = AgentKilledRank.F
        job = self._job_for(a, e["t"])
        rd = a.round
        during = f" while stopping round {rd.number}" if rd is not None else ""
        self._note(("agent_kill", a.ef.path, e.get(f.pid)), e["t"], "agent_killed_rank",
                   f"rank {e.get(f.rank)} (local {e.get(f.local_rank)}, pid {e.get(f.pid)}) ignored {e.get(f.after)}"
                   f"{during}: still running {rounded(e.get(f.waited), 2)} s later (--term-timeout), so the agent sent "
                   f"{e.get(f.signal)}", level="warn", job=job.index, rank=e.get(f.rank), node=a.name)

    def _on_inprocess_rank_lost(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = InprocessRankLost.F
        job = self._job_for(a, e["t"])
        how = f"was killed by {e[f.signal]}" if e.get(f.signal) else f"exited with code {e.get(f.exitcode)}"
        self._note(("inprocess_lost", a.ef.path, e.get(f.pid), e["t"]), e["t"], "inprocess_rank_lost",
                   f"rank {e.get(f.rank)} (local {e.get(f.local_rank)}, pid {e.get(f.pid)}) {how} in round "
                   f"{e.get(f.round)}; --inprocess: the other ranks restart in process without it",
                   level="warn", job=job.index, rank=e.get(f.rank))

    def _on_rdzv_stop(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = RdzvStop.F
        job = self._job_for(a, e["t"])
        rd = self._round(job, e[f.round], e["t"])
        if rd.stop_t is None or e["t"] < rd.stop_t:
            rd.stop = {k: e.get(k) for k in (f.kind, f.by_node, f.detail, f.restart_count, f.give_up)}
            rd.stop_t = e["t"]
            rd.stop_agent = a
        detail = e.get(f.detail)
        if e.get(f.kind) == "node_left" and isinstance(detail, dict) and detail.get(StopDetail.F.node):
            job.left_nodes.add(str(detail[StopDetail.F.node]))

    def _on_rdzv_bad_record(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = RdzvBadRecord.F
        job = self._job_for(a, e["t"])
        ends = e.get(f.action) == "job ends"
        self._note(("bad_record", a.ef.path, e.get(f.key), e["t"]), e["t"], "rdzv_bad_record",
                   f"the agent of node {a.name} found a malformed record {e.get(f.key)} in the "
                   f"rendezvous store ({e.get(f.problem)}): {e.get(f.action)}; another program wrote to the store",
                   level="error" if ends else "warn", job=job.index, node=a.name)

    def _on_rdzv_forged_record(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = RdzvForgedRecord.F
        job = self._job_for(a, e["t"])
        claims = f" naming node {e.get(f.claims)}" if e.get(f.claims) else ""
        more = f" ({e.get(f.suppressed)} more not logged)" if e.get(f.suppressed) else ""
        self._note(("forged_record", a.ef.path, e.get(f.key), e["t"]), e["t"], "rdzv_forged_record",
                   f"the agent of node {a.name} ignored an unauthenticated record {e.get(f.key)}"
                   f"{claims} in the rendezvous store ({e.get(f.problem)}): {e.get(f.action)}{more}; a program "
                   "without the job secret wrote to the store", level="warn", job=job.index, node=a.name)

    def _on_node_health(self, a: AgentFile, e: dict[str, Any]) -> None:
        """A failed check is an entry of its own; the passing nodes of a round are folded into one entry."""
        f, c = NodeHealth.F, HealthCheckInfo.F
        job = self._job_for(a, e["t"])
        rnd = a.round.number + 1 if a.round is not None else 0  # the checks run before joining the next round
        checks = [x for x in e.get(f.checks) or [] if isinstance(x, dict)]
        seconds = e.get(f.seconds) if isinstance(e.get(f.seconds), (int, float)) else 0.0
        self.health.append((job.index, rnd, a.name, e["t"], e.get(f.ok) is not False, float(seconds)))
        if e.get(f.ok) is False:
            shown = [x for x in checks if x.get(c.status) != "ok"]
            parts = "; ".join(f"{x.get(c.name)} {x.get(c.status)}: {x.get(c.detail)}" for x in shown)
            self._note(("node_health", a.ef.path, e["t"]), e["t"], "node_health",
                       f"node {a.name} failed its health checks in {e.get(f.seconds)} s ({parts}); it "
                       f"{e.get(f.action)}", level="error", job=job.index, node=a.name, round=rnd)
            return
        fold = self.health_ok.get((job.index, rnd))
        if fold is None:
            fold = self.health_ok[(job.index, rnd)] = HealthFold(job.index, rnd, e["t"])
            self._note(("health_ok", job.index, rnd), e["t"], "node_health", "", job=job.index, round=rnd)
            fold.entry = self.others[-1]
            fold.detail = "; ".join(f"{x.get(c.name)} {x.get(c.status)}" for x in checks)
        fold.add(a.name, float(seconds))

    def _on_straggler(self, a: AgentFile, e: dict[str, Any]) -> None:
        """One entry per straggler streak (which rank, which node, how much slower, since when), kept up to date
        by the streak's later reports; a recovery is an entry of its own."""
        f = StragglerEvent.F
        job = self._job_for(a, e["t"])
        rank, since = e.get(f.rank), e.get(f.since)
        what, node = metric_text(str(e.get(f.metric))), e.get(f.node)
        rel, ind = _times(e.get(f.relative)), _times(e.get(f.individual))
        if e.get(f.state) == "recovered":
            self._note(("straggler_ok", job.index, rank, e.get(f.metric), since), e["t"], "straggler",
                       f"rank {rank} on node {node} is no straggler any more ({what} {rel} the other ranks' median, "
                       f"after {e.get(f.reports)} slow reports)", job=job.index, rank=rank)
            return
        excluded = "; its node sits out the next round (straggler_exclude_after_reports)" if e.get(f.exclude) else ""
        own = f", {ind} its own earlier median" if e.get(f.individual) is not None else ""
        text = (f"rank {rank} on node {node} is a straggler since {iso(since) if isinstance(since, (int, float)) else '?'}"
                f" (round {e.get(f.round)}): {what} {rel} the other ranks' median ({_secs(e.get(f.median))} vs "
                f"{_secs(e.get(f.peers))}){own}; slow in {e.get(f.reports)} reports in a row{excluded}")
        key = (job.index, rank, e.get(f.metric), since)
        entry = self.stragglers.get(key)
        if entry is None:
            self._note(("straggler",) + key, e["t"], "straggler", text, level="warn", job=job.index, rank=rank)
            self.stragglers[key] = self.others[-1]
        else:
            entry.text = text

    def _on_agent_signal(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = AgentSignal.F
        job = self._job_for(a, e["t"])
        if e.get(f.phase) != "running":  # while running, the interrupted stop record says it
            self._note(("signal", a.ef.path, e["t"]), e["t"], "signal",
                       f"{e.get(f.signal)} received by the agent of node {a.name} during "
                       f"{e.get(f.phase)}", level="warn", job=job.index, node=a.name)

    def _on_monitor_died(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = MonitorDied.F
        job = self._job_for(a, e["t"])
        self._note(("monitor_died", a.ef.path, e.get(f.pid)), e["t"], "monitor_died",
                   f"the monitor of local rank {e.get(f.local_rank)} on node {a.name} died "
                   f"(exit code {e.get(f.returncode)}); restarted", level="warn", job=job.index, node=a.name)

    def _on_monitor_gave_up(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = MonitorGaveUp.F
        job = self._job_for(a, e["t"])
        lr = e.get(f.local_rank)
        rank = a.global_of_local.get(lr) if isinstance(lr, int) else None
        last = f": {e[f.last_line]}" if e.get(f.last_line) else ""
        where = f"; its log: {e[f.log]}" if e.get(f.log) else ""
        self._note(("monitor_gave_up", a.ef.path, e.get(f.pid)), e["t"], "monitor_gave_up",
                   f"the monitor of local rank {lr}{f' (rank {rank})' if rank is not None else ''} on node "
                   f"{a.name} died {e.get(f.deaths)} times within {rounded(e.get(f.window), 2)} s "
                   f"(last exit code {e.get(f.returncode)}{last}); not restarted: its rank would run unwatched, "
                   f"so the job fails{where}", level="error", job=job.index, rank=rank)

    def _on_monitor_stuck(self, a: AgentFile, e: dict[str, Any]) -> None:
        pid = e.get(MonitorStuck.F.pid)
        self._note(("monitor_stuck", a.ef.path, pid), e["t"], "monitor_stuck",
                   f"a rank monitor (pid {pid}) did not exit", level="warn", node=a.name)

    def _on_fork_server_fallback(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("fork_fallback", a.ef.path), e["t"], "fork_server_fallback",
                   f"ranks spawned directly, not forked: {e.get(ForkServerFallback.F.reason)}", job=job.index,
                   node=a.name)

    def _on_jit_checkpoint(self, a: AgentFile, e: dict[str, Any]) -> None:
        """A node's just-in-time checkpoint after a fault: kept with its round; the report merges the nodes' answers
        into one outcome per fault (a saved one wins), so 1,000 nodes make one line, not 1,000."""
        job = self._job_for(a, e["t"])
        rnd = e.get(JitCheckpoint.F.round)
        if isinstance(rnd, int):
            job.jit.setdefault(rnd, []).append({k: v for k, v in e.items() if k not in _ENVELOPE}
                                               | {"t": e["t"], "node": a.name})

    def _on_job_end(self, a: AgentFile, e: dict[str, Any]) -> None:
        f = JobEnd.F
        job = self._job_for(a, e["t"])
        a.ended = True
        job.ends.append({k: e.get(k) for k in (f.status, f.exit_code, f.seconds, f.detail)}
                        | {"t": e["t"], "node": a.name})

    # ---- monitor events
    def _on_monitor_start(self, m: MonitorFile, e: dict[str, Any]) -> None:
        if m.configured is not None:
            m.restarts += 1
        self._end_session(m, e["t"], "monitor restarted")
        m.configured = e.get(MonitorStart.F.timeouts)

    def _on_monitor_exit(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._end_session(m, e["t"], f"monitor exited ({e.get(MonitorExit.F.reason)})")

    def _new_session(self, m: MonitorFile, t: float, pid: Any, generation: Any = None,
                     global_rank: Any = None) -> RankSession:
        s = m.session
        if s is not None and s.pid == pid and s.end_t is None:
            if isinstance(global_rank, int):
                s.global_rank = global_rank
            return s
        self._end_session(m, t, "replaced")
        s = RankSession(m.ef.node, m.ef.local_rank if m.ef.local_rank is not None else -1, pid, generation, t,
                        global_rank=global_rank if isinstance(global_rank, int) else None)
        m.session = s
        m.sessions.append(s)
        return s

    def _on_monitor_attach(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = MonitorAttach.F
        self._new_session(m, e["t"], e.get(f.pid), e.get(f.generation), e.get(f.global_rank))

    def _on_monitor_connect(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = MonitorConnect.F
        s = self._new_session(m, e["t"], e.get(f.pid), e.get(f.generation), e.get(f.global_rank))
        s.timeouts = e.get(f.timeouts)

    def _current(self, m: MonitorFile, e: dict[str, Any], pid: Any = None) -> RankSession:
        s = m.session
        if s is None or s.end_t is not None:  # a file that starts mid-session (rotated, --since)
            s = self._new_session(m, e["t"], pid)
        return s

    def _on_first_heartbeat(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = FirstHeartbeat.F
        s = self._current(m, e, e.get(f.pid))
        s.first_delay = float(e[f.delay])
        s.first_hb_t = e["t"]

    def _on_heartbeat_stats(self, m: MonitorFile, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        t = e["t"]
        since = e.get(_HB.since_last)
        if isinstance(since, (int, float)) and e.get(_HB.count):
            s.last_hb_t = t - since
        auto = e.get(_HB.auto_since_last)
        if isinstance(auto, (int, float)):
            s.last_auto_t = t - auto
        count = int(e.get(_HB.count) or 0)
        if self.filters.since is not None and t < self.filters.since:
            s.hb_base = count  # counts are cumulative per session: --since counts from here
            return
        s.hb_count = max(s.hb_count, count - s.hb_base)
        mi = e.get(_HB.max_interval)
        if isinstance(mi, (int, float)) and count:  # explicit beats only: automatic ones are not timed
            s.hb_max_interval = mi if s.hb_max_interval is None else max(s.hb_max_interval, mi)

    def _on_section_open(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = SectionOpen.F
        s = self._current(m, e)
        name = str(e[f.section])
        sec = s.sections.get(name)
        if sec is None:
            sec = s.sections[name] = SectionTally()
        sec.open_for = float(e.get(f.open_for) or 0.0)

    def _on_section_close(self, m: MonitorFile, e: dict[str, Any]) -> None:
        # The hot path: most events of a big log are section closes.
        s = m.session
        if s is None or s.end_t is not None:
            s = self._current(m, e)
        name = e[_SC_SECTION]
        sec = s.sections.get(name)
        if sec is None:
            sec = s.sections[str(name)] = SectionTally()
        sec.open_for = None
        if self.filters.since is not None and e["t"] < self.filters.since:
            return
        closes = e.get(_SC_CLOSES) or 0
        last = e.get(_SC_LAST) or 0.0
        sec.closes += int(closes)
        sec.last_s = last
        longest = e.get(_SC_MAX) or last
        if longest > sec.max_s:
            sec.max_s = longest
        total = e.get(_SC_TOTAL)  # exact, if a monitor writes it; else estimated from the last duration
        sec.total_s += total if isinstance(total, (int, float)) else closes * last
        if name == self.filters.ckpt_section and (s.ckpt_t is None or e["t"] >= s.ckpt_t):
            s.ckpt_t = e["t"]
            s.totals_at_ckpt = {n: x.total_s for n, x in s.sections.items()}

    def _on_checkpoint_complete(self, m: MonitorFile, e: dict[str, Any]) -> None:
        """A checkpoint nvrx's checkpointers reported complete: the rank's progress up to its state is kept."""
        f = CheckpointComplete.F
        s = self._current(m, e, e.get(f.pid))
        if isinstance(e.get(f.global_rank), int) and s.global_rank is None:
            s.global_rank = e[f.global_rank]
        taken = e.get(f.taken)
        taken = min(float(taken), e["t"]) if isinstance(taken, (int, float)) else e["t"]
        if self.filters.since is not None and e["t"] < self.filters.since:
            return
        s.ckpts.append((e["t"], taken, e.get(f.step), str(e.get(f.tier) or "?"), e.get(f.path)))
        self.ckpt_reported = True
        if s.ckpt_t is None or taken >= s.ckpt_t:
            s.ckpt_t = taken
            s.totals_at_ckpt = {n: x.total_s for n, x in s.sections.items()}

    def _on_checkpoint_interval(self, m: MonitorFile, e: dict[str, Any]) -> None:
        """every_steps="auto" chose an interval: the newest choice is the one in force."""
        if self.ckpt_interval is None or e["t"] >= self.ckpt_interval["t"]:
            self.ckpt_interval = {k: v for k, v in e.items() if k not in ("v", "src", "ev")}

    def _on_hang_detected(self, m: MonitorFile, e: dict[str, Any]) -> None:
        s = self._current(m, e, e.get(HangDetected.F.pid))
        s.hang = {k: v for k, v in e.items() if k not in ("v", "src", "ev")}
        self.hangs.append((m, s.hang))

    def _on_rank_terminated(self, m: MonitorFile, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        if s.hang is not None:
            s.hang["terminated"] = e.get(RankTerminated.F.error) or "signal sent"

    def _on_rank_killed(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = RankKilled.F
        s = self._current(m, e)
        failed = f" (failed: {e[f.error]})" if e.get(f.error) else ""
        who = f"rank {s.global_rank}" if s.global_rank is not None else f"local rank {m.ef.local_rank}"
        self._note(("rank_killed", m.ef.path, e.get(f.pid)), e["t"], "rank_killed",
                   f"{who} (pid {e.get(f.pid)}) on node {self.node_of(m)} was still alive {rounded(e.get(f.grace), 2)} s "
                   f"after its monitor sent {e.get(f.after)} for a hang; the monitor sent {e.get(f.signal)}"
                   f"{failed}", level="warn", rank=s.global_rank, node=self.node_of(m))

    def _on_monitor_disconnect(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._end_session(m, e["t"], str(e.get(MonitorDisconnect.F.reason)))

    def _on_timeouts_set(self, m: MonitorFile, e: dict[str, Any]) -> None:
        m.computed, m.computed_t = e.get(TimeoutsSet.F.timeouts), e["t"]

    def _on_heartbeat_timeout_auto(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = HeartbeatTimeoutAuto.F
        m.auto = {k: v for k, v in e.items() if k not in ("v", "src", "ev")}
        rank = e.get(f.global_rank)
        who = f"rank {rank}" if rank is not None else f"local rank {m.ef.local_rank}"
        enforced = e.get(f.mode) == "set" and not e.get(f.capped)
        verb = "set to" if enforced else "suggested:"
        previous = f" (was {e[f.previous]:g} s)" if isinstance(e.get(f.previous), (int, float)) else ""
        capped = "; not below the configured timeout, which stays" if e.get(f.capped) else ""
        self._note(("hb_auto", m.ef.path, e["t"]), e["t"], "heartbeat_timeout_auto",
                   f"{who} on node {self.node_of(m)}: automatic heartbeat timeout {verb} {e.get(f.timeout)} s{previous} "
                   f"({e.get(f.reason)}: {e.get(f.multiple)} x p{e.get(f.percentile)} of {e.get(f.gaps)} steady gaps, "
                   f"{e.get(f.basis)} s; p50 {e.get(f.p50)} s, p99 {e.get(f.p99)} s, longest {e.get(f.longest_gap)} s, over "
                   f"{e.get(f.observed_s)} s; floor {e.get(f.floor)} s, configured {e.get(f.configured)} s{capped})",
                   rank=rank, node=self.node_of(m))

    def _on_heartbeat_timeout_auto_deferred(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = HeartbeatTimeoutAutoDeferred.F
        m.auto_deferred += 1
        rank = e.get(f.global_rank)
        who = f"rank {rank}" if rank is not None else f"local rank {m.ef.local_rank}"
        cpu = e.get(f.cpu_fraction)
        cpu_text = f", main thread on the CPU for {cpu} of the gap" if isinstance(cpu, (int, float)) else ""
        self._note(("hb_auto_deferred", m.ef.path, e["t"]), e["t"], "heartbeat_timeout_auto_deferred",
                   f"{who} (pid {e.get(f.pid)}) passed its automatic heartbeat timeout {e.get(f.timeout)} s busy "
                   f"(no beat for {e.get(f.elapsed)} s, state {e.get(f.state)}{cpu_text}: {e.get(f.why)}): not a hang "
                   f"yet; looked at again every {e.get(f.timeout)} s, the configured timeout {e.get(f.fallback)} s "
                   "bounds this gap", rank=rank, node=self.node_of(m))

    def _on_timeouts_loaded(self, m: MonitorFile, e: dict[str, Any]) -> None:
        m.loaded = e.get(TimeoutsLoaded.F.timeouts)

    def _on_timeouts_state_ignored(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = TimeoutsStateIgnored.F
        self._note(("state_ignored", m.ef.path, e["t"]), e["t"], "timeouts_state_ignored",
                   f"monitor of local rank {m.ef.local_rank} ignored unusable timeouts state {e.get(f.path)}: "
                   f"{e.get(f.error)}", level="warn", node=self.node_of(m))

    def _on_monitor_auth_failed(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._note(("auth", m.ef.path, e["t"]), e["t"], "monitor_auth_failed",
                   f"monitor of local rank {m.ef.local_rank} rejected a {_short(e.get(MonitorAuthFailed.F.op), 40)} "
                   f"request with a wrong or stale token", level="warn", node=self.node_of(m))

    def _on_monitor_takeover_refused(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = MonitorTakeoverRefused.F
        self._note(("takeover", m.ef.path, e["t"]), e["t"], "monitor_takeover_refused",
                   f"monitor of local rank {m.ef.local_rank} refused pid {e.get(f.pid)}: it watches the live rank "
                   f"process {e.get(f.holder)} (a child of a rank may not use RankMonitorClient)", level="warn",
                   node=self.node_of(m))

    def _on_workload_control(self, m: MonitorFile, e: dict[str, Any]) -> None:
        f = WorkloadControl.F
        s = self._current(m, e, e.get(f.pid))
        rank = e.get(f.global_rank) if e.get(f.global_rank) is not None else s.global_rank
        action = str(e.get(f.action))
        what = {"ExcludeThisNode": f"exclude its node {self.node_of(m)}", "ShutdownWorkload": "shut the job down"}.get(
            action, f"{action} (no action)")
        passed = "" if e.get(f.forwarded) else " (not passed on: no agent listened)"
        self._note(("workload_control", m.ef.path, e["t"]), e["t"], "workload_control",
                   f"rank {rank} (local {m.ef.local_rank}, pid {e.get(f.pid)}) asked through its monitor to {what}: "
                   f"{e.get(f.description)}{passed}", level="warn" if action == "Continue" else "error", rank=rank,
                   node=self.node_of(m))

    def _end_session(self, m: MonitorFile, t: float, reason: str) -> None:
        s = m.session
        if s is not None and s.end_t is None:
            s.end_t, s.end_reason = t, reason
        m.session = None

    # ---- resume driver and unknown sources
    def _generic(self, ef: EventFile, e: dict[str, Any], lineno: int) -> None:
        """Resume-driver (and other writers') events: one structured timeline entry each; unknown names are counted.

        A well-formed resume record keeps its fields under its own form (worded by the renderer) and gets
        its level here (RESUME_LEVEL); anything else (a newer writer's event, a record with wrongly typed
        fields) is the form ``event``: its scalar fields, listed as they are.
        """
        name, src = e["ev"], _short(e.get("src", ef.kind), 40)
        level_of = _RESUME_LEVEL_BY_NAME.get(name)
        if level_of is not None and field_problem(e) is None:
            fields = {k: v for k, v in e.items() if k not in _ENVELOPE}
            try:
                level = level_of(fields)
            except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                level = "info"
            self._note(("generic", ef.path, lineno), e["t"], f"{src}:{name}", None, level=level, form=name,
                       fields=fields)
            return
        if level_of is None and name not in self._not_shown:
            key = f"{src}/{name}"
            self.unknown[key] = self.unknown.get(key, 0) + 1
        fields = {"src": src, "ev": name} | {k: v for k, v in e.items() if k not in _ENVELOPE
                                              and (v is None or isinstance(v, (str, int, float, bool)))}
        self._note(("generic", ef.path, lineno), e["t"], f"{src}:{name}", None, form="event", fields=fields)

    def _note(self, key: tuple, t: float, kind: str, text: str | None, level: str = "info", job: int | None = None,
              rank: int | None = None, form: str | None = None, fields: dict[str, Any] | None = None,
              node: str | None = None, round: int | None = None) -> None:
        same = self._noted.get(key)
        if same is not None and same.text == text and same.fields == fields:  # a line logged over and over: one entry
            same.repeats += 1
            return
        entry = Entry(key, t, kind, text, level, job=job, rank=rank, form=form, fields=fields, node=node, round=round)
        self._noted[key] = entry
        self.others.append(entry)

    # ---- jobs
    def _job_for(self, a: AgentFile, t: float) -> JobState:
        """The job this agent file belongs to: one of the same run dir whose life overlaps, else a new one."""
        if a.first_t is None or t < a.first_t:
            a.first_t = t
        if a.job is not None:
            return a.job
        run_dir = a.ef.run_dir
        for job in reversed(self.jobs):
            other_run = a.run_id is not None and job.run_id is not None and job.run_id != a.run_id
            if job.run_dir == run_dir and not other_run and job.start <= t and (
                    t <= job.last_t or (self.live and job.open)):
                a.job = job
                break
        else:
            a.job = JobState(len(self.jobs), run_dir, t)
            self.jobs.append(a.job)
        a.job.agents.append(a)
        a.job.start = min(a.job.start, t)
        return a.job


def _skip(owner: Any, e: dict[str, Any]) -> None:
    """The reader of an event in NOT_SHOWN: read, checked, deliberately not shown."""


# Every record of nvrx.events has a reader below or is here, with the reason it is not shown.
NOT_SHOWN: dict[type[Event], str] = {
    # The agent started a rank monitor: the monitor's own file (monitor_start, its sessions) says more.
    MonitorSpawned: "the monitor's own events tell its story",
    # A monitor's timing summary: the straggler aggregator's input; its verdicts (straggler events) are shown.
    RankTiming: "input of straggler detection; the straggler events are shown",
}

AGENT_HANDLERS: dict[type[Event], Callable[..., None]] = {
    AgentStart: Timeline._on_agent_start,
    FtConfig: Timeline._on_ft_config,
    ForkServerReady: Timeline._on_fork_server_ready,
    ForkServerFallback: Timeline._on_fork_server_fallback,
    MonitorDied: Timeline._on_monitor_died,
    MonitorGaveUp: Timeline._on_monitor_gave_up,
    MonitorStuck: Timeline._on_monitor_stuck,
    RdzvJoin: Timeline._on_rdzv_join,
    RdzvRound: Timeline._on_rdzv_round,
    RdzvStandby: Timeline._on_rdzv_standby,
    RdzvStop: Timeline._on_rdzv_stop,
    RdzvBadRecord: Timeline._on_rdzv_bad_record,
    RdzvForgedRecord: Timeline._on_rdzv_forged_record,
    NodeHealth: Timeline._on_node_health,
    StragglerEvent: Timeline._on_straggler,
    RankStart: Timeline._on_rank_start,
    RankExit: Timeline._on_rank_exit,
    RankStuck: Timeline._on_rank_stuck,
    AgentKilledRank: Timeline._on_agent_killed_rank,
    InprocessRankLost: Timeline._on_inprocess_rank_lost,
    AgentSignal: Timeline._on_agent_signal,
    JobEnd: Timeline._on_job_end,
    JitCheckpoint: Timeline._on_jit_checkpoint,
}

MONITOR_HANDLERS: dict[type[Event], Callable[..., None]] = {
    MonitorStart: Timeline._on_monitor_start,
    MonitorExit: Timeline._on_monitor_exit,
    MonitorAuthFailed: Timeline._on_monitor_auth_failed,
    MonitorTakeoverRefused: Timeline._on_monitor_takeover_refused,
    MonitorAttach: Timeline._on_monitor_attach,
    MonitorConnect: Timeline._on_monitor_connect,
    MonitorDisconnect: Timeline._on_monitor_disconnect,
    FirstHeartbeat: Timeline._on_first_heartbeat,
    HeartbeatStats: Timeline._on_heartbeat_stats,
    SectionOpen: Timeline._on_section_open,
    SectionClose: Timeline._on_section_close,
    HangDetected: Timeline._on_hang_detected,
    RankTerminated: Timeline._on_rank_terminated,
    RankKilled: Timeline._on_rank_killed,
    TimeoutsSet: Timeline._on_timeouts_set,
    HeartbeatTimeoutAuto: Timeline._on_heartbeat_timeout_auto,
    HeartbeatTimeoutAutoDeferred: Timeline._on_heartbeat_timeout_auto_deferred,
    TimeoutsLoaded: Timeline._on_timeouts_loaded,
    TimeoutsStateIgnored: Timeline._on_timeouts_state_ignored,
    WorkloadControl: Timeline._on_workload_control,
    CheckpointComplete: Timeline._on_checkpoint_complete,
    CheckpointInterval: Timeline._on_checkpoint_interval,
}


def _decision_level(e: dict[str, Any]) -> str:
    return {"finished": "ok", "continue": "info", "give_up": "error"}.get(str(e.get(ResumeDecision.F.action)), "warn")


def _submit_level(e: dict[str, Any]) -> str:
    return "error" if e.get(ResumeSubmit.F.status) == "failed" else "info"


def _attempt_end_level(e: dict[str, Any]) -> str:
    f = ResumeAttemptEnd.F
    return "ok" if e.get(f.finished) else "info" if e.get(f.cause) in ("clean_exit", "interrupted") else "warn"


def _info(e: dict[str, Any]) -> str:
    return "info"


def _warn(e: dict[str, Any]) -> str:
    return "warn"


# The resume driver's records and the level of each one's timeline entry (why here: the module docstring);
# nvrx.nvrx_cli.inspect_text.RESUME_TEXT words them.
RESUME_LEVEL: dict[type[Event], Callable[[dict[str, Any]], str]] = {
    ResumeStart: _info,
    ResumeAttemptStart: _info,
    ResumeAttemptEnd: _attempt_end_level,
    ResumeDecision: _decision_level,
    ResumeSubmit: _submit_level,
    ResumeSignal: _warn,
    ResumeEnd: _info,
    ResumeStateRecovered: _warn,
    ResumeReset: _warn,
}


def _rerun_attempt_level(e: dict[str, Any]) -> str:
    return "warn" if e.get(RerunAttempt.F.reproduced) or e.get(RerunAttempt.F.same_hardware) else "info"


def _rerun_verdict_level(e: dict[str, Any]) -> str:
    f = RerunVerdict.F
    diagnosis = e.get(f.diagnosis)
    if diagnosis == "transient_error" or (diagnosis == "correct_result" and e.get(f.exit_code) is None):
        return "warn"
    return "error"


# The re-run state machine's records (rank 0's rerun-*.jsonl, read like the resume driver's: structured
# entries); nvrx.nvrx_cli.inspect_text.RERUN_TEXT words them.
RERUN_LEVEL: dict[type[Event], Callable[[dict[str, Any]], str]] = {
    RerunSuspected: _warn,
    RerunAttempt: _rerun_attempt_level,
    RerunVerdict: _rerun_verdict_level,
    RerunStats: _info,
}
_RESUME_LEVEL_BY_NAME = {cls.EV: level for cls, level in {**RESUME_LEVEL, **RERUN_LEVEL}.items()}
_ENVELOPE = ("v", "t", "src", "ev")  # the fields every event has; not the record's own

_SESSION_BOUNDARIES = frozenset(c.EV for c in (MonitorStart, MonitorExit, MonitorAttach, MonitorConnect,
                                               MonitorDisconnect))
_SECTION_CLOSE = SectionClose.EV
_BIG_LINE = 2048  # bytes: agent lines this long are rounds with long node lists (_decode_round)
_NODES_KEY = f'"{RdzvRound.F.nodes}":['.encode()
_HB_STATS_RAW = HeartbeatStats.EV.encode()
_SECTION_OPEN_RAW = SectionOpen.EV.encode()
_SECTION_KEY = f'"{SectionOpen.F.section}":"'.encode()


def _defer(m: MonitorFile, lineno: int, raw: bytes) -> bool:
    """Hold back a line that a later one of the same session supersedes, without parsing it.

    Most of a big log is two monitor events: ``heartbeat_stats`` (cumulative per session, so only the
    last one before a session boundary counts) and ``section_open`` (only informative while the section
    has not been closed since). They are kept raw and parsed only if still relevant at the next session
    boundary or the end of the file. A held-back line that does not look whole (``{...}``) is parsed at
    once, so torn lines are still reported.
    """
    if not (raw.startswith(b'{"') and raw.endswith(b"}")):
        return False
    name = event_name(raw)
    if name == _HB_STATS_RAW:
        m.deferred_hb = (lineno, raw)
        return True
    if name == _SECTION_OPEN_RAW:
        section = raw_string(raw, _SECTION_KEY)
        if section is None or b"\\" in section:
            return False
        m.deferred_open[section.decode("utf-8", "replace")] = (lineno, raw)
        return True
    return False


def _damage_reason(raw: bytes, exc: ValueError) -> str:
    """Why a line was skipped, in words a person can act on."""
    if b"\0" in raw:
        return "binary garbage (NUL bytes; typical of a crash before data reached the disk)"
    body = raw.strip()
    if body.startswith(b"{") and not body.endswith(b"}"):
        return "truncated line (cut off mid-write)"
    return str(exc).split(":")[0] if isinstance(exc, json.JSONDecodeError) else str(exc)


# ------------------------------------------------------------------ helpers


def rounded(x: float | None, nd: int = 3) -> float | None:
    """A number of the report, rounded to ND decimals (None stays None)."""
    return None if x is None else round(float(x), nd)


def _times(x: Any) -> str:
    """A ratio as a person reads it: 1.53x ('?x' when unknown)."""
    return f"{x:.2f}x" if isinstance(x, (int, float)) and not isinstance(x, bool) else "?x"


def _secs(x: Any) -> str:
    """A short duration in a sentence, 4 decimals ('?' when unknown)."""
    return f"{x:.4f} s" if isinstance(x, (int, float)) and not isinstance(x, bool) else "? s"


def _ms(seconds: float) -> str:
    """A health check's duration: 3 ms, 1.2 s."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def node_name(node_id: Any, names: dict[str, str] | None = None) -> str:
    """A rendezvous node id (``<host>-<pid>-<6 hex>``) as the report names the node (NAMES: Timeline.names)."""
    text = str(node_id)
    head, _, tail = text.rpartition("-")
    key = head if head and len(tail) == 6 and all(ch in "0123456789abcdef" for ch in tail) else text
    return (names or {}).get(key, key)


def host_of(file_node: str) -> str:
    """The host of an agent file's ``<host>-<pid>``."""
    head, _, tail = file_node.rpartition("-")
    return head if head and tail.isdigit() else file_node


def _short(v: Any, limit: int = 80) -> str:
    s = str(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."
