"""What happened in a run: fold the agents', monitors' and resume driver's events into one report.

The report (``Report.to_dict()`` is what ``nvrx inspect --json`` prints) holds, in time order, the
jobs (one ``nvrx launch`` of a run across its nodes), their rendezvous rounds and every stop with its
cause, the failing rank's last output lines, the time each fault cost, goodput, per-rank heartbeat and
section statistics, and the timeouts configured, in force and computed.

Definitions:

* **job**: the agent files of one run dir whose lifetimes overlap (every node's agent of one launch).
* **wall time**: first event of the first job to the last event of the last job; the gaps between
  the jobs of a resume chain (queueing, restarts of the allocation) are included.
* **productive time**: per round, the time ranks spent in the step section (default ``step``), the mean
  over the round's ranks, summed over rounds. Monitors log section closes at a bounded rate as
  ``closes`` + ``last_duration``, so a batch counts ``closes x last_duration`` (or the exact ``total``
  field when a monitor writes one). Without any step-section event it is the time all ranks of a round
  were running: from its last ``rank_start`` to the round's stop.
* **goodput** = productive time / wall time.
* **time lost per fault**: from the fault to all ranks of the next round running (its last
  ``rank_start``); for an interruption or a job that gave up, to the next job's ranks running. The
  fault's moment: a crash is the failing rank's exit; a hang is its last progress (detection time minus
  the elapsed time the monitor measured); a node that left is that node's last logged event.

Reading streams: files are folded line by line into small per-session/per-round state, so a 100 MB log
dir never sits in memory as dicts. Lines that are not events are counted (with the first few quoted)
and skipped; unknown events are counted per source and name.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from launcher import exit_codes
from monitors.event_files import Damage, EventFile, discover, first_event_time, read_lines
from monitors.events import decode_event

log = logging.getLogger(__name__)

REPORT_SCHEMA = 1
TAIL_SHOWN = 20
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL", "SIGSYS", "SIGTRAP"})
HANG_TEXT = {
    "section_timeout": "hung in section {section!r} after {elapsed:.1f} s, timeout {timeout:g} s",
    "heartbeat_timeout": "hung: no heartbeat for {elapsed:.1f} s, timeout {timeout:g} s",
    "no_first_heartbeat": "hung: no first heartbeat after {elapsed:.1f} s, timeout {timeout:g} s",
    "out_of_section_timeout": "hung outside any section for {elapsed:.1f} s, timeout {timeout:g} s",
}


@dataclass(frozen=True)
class Filters:
    """What the report covers: one global rank, events from a time on, and the training-step section."""

    rank: int | None = None
    since: float | None = None
    step_section: str = "step"


# ------------------------------------------------------------------ folded state


@dataclass
class _Round:
    job: "_Job"
    number: int
    t: float
    nodes: list[str] = field(default_factory=list)
    world_size: int | None = None
    restart_count: int | None = None
    waited: float | None = None
    running_at: float | None = None       # the last rank_start of the round, over all nodes
    stop: dict[str, Any] | None = None
    stop_t: float | None = None
    stop_agent: "_Agent | None" = None
    exits: dict[int, float] = field(default_factory=dict)  # rank pid -> exit time


@dataclass
class _Job:
    index: int
    run_dir: Path
    start: float
    run_id: str | None = None
    agents: list["_Agent"] = field(default_factory=list)
    rounds: dict[int, _Round] = field(default_factory=dict)
    ends: list[dict[str, Any]] = field(default_factory=list)  # job_end events, one per agent
    left_nodes: set[str] = field(default_factory=set)  # reported gone (node_left): they write no job_end

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
class _Agent:
    ef: EventFile
    job: _Job | None = None
    node_id: str | None = None
    round: _Round | None = None
    first_t: float | None = None
    last_t: float = 0.0
    ended: bool = False
    info: dict[str, Any] = field(default_factory=dict)       # agent_start fields
    ft_config: dict[str, Any] | None = None
    pids: dict[int, tuple[int, _Round | None]] = field(default_factory=dict)  # rank pid -> (global rank, round)


@dataclass
class _Section:
    closes: int = 0
    max_s: float = 0.0
    last_s: float | None = None
    total_s: float = 0.0
    open_for: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"closes": self.closes, "max_s": _r(self.max_s, 6), "last_s": _r(self.last_s, 6),
                "total_s_est": _r(self.total_s)}


@dataclass
class _Session:
    """One rank process watched by one monitor (from connect/attach to disconnect)."""

    node: str | None
    local_rank: int
    pid: int | None
    generation: Any
    t: float
    end_t: float | None = None
    end_reason: str | None = None
    hb_count: int = 0
    hb_base: int = 0
    hb_max_interval: float | None = None
    first_delay: float | None = None
    sections: dict[str, _Section] = field(default_factory=dict)
    timeouts: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None


@dataclass
class _Monitor:
    ef: EventFile
    session: _Session | None = None
    sessions: list[_Session] = field(default_factory=list)
    configured: dict[str, Any] | None = None   # timeouts in force at monitor start
    loaded: dict[str, Any] | None = None
    computed: dict[str, Any] | None = None     # the last timeouts_set
    computed_t: float | None = None
    restarts: int = 0
    last_t: float = 0.0


@dataclass
class _Item:
    key: tuple
    t: float
    kind: str
    text: str
    level: str = "info"          # info | warn | error | ok
    job: int | None = None
    round: int | None = None
    rank: int | None = None
    tail: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {"t": self.t, "time": iso(self.t), "kind": self.kind, "level": self.level, "text": self.text,
               "job": self.job, "round": self.round, "rank": self.rank}
        if self.tail:
            out["tail"] = self.tail
        return out


# ------------------------------------------------------------------ the builder


class Timeline:
    """Feeds on event files (whole, or incrementally for --follow) and builds a Report on demand."""

    def __init__(self, filters: Filters | None = None) -> None:
        self.filters = filters or Filters()
        self.files: list[EventFile] = []
        self.damage = Damage()
        self.unknown: dict[str, int] = {}
        self.lines = 0
        self.jobs: list[_Job] = []
        self.agents: dict[Path, _Agent] = {}
        self.monitors: dict[Path, _Monitor] = {}
        self.others: list[_Item] = []         # resume driver and other notable one-off events
        self.hangs: list[tuple[_Monitor, dict[str, Any]]] = []
        self.live = False  # --follow: an open job extends to the present (its agents write rarely)
        self._handlers: dict[str, Callable[[Any, dict[str, Any]], None]] = {
            name[4:]: getattr(self, name) for name in dir(self) if name.startswith("_on_")}

    # ---- input
    def add_files(self, files: Iterable[EventFile]) -> list[EventFile]:
        """Register new files; agent files are ordered by their first event so jobs form in time order."""
        known = {ef.path for ef in self.files}
        new = [ef for ef in files if ef.path not in known]
        order = {"agent": 0, "monitor": 1, "resume": 2, "other": 3}
        times = {ef.path: first_event_time(ef) for ef in new}
        new.sort(key=lambda ef: (order.get(ef.kind, 9), times[ef.path] or math.inf, str(ef.path)))
        for ef in new:
            self.files.append(ef)
            if ef.kind == "agent":
                self.agents[ef.path] = _Agent(ef)
            elif ef.kind == "monitor":
                self.monitors[ef.path] = _Monitor(ef)
        return new

    def consume(self, ef: EventFile, final: bool = True, budget: int | None = None) -> int:
        """Fold EF's unread lines (all of them if BUDGET is None, else about BUDGET bytes); returns lines."""
        owner: Any = self.agents.get(ef.path) or self.monitors.get(ef.path) or ef
        src_default = ef.kind
        handlers = self._handlers
        n = 0
        while True:
            start = ef.offset
            got = 0
            for lineno, raw in read_lines(ef, final):
                got += 1
                if not raw.strip():
                    continue
                try:
                    e = decode_event(raw)
                except ValueError as exc:
                    why = "truncated line" if not raw.rstrip().endswith(b"}") else str(exc)
                    self.damage.add(ef, lineno, why)
                    continue
                t = e["t"]
                if isinstance(owner, (_Agent, _Monitor)) and t > owner.last_t:
                    owner.last_t = t
                if owner is ef:  # the resume driver's and other writers' files
                    self._generic(ef, e)
                    continue
                handler = handlers.get(e["ev"])
                if handler is None or not _handler_fits(owner, e["ev"]):
                    key = f"{e.get('src', src_default)}/{e['ev']}"
                    self.unknown[key] = self.unknown.get(key, 0) + 1
                    continue
                try:
                    handler(owner, e)
                except (TypeError, ValueError, KeyError, AttributeError) as exc:
                    self.damage.add(ef, lineno, f"{e['ev']} event with unexpected fields ({exc})")
            n += got
            self.lines += got
            if ef.offset == start or (budget is not None and ef.offset - start >= budget):
                break
            if ef.offset >= ef.size and not ef.pending:
                break
        return n

    def read_all(self) -> None:
        for ef in list(self.files):
            self.consume(ef, final=True)

    # ---- agent events
    def _on_agent_start(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        a.info = {k: e.get(k) for k in ("nproc", "nnodes", "max_restarts", "run_id")}
        job.run_id = job.run_id or e.get("run_id")

    def _on_ft_config(self, a: _Agent, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])
        if isinstance(e.get("config"), dict):
            a.ft_config = e["config"]

    def _on_monitor_spawned(self, a: _Agent, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])

    def _on_fork_server_ready(self, a: _Agent, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])

    def _on_rdzv_join(self, a: _Agent, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])
        a.node_id = a.node_id or e.get("node_id")

    def _on_rdzv_round(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        r = int(e["round"])
        rd = job.rounds.get(r)
        if rd is None:
            rd = job.rounds[r] = _Round(job, r, e["t"])
        rd.t = min(rd.t, e["t"])
        rd.nodes = list(e.get("nodes") or rd.nodes)
        rd.world_size = e.get("world_size", rd.world_size)
        rd.restart_count = e.get("restart_count", rd.restart_count)
        rd.waited = e.get("waited", rd.waited)
        a.round = rd

    def _on_rdzv_standby(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("standby", job.index, e.get("round"), a.ef.node), e["t"], "standby",
                   f"node {e.get('node_id') or a.ef.node} waits as a standby: round {e.get('round')} "
                   f"is running with {e.get('nodes')} node(s) ({e.get('reason')})", job=job.index)

    def _on_rank_start(self, a: _Agent, e: dict[str, Any]) -> None:
        rd = a.round
        pid = e.get("pid")
        if isinstance(pid, int):
            a.pids[pid] = (int(e["rank"]), rd)
        if rd is not None:
            rd.running_at = e["t"] if rd.running_at is None else max(rd.running_at, e["t"])

    def _on_rank_exit(self, a: _Agent, e: dict[str, Any]) -> None:
        if a.round is not None and isinstance(e.get("pid"), int):
            a.round.exits.setdefault(e["pid"], e["t"])

    def _on_rank_stuck(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("stuck", a.ef.path, e.get("pid")), e["t"], "rank_stuck",
                   f"rank {e.get('rank')} (pid {e.get('pid')}) did not die after SIGKILL "
                   f"(state {e.get('state')}); abandoned", level="error", job=job.index, rank=e.get("rank"))

    def _on_rdzv_stop(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        r = int(e["round"])
        rd = job.rounds.get(r)
        if rd is None:
            rd = job.rounds[r] = _Round(job, r, e["t"])
        if rd.stop_t is None or e["t"] < rd.stop_t:
            rd.stop = {k: e.get(k) for k in ("kind", "by_node", "detail", "restart_count", "give_up")}
            rd.stop_t = e["t"]
            rd.stop_agent = a
        detail = e.get("detail")
        if e.get("kind") == "node_left" and isinstance(detail, dict) and detail.get("node"):
            job.left_nodes.add(str(detail["node"]))

    def _on_agent_signal(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        if e.get("phase") != "running":  # while running, the interrupted stop record says it
            self._note(("signal", a.ef.path, e["t"]), e["t"], "signal",
                       f"{e.get('signal')} received by the agent of node {a.node_id or a.ef.node} during "
                       f"{e.get('phase')}", level="warn", job=job.index)

    def _on_monitor_died(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("monitor_died", a.ef.path, e.get("pid")), e["t"], "monitor_died",
                   f"the monitor of local rank {e.get('local_rank')} on node {a.node_id or a.ef.node} died "
                   f"(exit code {e.get('returncode')}); restarted", level="warn", job=job.index)

    def _on_monitor_stuck(self, a: _Agent, e: dict[str, Any]) -> None:
        self._note(("monitor_stuck", a.ef.path, e.get("pid")), e["t"], "monitor_stuck",
                   f"a rank monitor (pid {e.get('pid')}) did not exit", level="warn")

    def _on_fork_server_fallback(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("fork_fallback", a.ef.path), e["t"], "fork_server_fallback",
                   f"ranks spawned directly, not forked: {e.get('reason')}", job=job.index)

    def _on_job_end(self, a: _Agent, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        a.ended = True
        job.ends.append({k: e.get(k) for k in ("t", "status", "exit_code", "seconds", "detail")} |
                        {"node": a.node_id or a.ef.node})

    # ---- monitor events
    def _on_monitor_start(self, m: _Monitor, e: dict[str, Any]) -> None:
        if m.configured is not None:
            m.restarts += 1
        self._end_session(m, e["t"], "monitor restarted")
        m.configured = e.get("timeouts")

    def _on_monitor_exit(self, m: _Monitor, e: dict[str, Any]) -> None:
        self._end_session(m, e["t"], f"monitor exited ({e.get('reason')})")

    def _new_session(self, m: _Monitor, e: dict[str, Any]) -> _Session:
        s = m.session
        if s is not None and s.pid == e.get("pid") and s.end_t is None:
            return s
        self._end_session(m, e["t"], "replaced")
        s = _Session(m.ef.node, m.ef.local_rank if m.ef.local_rank is not None else int(e.get("rank", -1)),
                     e.get("pid"), e.get("generation"), e["t"])
        m.session = s
        m.sessions.append(s)
        return s

    def _on_monitor_attach(self, m: _Monitor, e: dict[str, Any]) -> None:
        self._new_session(m, e)

    def _on_monitor_connect(self, m: _Monitor, e: dict[str, Any]) -> None:
        s = self._new_session(m, e)
        s.timeouts = e.get("timeouts")

    def _current(self, m: _Monitor, e: dict[str, Any]) -> _Session:
        s = m.session
        if s is None or s.end_t is not None:  # a file that starts mid-session (rotated, --since)
            s = self._new_session(m, {"t": e["t"], "pid": e.get("pid")})
        return s

    def _on_first_heartbeat(self, m: _Monitor, e: dict[str, Any]) -> None:
        self._current(m, e).first_delay = float(e["delay"])

    def _on_heartbeat_stats(self, m: _Monitor, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        count = int(e.get("count") or 0)
        if self.filters.since is not None and e["t"] < self.filters.since:
            s.hb_base = count  # counts are cumulative per session: --since counts from here
            return
        s.hb_count = max(s.hb_count, count - s.hb_base)
        mi = e.get("max_interval")
        if isinstance(mi, (int, float)):
            s.hb_max_interval = mi if s.hb_max_interval is None else max(s.hb_max_interval, mi)

    def _on_section_open(self, m: _Monitor, e: dict[str, Any]) -> None:
        sec = self._current(m, e).sections.setdefault(str(e["section"]), _Section())
        sec.open_for = float(e.get("open_for") or 0.0)

    def _on_section_close(self, m: _Monitor, e: dict[str, Any]) -> None:
        sec = self._current(m, e).sections.setdefault(str(e["section"]), _Section())
        if self.filters.since is not None and e["t"] < self.filters.since:
            sec.open_for = None
            return
        closes = int(e.get("closes") or 0)
        last = float(e.get("last_duration") or 0.0)
        sec.closes += closes
        sec.last_s = last
        sec.max_s = max(sec.max_s, float(e.get("max_duration") or last))
        total = e.get("total")
        sec.total_s += float(total) if isinstance(total, (int, float)) else closes * last
        sec.open_for = None

    def _on_hang_detected(self, m: _Monitor, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        s.hang = dict(e)
        self.hangs.append((m, s.hang))

    def _on_rank_terminated(self, m: _Monitor, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        if s.hang is not None:
            s.hang["terminated"] = e.get("error") or "signal sent"

    def _on_monitor_disconnect(self, m: _Monitor, e: dict[str, Any]) -> None:
        self._end_session(m, e["t"], str(e.get("reason")))

    def _on_timeouts_set(self, m: _Monitor, e: dict[str, Any]) -> None:
        m.computed, m.computed_t = e.get("timeouts"), e["t"]

    def _on_timeouts_loaded(self, m: _Monitor, e: dict[str, Any]) -> None:
        m.loaded = e.get("timeouts")

    def _on_timeouts_state_ignored(self, m: _Monitor, e: dict[str, Any]) -> None:
        self._note(("state_ignored", m.ef.path, e["t"]), e["t"], "timeouts_state_ignored",
                   f"monitor of local rank {m.ef.local_rank} ignored unusable timeouts state {e.get('path')}: "
                   f"{e.get('error')}", level="warn")

    def _on_monitor_auth_failed(self, m: _Monitor, e: dict[str, Any]) -> None:
        self._note(("auth", m.ef.path, e["t"]), e["t"], "monitor_auth_failed",
                   f"monitor of local rank {m.ef.local_rank} rejected a {e.get('op')} request with a wrong "
                   f"or stale token", level="warn")

    def _end_session(self, m: _Monitor, t: float, reason: str) -> None:
        s = m.session
        if s is not None and s.end_t is None:
            s.end_t, s.end_reason = t, reason
        m.session = None

    # ---- resume driver and unknown sources
    def _generic(self, ef: EventFile, e: dict[str, Any]) -> None:
        """Resume-driver (and other) events: one timeline line of their scalar fields."""
        if e["ev"] not in RESUME_EVENTS:
            key = f"{e.get('src', ef.kind)}/{e['ev']}"
            self.unknown[key] = self.unknown.get(key, 0) + 1
        fields = ", ".join(f"{k}={_short(v)}" for k, v in e.items()
                           if k not in ("v", "t", "src", "ev") and (v is None or isinstance(v, (str, int, float, bool))))
        name = e["ev"]
        level = "info"
        if "decision" in name or "submit" in name:
            level = "ok" if str(e.get("decision", "")).lower() in ("finished", "done") else "warn"
        self._note(("generic", ef.path, ef.lineno, e["t"]), e["t"], f"{e.get('src', ef.kind)}:{name}",
                   f"{e.get('src', ef.kind)}: {name.replace('_', ' ')}" + (f" ({fields})" if fields else ""),
                   level=level)

    def _note(self, key: tuple, t: float, kind: str, text: str, level: str = "info", job: int | None = None,
              rank: int | None = None) -> None:
        self.others.append(_Item(key, t, kind, text, level, job=job, rank=rank))

    # ---- jobs
    def _job_for(self, a: _Agent, t: float) -> _Job:
        """The job this agent file belongs to: one of the same run dir whose life overlaps, else a new one."""
        if a.first_t is None or t < a.first_t:
            a.first_t = t
        if a.job is not None:
            return a.job
        run_dir = a.ef.run_dir
        for job in reversed(self.jobs):
            if job.run_dir == run_dir and job.start <= t and (t <= job.last_t or (self.live and job.open)):
                a.job = job
                break
        else:
            a.job = _Job(len(self.jobs), run_dir, t)
            self.jobs.append(a.job)
        a.job.agents.append(a)
        a.job.start = min(a.job.start, t)
        return a.job

    # ---- the report
    def report(self, now: float | None = None) -> "Report":
        return _ReportBuilder(self, now if now is not None else time.time()).build()


RESUME_EVENTS = frozenset({"resume_attempt_start", "resume_attempt_end", "resume_decision", "resume_submit"})
_AGENT_EVENTS = frozenset({"agent_start", "ft_config", "monitor_spawned", "fork_server_ready", "rdzv_join",
                           "rdzv_round", "rdzv_standby", "rank_start", "rank_exit", "rank_stuck", "rdzv_stop",
                           "agent_signal", "monitor_died", "monitor_stuck", "fork_server_fallback", "job_end"})


def _handler_fits(owner: Any, ev: str) -> bool:
    if isinstance(owner, _Agent):
        return ev in _AGENT_EVENTS
    if isinstance(owner, _Monitor):
        return ev not in _AGENT_EVENTS
    return False


# ------------------------------------------------------------------ report


@dataclass
class Report:
    """Everything `nvrx inspect` shows; plain data (to_dict() is the --json output)."""

    paths: list[str]
    files: dict[str, Any]
    corrupt: dict[str, Any]
    unknown_events: dict[str, int]
    span: dict[str, Any]
    goodput: dict[str, Any]
    jobs: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    timeouts: dict[str, Any]
    filters: dict[str, Any]
    items: list[_Item] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": REPORT_SCHEMA, "paths": self.paths, "filters": self.filters, "files": self.files,
                "corrupt": self.corrupt, "unknown_events": self.unknown_events, "span": self.span,
                "goodput": self.goodput, "jobs": self.jobs, "faults": self.faults, "timeline": self.timeline,
                "ranks": self.ranks, "timeouts": self.timeouts}


class _ReportBuilder:
    def __init__(self, tl: Timeline, now: float) -> None:
        self.tl = tl
        self.f = tl.filters
        self.now = now
        self.agents_by_node = {a.ef.node: a for a in tl.agents.values()}
        self.agents_by_id = {a.node_id: a for a in tl.agents.values() if a.node_id}

    def build(self) -> Report:
        tl = self.tl
        sessions = self._sessions()
        rounds = [rd for job in tl.jobs for rd in sorted(job.rounds.values(), key=lambda r: r.number)]
        faults, items = self._faults(rounds)
        items += self._job_items() + self._round_items(rounds) + self._hang_items(faults)
        items += [it for it in tl.others]
        items = [it for it in items if self._shown(it.t, it.rank)]
        items.sort(key=lambda it: (it.t, it.key[0] != "job"))
        span = self._span()
        return Report(
            paths=sorted({str(ef.run_dir) for ef in tl.files}),
            files=self._files(),
            corrupt={"count": tl.damage.count, "first": list(tl.damage.first)},
            unknown_events=dict(sorted(tl.unknown.items())),
            span=span,
            goodput=self._goodput(rounds, sessions, span),
            jobs=[self._job_dict(job) for job in tl.jobs],
            faults=[f for f in faults if self._shown(f["t"], f.get("rank"))],
            timeline=[it.to_dict() for it in items],
            ranks=self._ranks(sessions),
            timeouts=self._timeouts(sessions),
            filters={"rank": self.f.rank, "since": self.f.since, "since_time": iso(self.f.since),
                     "step_section": self.f.step_section},
            items=items,
        )

    def _shown(self, t: float, rank: int | None) -> bool:
        if self.f.since is not None and t < self.f.since:
            return False
        return self.f.rank is None or rank is None or rank == self.f.rank

    # ---- files
    def _files(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for ef in self.tl.files:
            kinds[ef.kind] = kinds.get(ef.kind, 0) + 1
        return {"count": len(self.tl.files), "by_kind": kinds, "bytes": sum(ef.offset for ef in self.tl.files),
                "lines": self.tl.lines}

    # ---- sessions -> ranks and rounds
    def _sessions(self) -> list[tuple[_Session, int, _Round | None, _Monitor]]:
        """Each monitored rank process with its global rank and round (through the agent's rank_start)."""
        out = []
        for m in self.tl.monitors.values():
            agent = self.agents_by_node.get(m.ef.node)
            for s in m.sessions:
                rank, rd = s.local_rank, None
                if agent is not None and s.pid in agent.pids:
                    rank, rd = agent.pids[s.pid]
                if rd is None:
                    rd = self._round_at(m.ef.run_dir, s.t)
                out.append((s, rank, rd, m))
        return out

    def _round_at(self, run_dir: Path, t: float) -> _Round | None:
        best = None
        for job in self.tl.jobs:
            if job.run_dir != run_dir:
                continue
            for rd in job.rounds.values():
                if rd.t <= t and (best is None or rd.t > best.t):
                    best = rd
        return best

    # ---- span and goodput
    def _span(self) -> dict[str, Any]:
        starts = [job.start for job in self.tl.jobs]
        ends = [job.last_t for job in self.tl.jobs] + [m.last_t for m in self.tl.monitors.values() if m.last_t]
        ends += [it.t for it in self.tl.others]
        starts += [it.t for it in self.tl.others]
        if not starts:
            return {"start": None, "end": None, "wall_s": 0.0, "running": False}
        start = min(starts)
        if self.f.since is not None:
            start = max(start, self.f.since)
        end = max(ends)
        running = any(job.open for job in self.tl.jobs)
        return {"start": start, "start_time": iso(start), "end": end, "end_time": iso(end),
                "wall_s": _r(max(0.0, end - start)), "running": running}

    def _round_end(self, rd: _Round) -> float:
        return rd.stop_t if rd.stop_t is not None else rd.job.last_t

    def _goodput(self, rounds: list[_Round], sessions: list, span: dict[str, Any]) -> dict[str, Any]:
        step = self.f.step_section
        per_round: dict[int, list[float]] = {}
        for s, rank, rd, _ in sessions:
            if rd is None or step not in s.sections or (self.f.rank is not None and rank != self.f.rank):
                continue
            per_round.setdefault(id(rd), []).append(s.sections[step].total_s)
        running = 0.0
        for rd in rounds:
            if rd.running_at is not None:
                begin = max(rd.running_at, self.f.since or rd.running_at)
                running += max(0.0, self._round_end(rd) - begin)
        if per_round:
            method = "step_sections"
            productive = 0.0
            for rd in rounds:
                vals = per_round.get(id(rd))
                if vals:
                    est = sum(vals) / len(vals)
                    if rd.running_at is not None:  # an estimate never exceeds the round's running time
                        est = min(est, max(0.0, self._round_end(rd) - rd.running_at))
                    productive += est
            definition = (f"time ranks spent in section {step!r} (mean over a round's ranks, summed over "
                          "rounds) / wall time")
        else:
            method, productive = "ranks_running", running
            definition = (f"no {step!r} section events: time all ranks of a round were running (last rank start "
                          "to the round's stop) / wall time")
        wall = span.get("wall_s") or 0.0
        return {"method": method, "productive_s": _r(productive), "ranks_running_s": _r(running),
                "wall_s": wall, "ratio": _r(productive / wall, 4) if wall > 0 else None, "definition": definition}

    # ---- faults and stops
    def _faults(self, rounds: list[_Round]) -> tuple[list[dict[str, Any]], list[_Item]]:
        faults, items = [], []
        for rd in rounds:
            if rd.stop is None or rd.stop.get("kind") == "succeeded":
                continue
            f = self._fault(rd)
            faults.append(f)
            level = "error" if f["kind"] in ("failed", "node_left") else "warn"
            items.append(_Item(("stop", rd.job.index, rd.number), f["t_stop"], f["kind"], f["text"], level,
                               job=rd.job.index, round=rd.number, rank=f.get("rank"), tail=f.get("tail") or []))
        return faults, items

    def _fault(self, rd: _Round) -> dict[str, Any]:
        stop = rd.stop or {}
        kind = str(stop.get("kind"))
        d = stop.get("detail") if isinstance(stop.get("detail"), dict) else {}
        f: dict[str, Any] = {"job": rd.job.index, "run_id": rd.job.run_id, "round": rd.number, "kind": kind,
                             "t_stop": rd.stop_t, "by_node": stop.get("by_node"),
                             "restart_count": stop.get("restart_count"), "give_up": bool(stop.get("give_up"))}
        fault_t = rd.stop_t
        if kind == "failed":
            hang = d.get("hang") if isinstance(d.get("hang"), dict) else self._hang_for(d.get("pid"))
            cause = self._failed_cause(d, hang)
            pid = d.get("pid")
            fault_t = rd.exits.get(pid, fault_t) if isinstance(pid, int) else fault_t
            if hang and isinstance(hang.get("t"), (int, float)):
                fault_t = float(hang["t"]) - float(hang.get("elapsed") or 0.0)
            f.update(rank=d.get("rank"), local_rank=d.get("local_rank"), group_rank=d.get("group_rank"), pid=pid,
                     exitcode=d.get("exitcode"), signal=d.get("signal"), hang=hang,
                     tail=[str(x) for x in (d.get("tail") or [])][-TAIL_SHOWN:])
            node = self._node_of_group_rank(rd, d.get("group_rank"))
            if node and len(rd.nodes) > 1:
                cause += f" on node {node}"
        elif kind == "node_left":
            node = d.get("node")
            cause = f"node {node} left (group rank {d.get('group_rank')}; it stopped beating)"
            gone = self.agents_by_id.get(node)
            if gone is not None and gone.last_t:
                fault_t = min(fault_t or gone.last_t, gone.last_t)
            f.update(node=node, group_rank=d.get("group_rank"))
        elif kind == "interrupted":
            sig = d.get("signal")
            cause = f"interrupted by {sig} (preemption or a stop request)" if sig else \
                f"stopped without a stop record (node {d.get('node')})"
            f.update(signal=sig)
        elif kind == "scale_up":
            cause = f"node {d.get('node')} is waiting to join: restarting the round to scale up"
        else:
            cause = kind.replace("_", " ")
        recovered = self._recovered_at(rd)
        f.update(cause=cause, t=fault_t, time=iso(fault_t), recovered_at=recovered,
                 lost_s=_r(recovered - fault_t) if recovered is not None and fault_t is not None else None)
        if kind in ("failed", "node_left"):
            what = "giving up: restarts used up" if f["give_up"] else f"restart {stop.get('restart_count')}"
        elif kind == "interrupted":
            what = "job stops (resumable)"
        else:
            what = "round restarts"
        f["text"] = f"round {rd.number} stopped: {cause}; {what}"
        return f

    def _failed_cause(self, d: dict[str, Any], hang: dict[str, Any] | None) -> str:
        who = f"rank {d.get('rank')}"
        sig, code = d.get("signal"), d.get("exitcode")
        if hang:
            tmpl = HANG_TEXT.get(str(hang.get("reason")), "hung ({reason}) after {elapsed:.1f} s, timeout {timeout:g} s")
            try:
                text = tmpl.format(section=hang.get("section"), elapsed=float(hang.get("elapsed") or 0),
                                   timeout=float(hang.get("timeout") or 0), reason=hang.get("reason"))
            except (TypeError, ValueError):
                text = f"hung ({hang.get('reason')})"
            return f"{who} {text} (killed with {hang.get('signal') or sig} by its monitor)"
        if d.get("abandoned"):
            return f"{who} could not be killed (stuck in the kernel) and was abandoned"
        if sig:
            if sig in CRASH_SIGNALS:
                return f"{who} crashed with {sig}"
            return f"{who} was killed by {sig}" + (" (out of memory?)" if sig == "SIGKILL" else "")
        if code == 127 and d.get("pid") == -1:
            return f"{who} could not be started"
        meaning = _EXIT_MEANINGS.get(code)
        return f"{who} exited with code {code}" + (f" ({meaning})" if meaning else "")

    def _hang_for(self, pid: Any) -> dict[str, Any] | None:
        for _, hang in self.tl.hangs:
            if hang.get("pid") == pid:
                return hang
        return None

    def _node_of_group_rank(self, rd: _Round, g: Any) -> str | None:
        return rd.nodes[g] if isinstance(g, int) and 0 <= g < len(rd.nodes) else None

    def _recovered_at(self, rd: _Round) -> float | None:
        """When all ranks ran again after RD stopped: the next round of its job, else the next job."""
        later = [r for r in rd.job.rounds.values() if r.number > rd.number and r.running_at is not None]
        if later:
            return min(later, key=lambda r: r.number).running_at
        for job in self.tl.jobs:
            if job.start >= (rd.stop_t or rd.t) and job is not rd.job:
                firsts = [r.running_at for r in job.rounds.values() if r.running_at is not None]
                if firsts:
                    return min(firsts)
        return None

    def _hang_items(self, faults: list[dict[str, Any]]) -> list[_Item]:
        """Hangs a monitor detected that are not the cause of a stop (e.g. a second rank hung too)."""
        explained = {(f.get("hang") or {}).get("pid") for f in faults}
        items = []
        for m, hang in self.tl.hangs:
            if hang.get("pid") in explained:
                continue
            agent = self.agents_by_node.get(m.ef.node)
            rank = agent.pids[hang["pid"]][0] if agent and hang.get("pid") in agent.pids else hang.get("rank")
            tmpl = HANG_TEXT.get(str(hang.get("reason")), "hung ({reason})")
            try:
                text = tmpl.format(section=hang.get("section"), elapsed=float(hang.get("elapsed") or 0),
                                   timeout=float(hang.get("timeout") or 0), reason=hang.get("reason"))
            except (TypeError, ValueError):
                text = f"hung ({hang.get('reason')})"
            items.append(_Item(("hang", str(m.ef.path), hang.get("t")), hang["t"], "hang_detected",
                               f"rank {rank} {text}; monitor sent {hang.get('signal')}", "warn", rank=rank))
        return items

    # ---- jobs and rounds
    def _job_status(self, job: _Job) -> tuple[str, int | None]:
        codes = [e.get("exit_code") for e in job.ends if isinstance(e.get("exit_code"), int)]
        statuses = [str(e.get("status")) for e in job.ends]
        if job.open:
            missing = [a for a in job.agents if not a.ended]
            recent = any(self.now - a.last_t < 120 for a in missing)
            return ("running" if recent else "no end record (agent killed, or still running)"), None
        code = max(codes, key=lambda c: (c != 0, c)) if codes else None
        if code is not None and exit_codes.interrupted_signal(code) is not None:
            return "interrupted", code
        if code in exit_codes.STEERING_CODES:
            return "stopped by a rank's exit code", code
        if "failed" in statuses:
            return "failed", code
        if statuses and all(s in ("succeeded", "already_finished") for s in statuses):
            return "succeeded", code
        return (statuses[0] if statuses else "unknown"), code

    def _job_dict(self, job: _Job) -> dict[str, Any]:
        status, code = self._job_status(job)
        rounds = sorted(job.rounds.values(), key=lambda r: r.number)
        return {"index": job.index, "run_id": job.run_id, "run_dir": str(job.run_dir), "start": job.start,
                "start_time": iso(job.start), "end": job.last_t, "end_time": iso(job.last_t),
                "seconds": _r(job.last_t - job.start), "status": status, "exit_code": code,
                "exit_meaning": exit_meaning(code), "nodes": sorted({a.node_id or str(a.ef.node) for a in job.agents}),
                "nproc_per_node": job.info.get("nproc"), "nnodes": job.info.get("nnodes"),
                "max_restarts": job.info.get("max_restarts"),
                "rounds": [self._round_dict(rd) for rd in rounds]}

    def _round_dict(self, rd: _Round) -> dict[str, Any]:
        end = self._round_end(rd)
        return {"round": rd.number, "t": rd.t, "time": iso(rd.t), "nodes": rd.nodes, "world_size": rd.world_size,
                "restart_count": rd.restart_count, "rendezvous_s": rd.waited,
                "ranks_running_at": rd.running_at,
                "start_latency_s": _r(rd.running_at - rd.t) if rd.running_at is not None else None,
                "running_s": _r(end - rd.running_at) if rd.running_at is not None else None,
                "stop": (rd.stop or {}).get("kind"), "stop_t": rd.stop_t}

    def _job_items(self) -> list[_Item]:
        items = []
        for job in self.tl.jobs:
            info = job.info
            nodes = len({a.ef.path for a in job.agents})
            where = f" in {job.run_dir.name}/" if job.run_dir.name != job.run_id else ""
            items.append(_Item(("job", job.index), job.start, "job_start",
                               f"job {job.run_id or '?'} started{where}: {nodes} agent(s), nnodes "
                               f"{info.get('nnodes')}, {info.get('nproc')} rank(s) per node, max restarts "
                               f"{info.get('max_restarts')}", job=job.index))
            status, code = self._job_status(job)
            if job.open:
                text, level, t = f"job {job.run_id or '?'}: {status}; last event", "warn", job.last_t
            else:
                meaning = exit_meaning(code)
                text = (f"job {job.run_id or '?'} {status} (exit code {code}" + (f": {meaning}" if meaning else "")
                        + f") after {job.last_t - job.start:.1f} s")
                level = {"succeeded": "ok", "interrupted": "warn"}.get(status, "error")
                t = job.last_t
            items.append(_Item(("job_end", job.index), t, "job_end", text, level, job=job.index))
        return items

    def _round_items(self, rounds: list[_Round]) -> list[_Item]:
        items = []
        for rd in rounds:
            running = (f"; all ranks running {rd.running_at - rd.t:.2f} s later" if rd.running_at is not None
                       else "; ranks not started")
            items.append(_Item(("round", rd.job.index, rd.number), rd.t, "round",
                               f"round {rd.number}: {len(rd.nodes)} node(s), world size {rd.world_size}, "
                               f"restarts so far {rd.restart_count}{running}", job=rd.job.index, round=rd.number))
        return items

    # ---- ranks and timeouts
    def _ranks(self, sessions: list) -> list[dict[str, Any]]:
        by_rank: dict[Any, dict[str, Any]] = {}
        step = self.f.step_section
        for s, rank, rd, m in sessions:
            if self.f.rank is not None and rank != self.f.rank:
                continue
            if self.f.since is not None and (s.end_t or self.now) < self.f.since:
                continue
            r = by_rank.setdefault(rank, {"rank": rank, "nodes": set(), "sessions": 0, "heartbeats": 0,
                                          "hb_max_interval_s": None, "first_heartbeat_max_s": None, "hangs": 0,
                                          "sections": {}, "monitor_restarts": 0, "_mons": set()})
            r["nodes"].add(str(m.ef.node))
            r["sessions"] += 1
            r["heartbeats"] += s.hb_count
            r["hb_max_interval_s"] = _max(r["hb_max_interval_s"], s.hb_max_interval)
            r["first_heartbeat_max_s"] = _max(r["first_heartbeat_max_s"], s.first_delay)
            r["hangs"] += 1 if s.hang else 0
            if id(m) not in r["_mons"]:
                r["_mons"].add(id(m))
                r["monitor_restarts"] += m.restarts
            for name, sec in s.sections.items():
                agg = r["sections"].setdefault(name, _Section())
                agg.closes += sec.closes
                agg.max_s = max(agg.max_s, sec.max_s)
                agg.last_s = sec.last_s if sec.last_s is not None else agg.last_s
                agg.total_s += sec.total_s
            if s.end_t is None and rd is not None and rd.stop_t is None:
                r["open_sections"] = {n: _r(x.open_for) for n, x in s.sections.items() if x.open_for is not None}
        out = []
        for rank in sorted(by_rank, key=lambda x: (x is None, x)):
            r = by_rank[rank]
            r.pop("_mons")
            r["nodes"] = sorted(r["nodes"])
            r["hb_max_interval_s"] = _r(r["hb_max_interval_s"], 6)
            r["first_heartbeat_max_s"] = _r(r["first_heartbeat_max_s"], 6)
            r["sections"] = {n: sec.to_dict() for n, sec in sorted(r["sections"].items(), key=lambda kv: kv[0] != step)}
            out.append(r)
        return out

    def _timeouts(self, sessions: list) -> dict[str, Any]:
        configured = next((job.ft_config for job in self.tl.jobs if job.ft_config), None)
        in_force, computed = {}, {}
        rank_of_monitor: dict[int, Any] = {}
        for s, rank, _, m in sessions:
            rank_of_monitor[id(m)] = rank
        for m in self.tl.monitors.values():
            rank = rank_of_monitor.get(id(m), m.ef.local_rank)
            if self.f.rank is not None and rank != self.f.rank:
                continue
            key = f"{rank}" if rank is not None else f"{m.ef.node}/{m.ef.local_rank}"
            last = next((s.timeouts for s in reversed(m.sessions) if s.timeouts), None) or m.loaded or m.configured
            if last is not None:
                in_force[key] = last
            if m.computed is not None:
                computed[key] = {"t": m.computed_t, "time": iso(m.computed_t), "timeouts": m.computed}
        return {"configured": configured, "in_force": in_force, "computed": computed}


# ------------------------------------------------------------------ helpers

_EXIT_MEANINGS = {
    exit_codes.OK: "finished",
    exit_codes.FAILED: "failed",
    exit_codes.USAGE: "usage error",
    exit_codes.RESUME_ELSEWHERE: "resume on different hardware",
    exit_codes.VALIDATION_FAILED: "failed result validation, stop",
    exit_codes.DO_NOT_REQUEUE: "do not requeue",
}


def exit_meaning(code: Any) -> str | None:
    """A short meaning of an agent exit code (launcher.exit_codes)."""
    if not isinstance(code, int):
        return None
    sig = exit_codes.interrupted_signal(code)
    if sig is not None:
        return f"stopped on {sig.name}, resumable"
    return _EXIT_MEANINGS.get(code)


def iso(t: float | None) -> str | None:
    """Local ISO time with milliseconds."""
    if t is None:
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
    except (OverflowError, ValueError, OSError):
        return None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _short(v: Any, limit: int = 80) -> str:
    s = str(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def build_report(paths: list[Path], filters: Filters | None = None) -> Report:
    """One-shot: discover event files under PATHS, fold them all, return the report (raises NotARun)."""
    tl = Timeline(filters)
    tl.add_files(discover(paths))
    tl.read_all()
    return tl.report()
