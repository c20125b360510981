"""What happened in a run: fold the agents', monitors' and resume driver's events into small state.

``Timeline`` reads event files (whole, or incrementally for ``--follow``) and keeps, per agent file,
monitor file and round, just what ``monitors.inspection.run_report.make_report`` needs to tell a person what
happened: jobs (one ``nvrx launch`` of a run across its nodes), rendezvous rounds, stops with their
details, rank sessions with heartbeat and section tallies, hangs, timeouts, and the resume driver's
decisions as timeline entries.

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

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from monitors.inspection.event_files import Damage, EventFile, event_name, first_event_time, raw_string, read_chunk
from monitors.events import decode_event, field_problem


@dataclass(frozen=True)
class Filters:
    """What the report covers: one global rank, events from a time on, and the training-step section."""

    rank: int | None = None
    since: float | None = None
    step_section: str = "step"


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
    stop: dict[str, Any] | None = None
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
class AgentFile:
    """One agent's event file: which job and round it is in, and its ranks' pids (to name monitor sessions)."""

    ef: EventFile
    job: JobState | None = None
    node_id: str | None = None
    round: RoundState | None = None
    first_t: float | None = None
    last_t: float = 0.0
    ended: bool = False
    info: dict[str, Any] = field(default_factory=dict)       # agent_start fields
    ft_config: dict[str, Any] | None = None
    pids: dict[int, tuple[int, RoundState | None]] = field(default_factory=dict)  # rank pid -> (global rank, round)


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
    end_t: float | None = None
    end_reason: str | None = None
    hb_count: int = 0
    hb_base: int = 0
    hb_max_interval: float | None = None
    first_delay: float | None = None
    sections: dict[str, SectionTally] = field(default_factory=dict)
    timeouts: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None


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
    restarts: int = 0
    last_t: float = 0.0
    deferred_hb: tuple[int, bytes] | None = None                       # see _defer()
    deferred_open: dict[str, tuple[int, bytes]] = field(default_factory=dict)


@dataclass
class Entry:
    """One line of the timeline (KEY identifies it across --follow polls)."""

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
        self.readable = 0  # events folded (or counted as unknown): 0 after reading means nothing usable
        self.jobs: list[JobState] = []
        self.agents: dict[Path, AgentFile] = {}
        self.monitors: dict[Path, MonitorFile] = {}
        self.others: list[Entry] = []         # resume driver and other notable one-off events
        self.hangs: list[tuple[MonitorFile, dict[str, Any]]] = []
        self.live = False  # --follow: an open job extends to the present (its agents write rarely)
        handlers = {name[4:]: getattr(self, name) for name in dir(self) if name.startswith("_on_")}
        self._agent_handlers: dict[str, Callable[[Any, dict[str, Any]], None]] = {
            k: v for k, v in handlers.items() if k in _AGENT_EVENTS}
        self._monitor_handlers: dict[str, Callable[[Any, dict[str, Any]], None]] = {
            k: v for k, v in handlers.items() if k not in _AGENT_EVENTS}

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
        return new

    def consume(self, ef: EventFile, final: bool = True, budget: int | None = None) -> int:
        """Fold EF's unread lines (all of them if BUDGET is None, else about BUDGET bytes); returns lines."""
        owner: Any = self.agents.get(ef.path) or self.monitors.get(ef.path)
        table = (self._agent_handlers if isinstance(owner, AgentFile) else
                 self._monitor_handlers if isinstance(owner, MonitorFile) else {})
        lazy = isinstance(owner, MonitorFile) and final and not self.live and self.filters.since is None
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
                    e = decode_event(raw)
                except ValueError as exc:
                    self.damage.add(ef, i, _damage_reason(raw, exc))
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
                if self._apply(owner, handler, e, i) and lazy and ev == "section_close" and owner.deferred_open:
                    owner.deferred_open.pop(e.get("section"), None)  # a (well-typed) close supersedes the open
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

    def _apply(self, owner: Any, handler: Callable[[Any, dict[str, Any]], None], e: dict[str, Any], lineno: int) -> bool:
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
            m.last_t = max(m.last_t, e["t"])
            handler = self._monitor_handlers.get(e["ev"])
            if handler is not None:
                self._apply(m, handler, e, lineno)

    def read_all(self) -> None:
        for ef in list(self.files):
            self.consume(ef, final=True)

    # ---- agent events
    def _on_agent_start(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        a.info = {k: e.get(k) for k in ("nproc", "nnodes", "max_restarts", "run_id")}
        job.run_id = job.run_id or e.get("run_id")

    def _on_ft_config(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])
        if isinstance(e.get("config"), dict):
            a.ft_config = e["config"]

    def _on_monitor_spawned(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])

    def _on_fork_server_ready(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])

    def _on_rdzv_join(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._job_for(a, e["t"])
        a.node_id = a.node_id or e.get("node_id")

    def _on_rdzv_round(self, a: AgentFile, e: dict[str, Any]) -> None:
        rd = self._round(self._job_for(a, e["t"]), e)
        rd.t = min(rd.t, e["t"])
        rd.nodes = list(e.get("nodes") or rd.nodes)
        rd.world_size = e.get("world_size", rd.world_size)
        rd.restart_count = e.get("restart_count", rd.restart_count)
        rd.waited = e.get("waited", rd.waited)
        a.round = rd

    @staticmethod
    def _round(job: JobState, e: dict[str, Any]) -> RoundState:
        """The round E names in JOB, created at E's time if this is its first event."""
        r = int(e["round"])
        rd = job.rounds.get(r)
        if rd is None:
            rd = job.rounds[r] = RoundState(job, r, e["t"])
        return rd

    def _on_rdzv_standby(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("standby", job.index, e.get("round"), a.ef.node), e["t"], "standby",
                   f"node {e.get('node_id') or a.ef.node} waits as a standby: round {e.get('round')} "
                   f"is running with {e.get('nodes')} node(s) ({e.get('reason')})", job=job.index)

    def _on_rank_start(self, a: AgentFile, e: dict[str, Any]) -> None:
        rd = a.round
        pid = e.get("pid")
        if isinstance(pid, int):
            a.pids[pid] = (int(e["rank"]), rd)
        if rd is not None:
            rd.running_at = e["t"] if rd.running_at is None else max(rd.running_at, e["t"])

    def _on_rank_exit(self, a: AgentFile, e: dict[str, Any]) -> None:
        if a.round is not None and isinstance(e.get("pid"), int):
            a.round.exits.setdefault(e["pid"], e["t"])

    def _on_rank_stuck(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("stuck", a.ef.path, e.get("pid")), e["t"], "rank_stuck",
                   f"rank {e.get('rank')} (pid {e.get('pid')}) did not die after SIGKILL "
                   f"(state {e.get('state')}); abandoned", level="error", job=job.index, rank=e.get("rank"))

    def _on_rdzv_stop(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        rd = self._round(job, e)
        if rd.stop_t is None or e["t"] < rd.stop_t:
            rd.stop = {k: e.get(k) for k in ("kind", "by_node", "detail", "restart_count", "give_up")}
            rd.stop_t = e["t"]
            rd.stop_agent = a
        detail = e.get("detail")
        if e.get("kind") == "node_left" and isinstance(detail, dict) and detail.get("node"):
            job.left_nodes.add(str(detail["node"]))

    def _on_agent_signal(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        if e.get("phase") != "running":  # while running, the interrupted stop record says it
            self._note(("signal", a.ef.path, e["t"]), e["t"], "signal",
                       f"{e.get('signal')} received by the agent of node {a.node_id or a.ef.node} during "
                       f"{e.get('phase')}", level="warn", job=job.index)

    def _on_monitor_died(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("monitor_died", a.ef.path, e.get("pid")), e["t"], "monitor_died",
                   f"the monitor of local rank {e.get('local_rank')} on node {a.node_id or a.ef.node} died "
                   f"(exit code {e.get('returncode')}); restarted", level="warn", job=job.index)

    def _on_monitor_stuck(self, a: AgentFile, e: dict[str, Any]) -> None:
        self._note(("monitor_stuck", a.ef.path, e.get("pid")), e["t"], "monitor_stuck",
                   f"a rank monitor (pid {e.get('pid')}) did not exit", level="warn")

    def _on_fork_server_fallback(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        self._note(("fork_fallback", a.ef.path), e["t"], "fork_server_fallback",
                   f"ranks spawned directly, not forked: {e.get('reason')}", job=job.index)

    def _on_job_end(self, a: AgentFile, e: dict[str, Any]) -> None:
        job = self._job_for(a, e["t"])
        a.ended = True
        job.ends.append({k: e.get(k) for k in ("t", "status", "exit_code", "seconds", "detail")} |
                        {"node": a.node_id or a.ef.node})

    # ---- monitor events
    def _on_monitor_start(self, m: MonitorFile, e: dict[str, Any]) -> None:
        if m.configured is not None:
            m.restarts += 1
        self._end_session(m, e["t"], "monitor restarted")
        m.configured = e.get("timeouts")

    def _on_monitor_exit(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._end_session(m, e["t"], f"monitor exited ({e.get('reason')})")

    def _new_session(self, m: MonitorFile, e: dict[str, Any]) -> RankSession:
        s = m.session
        if s is not None and s.pid == e.get("pid") and s.end_t is None:
            return s
        self._end_session(m, e["t"], "replaced")
        s = RankSession(m.ef.node, m.ef.local_rank if m.ef.local_rank is not None else int(e.get("rank", -1)),
                     e.get("pid"), e.get("generation"), e["t"])
        m.session = s
        m.sessions.append(s)
        return s

    def _on_monitor_attach(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._new_session(m, e)

    def _on_monitor_connect(self, m: MonitorFile, e: dict[str, Any]) -> None:
        s = self._new_session(m, e)
        s.timeouts = e.get("timeouts")

    def _current(self, m: MonitorFile, e: dict[str, Any]) -> RankSession:
        s = m.session
        if s is None or s.end_t is not None:  # a file that starts mid-session (rotated, --since)
            s = self._new_session(m, {"t": e["t"], "pid": e.get("pid")})
        return s

    def _on_first_heartbeat(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._current(m, e).first_delay = float(e["delay"])

    def _on_heartbeat_stats(self, m: MonitorFile, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        count = int(e.get("count") or 0)
        if self.filters.since is not None and e["t"] < self.filters.since:
            s.hb_base = count  # counts are cumulative per session: --since counts from here
            return
        s.hb_count = max(s.hb_count, count - s.hb_base)
        mi = e.get("max_interval")
        if isinstance(mi, (int, float)):
            s.hb_max_interval = mi if s.hb_max_interval is None else max(s.hb_max_interval, mi)

    def _section(self, m: MonitorFile, e: dict[str, Any]) -> SectionTally:
        s = self._current(m, e)
        name = e["section"]
        sec = s.sections.get(name)
        if sec is None:
            sec = s.sections[str(name)] = SectionTally()
        return sec

    def _on_section_open(self, m: MonitorFile, e: dict[str, Any]) -> None:
        sec = self._section(m, e)
        sec.open_for = float(e.get("open_for") or 0.0)

    def _on_section_close(self, m: MonitorFile, e: dict[str, Any]) -> None:
        sec = self._section(m, e)
        sec.open_for = None
        if self.filters.since is not None and e["t"] < self.filters.since:
            return
        closes = e.get("closes") or 0
        last = e.get("last_duration") or 0.0
        sec.closes += int(closes)
        sec.last_s = last
        longest = e.get("max_duration") or last
        if longest > sec.max_s:
            sec.max_s = longest
        total = e.get("total")  # exact, if a monitor writes it; else estimated from the last duration
        sec.total_s += total if isinstance(total, (int, float)) else closes * last

    def _on_hang_detected(self, m: MonitorFile, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        s.hang = dict(e)
        self.hangs.append((m, s.hang))

    def _on_rank_terminated(self, m: MonitorFile, e: dict[str, Any]) -> None:
        s = self._current(m, e)
        if s.hang is not None:
            s.hang["terminated"] = e.get("error") or "signal sent"

    def _on_monitor_disconnect(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._end_session(m, e["t"], str(e.get("reason")))

    def _on_timeouts_set(self, m: MonitorFile, e: dict[str, Any]) -> None:
        m.computed, m.computed_t = e.get("timeouts"), e["t"]

    def _on_timeouts_loaded(self, m: MonitorFile, e: dict[str, Any]) -> None:
        m.loaded = e.get("timeouts")

    def _on_timeouts_state_ignored(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._note(("state_ignored", m.ef.path, e["t"]), e["t"], "timeouts_state_ignored",
                   f"monitor of local rank {m.ef.local_rank} ignored unusable timeouts state {e.get('path')}: "
                   f"{e.get('error')}", level="warn")

    def _on_monitor_auth_failed(self, m: MonitorFile, e: dict[str, Any]) -> None:
        self._note(("auth", m.ef.path, e["t"]), e["t"], "monitor_auth_failed",
                   f"monitor of local rank {m.ef.local_rank} rejected a {e.get('op')} request with a wrong "
                   f"or stale token", level="warn")

    def _end_session(self, m: MonitorFile, t: float, reason: str) -> None:
        s = m.session
        if s is not None and s.end_t is None:
            s.end_t, s.end_reason = t, reason
        m.session = None

    # ---- resume driver and unknown sources
    def _generic(self, ef: EventFile, e: dict[str, Any], lineno: int) -> None:
        """Resume-driver (and other writers') events: one timeline line each; unknown names are counted."""
        name, src = e["ev"], _short(e.get("src", ef.kind), 40)
        fmt = _RESUME_TEXT.get(name)
        text, level = None, "info"
        if fmt is not None:
            try:
                text, level = fmt(_Fields(e))
            except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                text = None
        else:
            key = f"{src}/{name}"
            self.unknown[key] = self.unknown.get(key, 0) + 1
        if text is None:
            fields = ", ".join(f"{k}={_short(v)}" for k, v in e.items() if k not in ("v", "t", "src", "ev")
                               and (v is None or isinstance(v, (str, int, float, bool))))
            text = f"{src}: {name.replace('_', ' ')}" + (f" ({fields})" if fields else "")
        self._note(("generic", ef.path, lineno), e["t"], f"{src}:{name}", text, level=level)

    def _note(self, key: tuple, t: float, kind: str, text: str, level: str = "info", job: int | None = None,
              rank: int | None = None) -> None:
        self.others.append(Entry(key, t, kind, text, level, job=job, rank=rank))

    # ---- jobs
    def _job_for(self, a: AgentFile, t: float) -> JobState:
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
            a.job = JobState(len(self.jobs), run_dir, t)
            self.jobs.append(a.job)
        a.job.agents.append(a)
        a.job.start = min(a.job.start, t)
        return a.job


class _Fields(dict):
    """An event's fields for a format: a missing one reads as '?'."""

    def __missing__(self, key: str) -> str:
        return "?"


def _resume_decision(e: _Fields) -> tuple[str, str]:
    level = {"finished": "ok", "continue": "info", "give_up": "error"}.get(str(e["action"]), "warn")
    reason = str(e["reason"])
    counts = f" (attempts {e['attempts']}, failures {e['failures']})" if "attempts" in e and "attempt" not in reason else ""
    return f"resume decision: {str(e['action']).replace('_', ' ')}: {reason}{counts}", level


def _resume_submit(e: _Fields) -> tuple[str, str]:
    status = e["status"]
    if status == "failed":
        return f"resume: submitting the continuation failed: {e['error']}", "error"
    job = f" job {e['job_id']}" if "job_id" in e else ""
    return f"resume: continuation {status}{job} ({e['method']} from job {e['from_job']})", "info"


def _resume_attempt_end(e: _Fields) -> tuple[str, str]:
    progress = f", progress {e['progress']}" if e.get("progress") is not None else ""
    secs = f" after {duration(float(e['seconds']))}" if isinstance(e.get("seconds"), (int, float)) else ""
    level = "ok" if e.get("finished") else "info" if e["cause"] in ("clean_exit", "interrupted") else "warn"
    return (f"resume: attempt {e['attempt']} ended: exit code {e['exit_code']} ({e['cause']}){secs}{progress}",
            level)


def _where(e: _Fields) -> str:
    parts = [f"job {e['job_id']}" if e.get("job_id") else "", f"node {e['node']}" if e.get("node") else ""]
    return ", ".join(p for p in parts if p)


_RESUME_TEXT: dict[str, Callable[[_Fields], tuple[str, str]]] = {
    "resume_start": lambda e: (f"resume driver started ({'; '.join(x for x in (str(e['mode']), _where(e)) if x)})",
                               "info"),
    "resume_attempt_start": lambda e: (f"resume: attempt {e['attempt']} starts"
                                       + (f" ({_where(e)})" if _where(e) else ""), "info"),
    "resume_attempt_end": _resume_attempt_end,
    "resume_decision": _resume_decision,
    "resume_submit": _resume_submit,
    "resume_signal": lambda e: (f"resume driver got {e['signal']} during attempt {e['attempt']}"
                                f"{' (passed to the launch)' if e.get('forwarded') else ''}", "warn"),
    "resume_end": lambda e: (f"resume driver ends: {str(e['action']).replace('_', ' ')} (exit code {e['exit_code']})",
                             "info"),
    "resume_state_recovered": lambda e: (f"resume state recovered from {e['source']}: {e['note']}", "warn"),
    "resume_reset": lambda e: ("resume state reset (--reset)", "warn"),
}
_AGENT_EVENTS = frozenset({"agent_start", "ft_config", "monitor_spawned", "fork_server_ready", "rdzv_join",
                           "rdzv_round", "rdzv_standby", "rank_start", "rank_exit", "rank_stuck", "rdzv_stop",
                           "agent_signal", "monitor_died", "monitor_stuck", "fork_server_fallback", "job_end"})


_SESSION_BOUNDARIES = frozenset({"monitor_start", "monitor_exit", "monitor_attach", "monitor_connect",
                                 "monitor_disconnect"})
_SECTION_KEY = b'"section":"'


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
    if name == b"heartbeat_stats":
        m.deferred_hb = (lineno, raw)
        return True
    if name == b"section_open":
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


def duration(x: float) -> str:
    """Seconds for a person: 0.25 s, 12.5 s, 4.2 min, 2.87 h."""
    if x >= 7200:
        return f"{x / 3600:.2f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def iso(t: float | None) -> str | None:
    """Local ISO time with milliseconds."""
    if t is None:
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
    except (OverflowError, ValueError, OSError):
        return None


def rounded(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def _short(v: Any, limit: int = 80) -> str:
    s = str(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."
