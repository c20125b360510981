"""The report `nvrx inspect` shows, derived from a folded Timeline: causes, time lost, uptime, goodput, stats.

``make_report(timeline)`` turns the per-file state that ``nvrx.inspection.timeline`` folded into plain data:
jobs with their rounds, every stop with a cause a person can act on, the time each fault cost, uptime and
goodput, per-rank heartbeat and section statistics and the timeouts (configured, in force, computed).
``Report.to_dict()`` is the ``--json`` output, except that the timeline's structured entries (``text`` None: the
resume driver's events, job ends) are worded by the renderer (``nvrx.nvrx_cli.inspect_text.report_dict``). Numbers
are data here (seconds, ratios, ISO times); their display is the CLI's. Definitions are in
``nvrx.inspection.timeline``'s docstring.

A hang's cause has one source: the monitor's ``hang_detected`` event. The agent reads it back from the
monitor's event file when the rank's exit ends the round and copies it into the stop record
(``rdzv_stop.detail.hang``), which every agent of the job logs, so the report takes a stop's hang from
the stop record alone; the monitor's events add only the hangs no stop explains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvrx.events import SCHEMA_VERSION, AgentStart, HangInfo, JobEnd, RankErrorInfo, RdzvStop, StopDetail
from nvrx.inspection import jit_outcome
from nvrx.inspection.event_files import NotARun, discover, iso
from nvrx.inspection.timeline import (STEP_SECTIONS, Entry, Filters, JobState, MonitorFile, RankSession,
                                          RoundState, SectionTally, Timeline, node_name, rounded)
from nvrx.common import exit_codes

REPORT_SCHEMA = 2  # 2: uptime / goodput / goodput_source replace the one "goodput" ratio that was uptime
LIVE_WINDOW = 120.0  # s: an open job whose files changed this recently is shown as running
TAIL_SHOWN = 20
HANG_SHOWN = (HangInfo.F.t, HangInfo.F.reason, HangInfo.F.section, HangInfo.F.elapsed, HangInfo.F.timeout,
              HangInfo.F.signal)  # a rank's hangs in the JSON report
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL", "SIGSYS", "SIGTRAP"})
HANG_TEXT = {
    "section_timeout": "hung in section {section!r} after {elapsed:.1f} s, timeout {timeout:g} s",
    "heartbeat_timeout": "hung: no heartbeat for {elapsed:.1f} s, timeout {timeout:g} s",
    "auto_heartbeat_timeout": "hung: no heartbeat for {elapsed:.2f} s, automatic timeout {timeout:g} s",
    "no_first_heartbeat": "hung: no first heartbeat after {elapsed:.1f} s, timeout {timeout:g} s",
    "out_of_section_timeout": "hung outside any section for {elapsed:.1f} s, timeout {timeout:g} s",
}


def make_report(tl: Timeline, now: float | None = None) -> "Report":
    """The report of everything TL has folded so far (NOW decides whether an open job looks alive)."""
    return _ReportBuilder(tl, now if now is not None else time.time()).build()


@dataclass
class Report:
    """Everything `nvrx inspect` shows; plain data (to_dict() is the --json output, structured entries unworded).

    ITEMS are the timeline's entries, TIMELINE the same entries as dicts, in the same order.
    """

    paths: list[str]
    files: dict[str, Any]
    corrupt: dict[str, Any]
    unknown_events: dict[str, int]
    span: dict[str, Any]
    uptime: float | None
    goodput: float | None
    goodput_source: str | None
    time_accounting: dict[str, Any]
    jobs: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    timeouts: dict[str, Any]
    filters: dict[str, Any]
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_interval: dict[str, Any] | None = None  # the last interval every_steps="auto" chose, and why
    jit_checkpoints: list[dict[str, Any]] = field(default_factory=list)  # --jit-ckpt: each fault's outcome
    health: list[dict[str, Any]] = field(default_factory=list)
    series: list[dict[str, Any]] = field(default_factory=list)
    goodput_scope: str = "job"   # whose progress: "job", or "rank N" / "node NAME" under --rank / --node
    items: list[Entry] = field(default_factory=list, repr=False)
    lanes: dict[str, list[tuple[Any, float, float | None, float | None]]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": REPORT_SCHEMA, "paths": self.paths, "filters": self.filters, "files": self.files,
                "corrupt": self.corrupt, "unknown_events": self.unknown_events, "span": self.span,
                "uptime": self.uptime, "goodput": self.goodput, "goodput_source": self.goodput_source,
                "goodput_scope": self.goodput_scope,
                "time_accounting": self.time_accounting, "jobs": self.jobs, "faults": self.faults, "timeline": self.timeline,
                "ranks": self.ranks, "timeouts": self.timeouts, "checkpoints": self.checkpoints,
                "checkpoint_interval": self.checkpoint_interval, "jit_checkpoints": self.jit_checkpoints,
                "health": self.health, "series": self.series}


class _ReportBuilder:
    def __init__(self, tl: Timeline, now: float) -> None:
        self.tl = tl
        self.f = tl.filters
        self.now = now
        self.agents_by_node = {(a.ef.run_dir, a.ef.node): a for a in tl.agents.values()}  # a pid may recur per run
        self.agents_by_id = {a.node_id: a for a in tl.agents.values() if a.node_id}
        self.per_round: dict[int, tuple[float, float]] = {}  # id(round) -> (progress, kept) seconds

    def build(self) -> Report:
        tl = self.tl
        sessions = self._sessions()
        rounds = [rd for job in tl.jobs for rd in sorted(job.rounds.values(), key=lambda r: r.number)]
        faults, items = self._faults(rounds)
        jits, jit_items = self._jit_checkpoints(faults)
        items += jit_items + self._job_items() + self._round_items(rounds) + self._hang_items(faults)
        items += tl.others
        self._tie_to_jobs(items)
        items = [it for it in items if self._shown(it.t, it.rank, it.node)]
        items.sort(key=lambda it: (it.t, it.key[0] != "job"))
        span = self._span()
        acct = self._time_accounting(rounds, sessions, span)
        acct["job_stops"] = len(faults)  # before --rank / --node narrow the faults to theirs
        acct["job_lost_s"] = rounded(sum(f.get("lost_s") or 0.0 for f in faults))
        faults = [f for f in faults if self._shown(f["t"], f.get("rank"), f.get("node"))]
        return Report(
            paths=sorted({str(ef.run_dir) for ef in tl.files}),
            files=self._files(),
            corrupt={"count": tl.damage.count, "first": list(tl.damage.first),
                     "other_versions": dict(sorted(tl.other_versions.items()))},
            unknown_events=dict(sorted(tl.unknown.items())),
            span=span,
            uptime=acct["uptime"],
            goodput=acct["goodput"],
            goodput_source=acct["goodput_source"],
            time_accounting=acct,
            jobs=[self._job_dict(job) for job in tl.jobs],
            faults=faults,
            timeline=[it.to_dict() for it in items],
            ranks=self._ranks(sessions),
            timeouts=self._timeouts(sessions),
            filters={"rank": self.f.rank, "node": self.f.node, "since": self.f.since, "since_time": iso(self.f.since),
                     "step_section": self.f.step_section, "ckpt_section": self.f.ckpt_section},
            checkpoints=self._checkpoints(sessions),
            checkpoint_interval=tl.ckpt_interval,
            jit_checkpoints=jits,
            health=self._health(),
            series=self._series(rounds, faults, span),
            goodput_scope=self.scope,
            items=items,
            lanes=self._lanes(sessions),
        )

    def _shown(self, t: float, rank: int | None, node: str | None = None) -> bool:
        if self.f.since is not None and t < self.f.since:
            return False
        if self.f.node is not None and node is not None and node != self._node_filter:
            return False
        return self.f.rank is None or rank is None or rank == self.f.rank

    @property
    def _node_filter(self) -> str | None:
        """--node as the report names nodes (a node id is accepted too)."""
        if self.f.node is None:
            return None
        a = self.agents_by_id.get(self.f.node)
        return a.name if a is not None else node_name(self.f.node, self.tl.names)

    def name_of(self, node_id: Any) -> str | None:
        """A node id (rendezvous records) as the report names that node: its agent file's name."""
        if node_id is None:
            return None
        a = self.agents_by_id.get(str(node_id))
        return a.name if a is not None else node_name(node_id, self.tl.names)

    def _tie_to_jobs(self, items: list[Entry]) -> None:
        """Give every entry its job: resume-driver and re-run entries carry none, so they get the job they concern
        (the one running at their time; between jobs, an attempt's start the next job, anything else the last)."""
        jobs = sorted(self.tl.jobs, key=lambda j: j.start)
        if not jobs:
            return
        for it in items:
            if it.job is not None:
                continue
            inside = [j for j in jobs if j.start <= it.t <= j.last_t]
            if inside:
                it.job = inside[-1].index
                continue
            before = [j for j in jobs if j.start <= it.t]
            after = [j for j in jobs if j.start > it.t]
            if after and (not before or it.form in ("resume_start", "resume_attempt_start")):
                it.job = after[0].index
            else:
                it.job = before[-1].index

    # ---- files
    def _files(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for ef in self.tl.files:
            kinds[ef.kind] = kinds.get(ef.kind, 0) + 1
        return {"count": len(self.tl.files), "by_kind": kinds, "bytes": sum(ef.offset for ef in self.tl.files),
                "lines": self.tl.lines}

    # ---- sessions -> ranks and rounds
    def _sessions(self) -> list[tuple[RankSession, int, RoundState | None, MonitorFile]]:
        """Each monitored rank process with its global rank and round (through the agent's rank_start)."""
        out = []
        for m in self.tl.monitors.values():
            agent = self.agents_by_node.get((m.ef.run_dir, m.ef.node))
            for s in m.sessions:
                rank, rd = s.local_rank, None
                if agent is not None and s.pid in agent.pids:
                    rank, rd = agent.pids[s.pid]
                if rd is None:
                    rd = self._round_at(m.ef.run_dir, s.t)
                out.append((s, rank, rd, m))
        return out

    def _round_at(self, run_dir: Path, t: float) -> RoundState | None:
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
        running = any(job.open and self._alive(job) for job in self.tl.jobs)
        return {"start": start, "start_time": iso(start), "end": end, "end_time": iso(end),
                "wall_s": rounded(max(0.0, end - start)), "running": running}

    def _round_end(self, rd: RoundState) -> float:
        return rd.stop_t if rd.stop_t is not None else rd.job.last_t

    def _round_redone(self, rd: RoundState) -> bool:
        """RD's work after the last checkpoint is done again: it ended other than by succeeding."""
        if rd.stop is None:  # in a job that ended all the same (its agents killed, e.g. by the time limit)
            return not rd.job.open
        return rd.stop.get(RdzvStop.F.kind) != "succeeded"

    def _in_scope(self, rank: Any, m: MonitorFile) -> bool:
        """Whether a rank process counts toward the figures: --rank and --node narrow them to that rank or node."""
        if self.f.rank is not None and rank != self.f.rank:
            return False
        return self.f.node is None or self.tl.node_of(m) == self._node_filter

    @property
    def scope(self) -> str:
        """Whose progress the goodput is: the job's, or the filtered rank's or node's ranks'."""
        if self.f.rank is not None:
            return f"rank {self.f.rank}"
        if self.f.node is not None:
            return f"node {self._node_filter}"
        return "job"

    def _progress_source(self, sessions: list) -> tuple[str, str | None] | None:
        """Which progress the goodput is measured by: ("section", name), ("heartbeats" | "auto", None) or None."""
        names = [self.f.step_section] if self.f.step_section else list(STEP_SECTIONS)
        mine = [s for s, rank, _, m in sessions if self._in_scope(rank, m)]
        for name in names:
            if any(name in s.sections and s.sections[name].closes for s in mine):
                return "section", name
        if any(s.first_hb_t is not None or s.hb_count for s in mine):
            return "heartbeats", None
        if any(s.auto for s in mine):
            return "auto", None
        return None

    def _session_progress(self, s: RankSession, source: tuple[str, str | None]) -> tuple[float, float] | None:
        """(seconds of progress, of which before the last checkpoint) of one rank process, or None."""
        kind, name = source
        if kind == "section":
            sec = s.sections.get(name or "")
            if sec is None:
                return None
            at_ckpt = s.totals_at_ckpt.get(name or "", 0.0) if s.ckpt_t is not None else 0.0
            return sec.total_s, min(at_ckpt, sec.total_s)
        first = s.first_hb_t if s.first_hb_t is not None else (s.t if s.auto else None)
        lasts = [x for x in (s.last_hb_t, s.last_auto_t) if x is not None]
        last = max(lasts) if lasts else None
        hang = s.hang or {}
        if isinstance(hang.get(HangInfo.F.t), (int, float)):  # no progress since the moment the hang began
            stalled = float(hang[HangInfo.F.t]) - float(hang.get(HangInfo.F.elapsed) or 0.0)
            last = stalled if last is None else min(last, stalled)
        if first is None or last is None:
            return None
        if self.f.since is not None:
            first = max(first, self.f.since)
        total = max(0.0, last - first)
        at_ckpt = max(0.0, min(s.ckpt_t, last) - first) if s.ckpt_t is not None else 0.0
        return total, min(at_ckpt, total)

    def _time_accounting(self, rounds: list[RoundState], sessions: list, span: dict[str, Any]) -> dict[str, Any]:
        """Uptime (all ranks running) and goodput (kept progress, from the first progress source) over wall time."""
        wall = span.get("wall_s") or 0.0
        up = 0.0
        for rd in rounds:
            if rd.running_at is not None:
                begin = max(rd.running_at, self.f.since or rd.running_at)
                up += max(0.0, self._round_end(rd) - begin)
        out: dict[str, Any] = {
            "wall_s": wall, "uptime_s": rounded(up), "uptime": rounded(up / wall, 4) if wall > 0 else None,
            "goodput": None, "goodput_source": None, "progress_s": None, "kept_s": None, "recomputed_s": None,
            "recompute": None, "scope": self.scope, "job_goodput": None,
            "definitions": {
                "uptime": "time all ranks of a round were running (last rank start to the round's stop) / wall time",
                "goodput": "progress kept (not redone after a restart) / wall time; progress from the step section, "
                           "else heartbeats (explicit, else automatic); none without a progress source; with --rank or "
                           "--node, of that rank's or node's ranks (job_goodput: the whole job's)",
            }}
        source = self._progress_source(sessions)
        if source is None:
            return out
        ckpt_known = any(s.ckpt_t is not None for s, _, _, _ in sessions)
        progress, kept = self._round_progress(rounds, sessions, source, ckpt_known)
        if self.scope != "job" and wall > 0:
            out["job_goodput"] = rounded(self._round_progress(rounds, sessions, source, ckpt_known, False)[1] / wall, 4)
        label = {"section": f"{source[1]!r} sections", "heartbeats": "heartbeats",
                 "auto": "automatic heartbeats"}[source[0]]
        ckpt = self.f.ckpt_section
        if self.tl.ckpt_reported:
            recompute = ("progress after the state of the last checkpoint reported complete (nvrx's checkpointers) "
                         "in a round that did not succeed")
        elif ckpt_known:
            recompute = f"progress after the last {ckpt!r} section of a round that did not succeed"
        else:
            recompute = (f"unknown: no complete checkpoints reported and no {ckpt!r} sections, so all progress "
                         "counts")
        out.update(goodput=rounded(kept / wall, 4) if wall > 0 else None, goodput_source=label,
                   progress_s=rounded(progress), kept_s=rounded(kept),
                   recomputed_s=rounded(progress - kept) if ckpt_known else None, recompute=recompute,
                   checkpoints="reported" if self.tl.ckpt_reported else "section" if ckpt_known else None)
        return out

    def _round_progress(self, rounds: list[RoundState], sessions: list, source: tuple[str, str | None],
                        ckpt_known: bool, scoped: bool = True) -> tuple[float, float]:
        """Progress and kept progress, summed over rounds of the mean over each round's ranks (SCOPED: only the ranks
        --rank / --node select; those are the figures over time, too)."""
        per_round: dict[int, list[tuple[float, float]]] = {}
        for s, rank, rd, m in sessions:
            if rd is None or (scoped and not self._in_scope(rank, m)):
                continue
            p = self._session_progress(s, source)
            if p is not None:
                per_round.setdefault(id(rd), []).append(p)
        progress = kept = 0.0
        for rd in rounds:
            vals = per_round.get(id(rd))
            if not vals:
                continue
            done = sum(v[0] for v in vals) / len(vals)
            saved = sum(v[1] for v in vals) / len(vals) if ckpt_known and self._round_redone(rd) else done
            if rd.running_at is not None:  # an estimate never exceeds the round's running time
                done = min(done, max(0.0, self._round_end(rd) - rd.running_at))
            progress += done
            kept += min(saved, done)
            if scoped:
                self.per_round[id(rd)] = (done, min(saved, done))
        return progress, kept

    # ---- faults and stops
    def _faults(self, rounds: list[RoundState]) -> tuple[list[dict[str, Any]], list[Entry]]:
        faults, items = [], []
        for rd in rounds:
            if rd.stop is None or rd.stop.get(RdzvStop.F.kind) == "succeeded":
                continue
            f = self._fault(rd)
            faults.append(f)
            level = "error" if f["kind"] in ("failed", "node_left") else "warn"
            items.append(Entry(("stop", rd.job.index, rd.number), f["t_stop"], f["kind"], f["text"], level,
                               job=rd.job.index, round=rd.number, rank=f.get("rank"), tail=f.get("tail") or []))
        return faults, items

    def _jit_checkpoints(self, faults: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Entry]]:
        """--jit-ckpt: each fault's just-in-time checkpoint merged over its nodes (``jit_outcome``), set on the fault
        (``jit_checkpoint``, None without one) and one timeline entry per fault; a JIT record whose stop is not in the
        logs still gets its entry."""
        by_round = {(f["job"], f["round"]): f for f in faults}
        for f in faults:
            f["jit_checkpoint"] = None
        ckpts = [(t, step) for m in self.tl.monitors.values() for s in m.sessions for t, _, step, _, _ in s.ckpts]
        out, items = [], []
        for job in self.tl.jobs:
            for number, events in sorted(job.jit.items()):
                j = {"job": job.index, "round": number} | jit_outcome.merge(events, ckpts, self._went_on(job, number))
                out.append(j)
                if (job.index, number) in by_round:
                    by_round[(job.index, number)]["jit_checkpoint"] = j
                items.append(Entry(("jit", job.index, number), j["t"], "jit_checkpoint", f"round {number}: {j['text']}",
                                   jit_outcome.level(j), job=job.index, round=number, node=j.get("node")))
        return out, items

    def _went_on(self, job: JobState, number: int) -> bool:
        """Whether training went on after round NUMBER of JOB stopped: a later round's ranks ran, or a later job."""
        later = any(rd.number > number and rd.running_at is not None for rd in job.rounds.values())
        return later or any(other.index > job.index for other in self.tl.jobs)

    def _fault(self, rd: RoundState) -> dict[str, Any]:
        stop = rd.stop or {}
        S, D = RdzvStop.F, StopDetail.F
        kind = str(stop.get(S.kind))
        d = stop.get(S.detail) if isinstance(stop.get(S.detail), dict) else {}
        f: dict[str, Any] = {"job": rd.job.index, "run_id": rd.job.run_id, "round": rd.number, "kind": kind,
                             "t_stop": rd.stop_t, "by_node": self.name_of(stop.get(S.by_node)),
                             "restart_count": stop.get(S.restart_count), "give_up": bool(stop.get(S.give_up))}
        fault_t = rd.stop_t
        if kind == "failed":
            hang = d.get(D.hang) if isinstance(d.get(D.hang), dict) else None
            cause = self._failed_cause(d, hang, stop.get(S.by_node))
            pid = d.get(D.pid)
            fault_t = rd.exits.get(pid, fault_t) if isinstance(pid, int) else fault_t
            if hang and isinstance(hang.get(HangInfo.F.t), (int, float)):
                fault_t = float(hang[HangInfo.F.t]) - float(hang.get(HangInfo.F.elapsed) or 0.0)
            node = self._node_of_group_rank(rd, d.get(D.group_rank))
            error = d.get(D.error) if isinstance(d.get(D.error), dict) else {}
            traceback = error.get(RankErrorInfo.F.traceback)
            # the rank's own traceback (its TORCHELASTIC_ERROR_FILE) says more than its last output lines
            tail = str(traceback).splitlines() if traceback else [str(x) for x in (d.get(D.tail) or [])]
            f.update(rank=d.get(D.rank), local_rank=d.get(D.local_rank), group_rank=d.get(D.group_rank), pid=pid,
                     exitcode=d.get(D.exitcode), signal=d.get(D.signal), hang=hang, node=node,
                     tail=tail[-TAIL_SHOWN:])
            if node and len(rd.nodes) > 1:
                cause += f" on node {node}"
        elif kind == "node_left":
            node = self.name_of(d.get(D.node))
            cause = f"node {node} left (group rank {d.get(D.group_rank)}; it stopped beating)"
            gone = self.agents_by_id.get(str(d.get(D.node)))
            if gone is not None and gone.last_t:
                fault_t = min(fault_t or gone.last_t, gone.last_t)
            f.update(node=node, group_rank=d.get(D.group_rank))
        elif kind == "interrupted":
            sig = d.get(D.signal)
            cause = f"interrupted by {sig} (preemption or a stop request)" if sig else \
                f"stopped without a stop record (node {self.name_of(d.get(D.node))})"
            f.update(signal=sig)
        elif kind == "scale_up":
            cause = f"node {self.name_of(d.get(D.node))} is waiting to join: restarting the round to scale up"
        else:
            cause = kind.replace("_", " ")
        recovered = self._recovered_at(rd)
        f.update(cause=cause, t=fault_t, time=iso(fault_t), recovered_at=recovered,
                 lost_s=rounded(recovered - fault_t) if recovered is not None and fault_t is not None else None)
        if kind == "failed" and d.get(D.leaves) and not f["give_up"]:
            what = (f"node(s) {', '.join(str(self.name_of(n)) for n in d[D.leaves])} leave the job (exit {d.get(D.steer)}); the others "
                    "go on in place, a standby taking the place")
        elif kind == "failed" and d.get(D.steer) in exit_codes.STEERING_CODES:
            what = f"no restart in place: the job ends with code {d[D.steer]} for the resume logic"
        elif kind in ("failed", "node_left"):
            what = "giving up: restarts used up" if f["give_up"] else f"restart {stop.get(S.restart_count)}"
        elif kind == "interrupted":
            what = "job stops (resumable)"
        else:
            what = "round restarts"
        f["text"] = f"round {rd.number} stopped: {cause}; {what}"
        return f

    def _failed_cause(self, d: dict[str, Any], hang: dict[str, Any] | None, by_node: Any = None) -> str:
        D = StopDetail.F
        if isinstance(d.get(D.peer_failed), int) and d.get(D.rank) is None:  # --jit-ckpt: nobody named the lost rank
            return (f"a peer of rank {d[D.peer_failed]} was lost without a word from its node (a node lost with its "
                    f"agent?): rank {d[D.peer_failed]}'s collective failed")
        if d.get(D.rank) is None and not d.get(D.describe):  # not written by an agent: say whose record it is
            return f"a failure reported by node {self.name_of(by_node) or '(unnamed)'} that names no rank"
        who = f"rank {d.get(D.rank)}"
        sig, code = d.get(D.signal), d.get(D.exitcode)
        if hang:
            text = hang_text(hang, "hung ({reason}) after {elapsed:.1f} s, timeout {timeout:g} s")
            first = hang.get(HangInfo.F.stalled_first)
            stalled = f"; rank {first} stopped making progress first" if isinstance(first, int) else ""
            return f"{who} {text} (killed with {hang.get(HangInfo.F.signal) or sig} by its monitor){stalled}"
        if d.get(D.monitor_failed):
            return str(d.get(D.describe) or f"the rank monitor of {who} kept dying")
        if d.get(D.abandoned):
            return f"{who} could not be killed (stuck in the kernel) and was abandoned"
        if sig:
            if sig in CRASH_SIGNALS:
                return f"{who} crashed with {sig}"
            return f"{who} was killed by {sig}" + (" (out of memory?)" if sig == "SIGKILL" else "")
        if code == 127 and d.get(D.pid) == -1:
            return f"{who} could not be started"
        if code is None and d.get(D.steer) in exit_codes.STEERING_CODES:  # a workload control request (spec 001)
            return f"{who} asked its monitor to end the job ({_EXIT_MEANINGS.get(d[D.steer])})"
        meaning = _EXIT_MEANINGS.get(code) if code in exit_codes.STEERING_CODES else None
        error = d.get(D.error) if isinstance(d.get(D.error), dict) else {}
        said = (str(error.get(RankErrorInfo.F.message) or "").strip().splitlines() or [""])[0][:200]
        return f"{who} exited with code {code}" + (f" ({meaning})" if meaning else "") + (f": {said}" if said else "")

    def _node_of_group_rank(self, rd: RoundState, g: Any) -> str | None:
        return self.name_of(rd.nodes[g]) if isinstance(g, int) and 0 <= g < len(rd.nodes) else None

    def _recovered_at(self, rd: RoundState) -> float | None:
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

    def _hang_items(self, faults: list[dict[str, Any]]) -> list[Entry]:
        """Hangs a monitor detected that no stop names as its cause (e.g. a second rank hung too)."""
        explained = set()
        for f in faults:
            hang = f.get("hang") or {}
            explained.add((f.get("node"), hang.get(HangInfo.F.pid)))
        items = []
        for m, hang in self.tl.hangs:
            pid = hang.get(HangInfo.F.pid)
            if (self.tl.node_of(m), pid) in explained or (None, pid) in explained:
                continue
            agent = self.agents_by_node.get((m.ef.run_dir, m.ef.node))
            rank = agent.pids[pid][0] if agent and pid in agent.pids else hang.get(HangInfo.F.global_rank)
            text = hang_text(hang, "hung ({reason})")
            items.append(Entry(("hang", str(m.ef.path), hang.get(HangInfo.F.t)), hang[HangInfo.F.t], "hang_detected",
                               f"rank {rank} {text}; monitor sent {hang.get(HangInfo.F.signal)}", "warn", rank=rank,
                               node=self.tl.node_of(m), job=agent.job.index if agent and agent.job else None))
        return items

    # ---- checkpoints, health checks, goodput over time
    def _checkpoints(self, sessions: list) -> list[dict[str, Any]]:
        """Complete checkpoints reported by the ranks, one entry per job, tier and step (over all its ranks)."""
        out: dict[tuple, dict[str, Any]] = {}
        for s, rank, rd, m in sessions:
            if not s.ckpts or (self.f.rank is not None and rank != self.f.rank):
                continue
            if self.f.node is not None and self.tl.node_of(m) != self._node_filter:
                continue
            job = rd.job.index if rd is not None else None
            for t, taken, step, tier, path in s.ckpts:
                c = out.get((job, tier, step))
                if c is None:
                    c = out[(job, tier, step)] = {"job": job, "round": rd.number if rd is not None else None,
                                                  "tier": tier, "step": step, "t": t, "taken": taken, "ranks": 0,
                                                  "path": path}
                c["ranks"] += 1
                c["t"], c["taken"] = max(c["t"], t), min(c["taken"], taken)  # complete when the last rank said so
        items = sorted(out.values(), key=lambda c: c["t"])
        for c in items:
            c["time"] = iso(c["t"])
        return items

    def _lanes(self, sessions: list) -> dict[str, list[tuple[Any, float, float | None, float | None]]]:
        """Per node (as the report names it): each rank process as (global rank, start, end, hang start)."""
        out: dict[str, list[tuple[Any, float, float | None, float | None]]] = {}
        for s, rank, _, m in sessions:
            if (self.f.rank is not None and rank != self.f.rank) or (
                    self.f.node is not None and self.tl.node_of(m) != self._node_filter):
                continue
            hang = s.hang or {}
            hung = (float(hang[HangInfo.F.t]) - float(hang.get(HangInfo.F.elapsed) or 0.0)
                    if isinstance(hang.get(HangInfo.F.t), (int, float)) else None)
            out.setdefault(self.tl.node_of(m), []).append((rank, s.t, s.end_t, hung))
        return out

    def _health(self) -> list[dict[str, Any]]:
        """Per job and round: how many nodes passed their health checks (and how fast), which failed."""
        out: dict[tuple[int, int], dict[str, Any]] = {}
        for job, rnd, node, t, ok, seconds in self.tl.health:
            if self.f.node is not None and node != self._node_filter:
                continue
            h = out.setdefault((job, rnd), {"job": job, "round": rnd, "t": t, "passed": 0, "failed": [],
                                            "min_s": seconds, "max_s": seconds})
            h["t"], h["min_s"], h["max_s"] = min(h["t"], t), min(h["min_s"], seconds), max(h["max_s"], seconds)
            if ok:
                h["passed"] += 1
            else:
                h["failed"].append(node)
        return [out[k] for k in sorted(out)]

    def _series(self, rounds: list[RoundState], faults: list[dict[str, Any]],
                span: dict[str, Any]) -> list[dict[str, Any]]:
        """Goodput and time lost so far at the end of each round (the report's figures are the last point)."""
        start = span.get("start")
        if start is None:
            return []
        points, kept = [], 0.0
        for rd in sorted(rounds, key=lambda r: self._round_end(r)):
            end = self._round_end(rd)
            kept += self.per_round.get(id(rd), (0.0, 0.0))[1]
            lost = sum(f.get("lost_s") or 0.0 for f in faults if f.get("t") is not None and f["t"] <= end)
            wall = end - start
            points.append({"t": end, "job": rd.job.index, "round": rd.number, "kept_s": rounded(kept),
                           "goodput": rounded(kept / wall, 4) if wall > 0 and self.per_round else None,
                           "lost_s": rounded(lost)})
        return points

    # ---- jobs and rounds
    def _job_status(self, job: JobState) -> tuple[str, int | None]:
        """The job's outcome in words that match what happened, and its exit code.

        A node that left (a steering exit code such as 16 after failing its health checks, or as the suspect of a
        re-run) while the others finished does not make the job "stopped": the job succeeded without it. Only a
        code that ended the job for every node is its outcome, and then the words name who asked for it.
        """
        E = JobEnd.F
        if job.open:
            return ("running" if self._alive(job) else "no end record (agent killed, or still running)"), None
        codes = [e.get(E.exit_code) for e in job.ends if isinstance(e.get(E.exit_code), int)]
        statuses = [str(e.get(E.status)) for e in job.ends]
        code = max(codes, key=lambda c: (c != 0, c)) if codes else None
        if code is not None and exit_codes.interrupted_signal(code) is not None:
            return "interrupted", code
        done = [e for e in job.ends if e.get(E.status) in ("succeeded", "already_finished")]
        left = [e for e in job.ends if e.get(E.exit_code) in exit_codes.STEERING_CODES and e.get(E.status) != "failed"]
        if done and len(done) + len(left) == len(job.ends):
            return "; ".join(["succeeded"] + [self._left_words(e) for e in left]), 0
        if code in exit_codes.STEERING_CODES:
            return f"stopped: {self._steer_cause(job, code)}", code
        if "failed" in statuses:
            return "failed", code
        if statuses and all(x in ("succeeded", "already_finished") for x in statuses):
            return "succeeded", code
        return (statuses[0] if statuses else "unknown"), code

    @staticmethod
    def _left_words(end: dict[str, Any]) -> str:
        code = end.get(JobEnd.F.exit_code)
        if end.get(JobEnd.F.detail) == "node health check failed":
            return f"node {end.get('node')} sat out (failed its health checks, exit {code})"
        return f"node {end.get('node')} left the job (exit {code}: {exit_meaning(code)})"

    def _steer_cause(self, job: JobState, code: int) -> str:
        """Who ended JOB with steering exit code CODE: a rank (its exit code or workload request) or failed checks."""
        D = StopDetail.F
        for rd in sorted(job.rounds.values(), key=lambda r: -r.number):
            d = (rd.stop or {}).get(RdzvStop.F.detail)
            if isinstance(d, dict) and d.get(D.steer) == code and d.get(D.rank) is not None:
                how = "exit code" if d.get(D.exitcode) == code else "request through its monitor for exit code"
                return f"rank {d.get(D.rank)}'s {how} {code} ({exit_meaning(code)})"
        sat = [str(e.get("node")) for e in job.ends if e.get(JobEnd.F.detail) == "node health check failed"]
        if sat:
            return f"node(s) {', '.join(sat)} failed their health checks (exit {code}: {exit_meaning(code)})"
        return f"exit code {code} ({exit_meaning(code)})"

    def _alive(self, job: JobState) -> bool:
        """An open job looks alive if its agents or their monitors (heartbeat stats every 30 s) wrote lately."""
        nodes = {a.ef.node for a in job.agents}
        last = max([job.last_t] + [m.last_t for m in self.tl.monitors.values()
                                   if m.ef.node in nodes and m.ef.run_dir == job.run_dir])
        return 0 <= self.now - last < LIVE_WINDOW

    def _job_dict(self, job: JobState) -> dict[str, Any]:
        status, code = self._job_status(job)
        rounds = sorted(job.rounds.values(), key=lambda r: r.number)
        return {"index": job.index, "run_id": job.run_id, "run_dir": str(job.run_dir), "start": job.start,
                "start_time": iso(job.start), "end": job.last_t, "end_time": iso(job.last_t),
                "seconds": rounded(job.last_t - job.start), "status": status, "exit_code": code,
                "exit_meaning": exit_meaning(code), "nodes": sorted({a.name for a in job.agents}),
                "nproc_per_node": job.info.get(AgentStart.F.nproc), "nnodes": job.info.get(AgentStart.F.nnodes),
                "max_restarts": job.info.get(AgentStart.F.max_restarts),
                "rounds": [self._round_dict(rd) for rd in rounds]}

    def _round_dict(self, rd: RoundState) -> dict[str, Any]:
        end = self._round_end(rd)
        return {"round": rd.number, "t": rd.t, "time": iso(rd.t), "nodes": [self.name_of(n) for n in rd.nodes],
                "node_ids": rd.nodes, "world_size": rd.world_size,
                "restart_count": rd.restart_count, "rendezvous_s": rd.waited,
                "ranks_running_at": rd.running_at,
                "start_latency_s": rounded(rd.running_at - rd.t) if rd.running_at is not None else None,
                "running_s": rounded(end - rd.running_at) if rd.running_at is not None else None,
                "stop": (rd.stop or {}).get(RdzvStop.F.kind), "stop_t": rd.stop_t}

    def _job_items(self) -> list[Entry]:
        items = []
        for job in self.tl.jobs:
            info, a = job.info, AgentStart.F
            nodes = len({agent.ef.path for agent in job.agents})
            where = f" in {job.run_dir.name}/" if job.run_dir.name != job.run_id else ""
            items.append(Entry(("job", job.index), job.start, "job_start",
                               f"job {job.run_id or '?'} started{where}: {nodes} agent(s), nnodes "
                               f"{info.get(a.nnodes)}, {info.get(a.nproc)} rank(s) per node, max restarts "
                               f"{info.get(a.max_restarts)}", job=job.index))
            status, code = self._job_status(job)
            failed = [[str(e["node"]), str(e[JobEnd.F.detail])] for e in job.ends
                      if e.get(JobEnd.F.status) == "failed" and e.get(JobEnd.F.detail)]
            errors = "".join(f"; node {node}: {detail}" for node, detail in failed)
            if job.open:  # a state, not an event: --follow does not print it
                items.append(Entry(("job_open", job.index), job.last_t, "job_open",
                                   f"job {job.run_id or '?'}: {status}; its last event so far{errors}", "warn",
                                   job=job.index))
                continue
            level = {"succeeded": "ok", "interrupted": "warn"}.get(status, "error")
            fields = {"run_id": job.run_id, "status": status, "exit_code": code, "exit_meaning": exit_meaning(code),
                      "seconds": job.last_t - job.start, "errors": failed}
            items.append(Entry(("job_end", job.index), job.last_t, "job_end", None, level, job=job.index,
                               form="job_end", fields=fields))
        return items

    def _round_items(self, rounds: list[RoundState]) -> list[Entry]:
        items = []
        for rd in rounds:
            if rd.running_at is not None:
                running = f"; all ranks running {rd.running_at - rd.t:.2f} s later"
            else:
                running = "; starting ranks" if rd.stop_t is None and rd.job.open else "; ranks not started"
            items.append(Entry(("round", rd.job.index, rd.number), rd.t, "round",
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
            if self.f.node is not None and self.tl.node_of(m) != self._node_filter:
                continue
            if self.f.since is not None and (s.end_t or self.now) < self.f.since:
                continue
            r = by_rank.setdefault(rank, {"rank": rank, "nodes": set(), "sessions": 0, "heartbeats": 0,
                                          "auto_heartbeat": False, "hb_max_interval_s": None, "first_heartbeat_max_s": None, "hangs": 0,
                                          "hang_details": [], "sections": {}, "monitor_restarts": 0,
                                          "_mons": set()})
            r["nodes"].add(self.tl.node_of(m))
            r["sessions"] += 1
            r["heartbeats"] += s.hb_count
            r["auto_heartbeat"] = r["auto_heartbeat"] or s.auto  # automatic beats are seen, not counted
            r["hb_max_interval_s"] = max_known(r["hb_max_interval_s"], s.hb_max_interval)
            r["first_heartbeat_max_s"] = max_known(r["first_heartbeat_max_s"], s.first_delay)
            if s.hang:
                r["hangs"] += 1
                r["hang_details"].append({k: s.hang.get(k) for k in HANG_SHOWN})
            if id(m) not in r["_mons"]:
                r["_mons"].add(id(m))
                r["monitor_restarts"] += m.restarts
            for name, sec in s.sections.items():
                agg = r["sections"].setdefault(name, SectionTally())
                agg.closes += sec.closes
                agg.max_s = max(agg.max_s, sec.max_s)
                agg.last_s = sec.last_s if sec.last_s is not None else agg.last_s
                agg.total_s += sec.total_s
            if s.end_t is None and rd is not None and rd.stop_t is None:
                r["open_sections"] = {n: rounded(x.open_for) for n, x in s.sections.items() if x.open_for is not None}
        out = []
        for rank in sorted(by_rank, key=lambda x: (x is None, x)):
            r = by_rank[rank]
            r.pop("_mons")
            r["nodes"] = sorted(r["nodes"])
            r["hb_max_interval_s"] = rounded(r["hb_max_interval_s"], 6)
            r["first_heartbeat_max_s"] = rounded(r["first_heartbeat_max_s"], 6)
            r["sections"] = {n: sec.to_dict() for n, sec in sorted(r["sections"].items(), key=lambda kv: kv[0] != step)}
            out.append(r)
        return out

    def _timeouts(self, sessions: list) -> dict[str, Any]:
        configured = next((job.ft_config for job in self.tl.jobs if job.ft_config), None)
        in_force, computed, auto = {}, {}, {}
        rank_of_monitor: dict[int, Any] = {}
        for s, rank, _, m in sessions:
            rank_of_monitor[id(m)] = rank
        for m in self.tl.monitors.values():
            rank = rank_of_monitor.get(id(m))
            if self.f.rank is not None and rank != self.f.rank:
                continue
            if self.f.node is not None and self.tl.node_of(m) != self._node_filter:
                continue
            key = f"{rank}" if id(m) in rank_of_monitor else f"{self.tl.node_of(m)}/local {m.ef.local_rank}"
            last = next((s.timeouts for s in reversed(m.sessions) if s.timeouts), None) or m.loaded or m.configured
            if last is not None:
                in_force[key] = last
            if m.computed is not None:
                computed[key] = {"t": m.computed_t, "time": iso(m.computed_t), "timeouts": m.computed}
            if m.auto is not None:
                auto[key] = {**m.auto, "time": iso(m.auto.get("t")), "deferred": m.auto_deferred}
        return {"configured": configured, "in_force": in_force, "computed": computed, "auto": auto}


# ------------------------------------------------------------------ helpers

def hang_text(hang: dict[str, Any], unknown: str) -> str:
    """A monitor's hang_detected in words (HANG_TEXT by reason; UNKNOWN is the template for other reasons)."""
    h = HangInfo.F
    tmpl = HANG_TEXT.get(str(hang.get(h.reason)), unknown)
    try:
        return tmpl.format(section=hang.get(h.section), elapsed=float(hang.get(h.elapsed) or 0),
                           timeout=float(hang.get(h.timeout) or 0), reason=hang.get(h.reason))
    except (TypeError, ValueError):
        return f"hung ({hang.get(h.reason)})"


def max_known(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


_EXIT_MEANINGS = {
    exit_codes.OK: "finished",
    exit_codes.FAILED: "failed",
    exit_codes.USAGE: "usage error",
    **exit_codes.STEERING_MEANINGS,
}


def exit_meaning(code: Any) -> str | None:
    """A short meaning of an agent exit code (nvrx.common.exit_codes)."""
    if not isinstance(code, int):
        return None
    sig = exit_codes.interrupted_signal(code)
    if sig is not None:
        return f"stopped on {sig.name}, resumable"
    return _EXIT_MEANINGS.get(code)


def build_report(paths: list[Path], filters: Filters | None = None) -> Report:
    """One-shot: discover event files under PATHS, fold them all, return the report.

    Raises NotARun when there are no event files, or when not one line of them is a usable event.
    """
    tl = Timeline(filters)
    tl.add_files(discover(paths))
    tl.read_all()
    if tl.readable == 0:
        raise NotARun(nothing_readable(paths, tl))
    return make_report(tl)


def nothing_readable(paths: list[Path], tl: Timeline) -> str:
    """Why a set of event files gave no report: every line was empty or corrupt."""
    shown = ", ".join(str(p) for p in paths)
    first = f"; first: {tl.damage.first[0]}" if tl.damage.first else ""
    if tl.other_versions:
        versions = ", ".join(f"{n} of version {v}" for v, n in sorted(tl.other_versions.items()))
        return (f"{shown}: written by another nvrx: {versions} (this nvrx reads event schema version "
                f"{SCHEMA_VERSION}); inspect them with the nvrx version that wrote them")
    return (f"{shown}: nothing readable: {len(tl.files)} event file(s), {tl.lines} line(s), none of them a usable "
            f"event ({tl.damage.count} corrupt{first})")
