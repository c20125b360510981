"""The agents' half of straggler detection: gather every rank's timing summary and compare the ranks.

Data flows one way: ranks -> monitors -> agents. Each rank monitor writes a ``rank_timing`` summary of its
rank every ``straggler_report_interval`` (``nvrx.monitors.straggler.TimingSampler``). A thread in every agent
reads its own monitors' newest summaries and publishes them, as one JSON value per node and round, in the
rendezvous store (``nvrx/<run>/straggler/r<round>/n<group rank>``). The agent of group rank 0 also reads
every node's value and scores the ranks (``nvrx.monitors.straggler.StragglerScorer``); a rank flagged as a
straggler is logged and written as a ``straggler`` event, which ``nvrx inspect`` shows.

Optional policy (``straggler_exclude_after_reports`` > 0): a node whose rank stays flagged that many
reports in a row is marked in the store (``nvrx/<run>/straggler/exclude/<node id>``); that node's agent
sits out the next round like a node that failed its health checks (exit 16, and ``nvrx resume`` avoids it).
The running round is not disturbed: a slow node still makes progress.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from nvrx.launcher.agent.rdzv_auth import JOB_WIDE
from nvrx.launcher.agent.rdzv_records import BadRecord, RoundResult
from nvrx.events import EventLog, RankTiming, StragglerEvent, TimingInfo
from nvrx.monitors.ft_config import FaultToleranceConfig
from nvrx.monitors.straggler import (RankSummary, Straggler, StragglerScorer, MetricSummary, metric_text,
                                summary_from_json, summary_to_json)

if TYPE_CHECKING:
    from nvrx.launcher.agent.rank_monitors import RankMonitorGroup
    from nvrx.launcher.agent.store import RendezvousStore

log = logging.getLogger("nvrx.stragglers")

MAX_VALUE = 1 << 20  # bytes: a node's published value larger than this is not ours (ignored)


def summary_of_event(e: dict[str, Any]) -> RankSummary:
    """The RankSummary carried by a monitor's ``rank_timing`` event."""
    f = TimingInfo.F
    out: RankSummary = {}
    for item in e.get(RankTiming.F.timings) or []:
        if isinstance(item, dict) and isinstance(item.get(f.metric), str):
            median, samples = item.get(f.median), item.get(f.samples)
            if isinstance(median, (int, float)) and median > 0 and isinstance(samples, int) and samples > 0:
                out[item[f.metric]] = MetricSummary(float(median), samples)
    return out


class StragglerAggregator:
    """One agent's straggler thread for one round (``start``/``stop``), and the exclusion check between rounds."""

    def __init__(self, ft: FaultToleranceConfig, monitors: "RankMonitorGroup", events: EventLog,
                 rs: "RendezvousStore", run_id: str, node_name: str, node_id: str) -> None:
        self.ft = ft
        self.monitors = monitors
        self.events = events
        self.rs = rs
        self.prefix = f"nvrx/{run_id}/straggler/"
        self.node_name = node_name
        self.node_id = node_id
        self.scorer = StragglerScorer(ft.straggler_threshold, ft.straggler_sustain_reports)
        self._store: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_t: dict[int, float] = {}          # local rank -> time of the last summary used
        self._seq = 0
        self._node_seq: dict[int, int] = {}          # group rank -> last value sequence number scored
        self._latest: dict[int, tuple[float, str, str, RankSummary]] = {}  # global rank -> (t, node, node id, ...)
        self._excluding: set[str] = set()
        self._rejected: set[str] = set()  # keys whose forged value was logged

    # ---- lifecycle
    def start(self, result: RoundResult) -> None:
        """Score this round from scratch: after a restart the global ranks may sit on other nodes."""
        self.scorer = StragglerScorer(self.ft.straggler_threshold, self.ft.straggler_sustain_reports)
        self._stop = threading.Event()  # this round's own: a thread still stuck in a store call never sees the next
        self._seen_t.clear()
        self._node_seq.clear()
        self._latest.clear()
        self._thread = threading.Thread(target=self._loop, args=(result, self._stop), name=f"stragglers-{result.round}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End this round's thread; never hold up the end of a round for it (a store call may hang when the
        store's host is gone): after a short wait it is left to finish on its own, with its own connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=0.5)
            if self._thread.is_alive():
                log.debug("the straggler thread is still in a store call; leaving it")
                self._store = None  # the next round connects afresh
            self._thread = None

    def _client(self) -> Any:
        if self._store is None:
            self._store = self.rs.new_client(timeout=10.0)
        return self._store

    def _loop(self, result: RoundResult, stop: threading.Event) -> None:
        """Publish this node's new summaries (on group rank 0: score the ranks) just after the monitors report."""
        wait = self.ft.straggler_report_interval / 2
        store = None
        while not stop.wait(wait):
            try:
                store = store or self._client()
                self.step(result, time.time(), store)
            except Exception as exc:  # the store is gone (the job is ending) or a bug: never take the agent down
                log.debug("straggler detection pass failed: %s", exc, exc_info=True)
            wait = self._next_wait(time.time())

    def _next_wait(self, now: float) -> float:
        """Seconds to the next pass: 0.1 s after the monitors' next reports are due (they report in step, every
        interval from their rank's start), so a report is scored at once rather than up to a period later;
        a quarter interval while reports are late or none came yet."""
        interval = self.ft.straggler_report_interval
        newest = max(self._seen_t.values(), default=0.0)
        due = newest + interval + 0.1 - now
        return min(interval, due) if due > 0.05 else max(0.05, interval / 4)

    # ---- one pass
    def step(self, result: RoundResult, now: float, store: Any = None) -> list[Straggler]:
        """One pass: publish, and (group rank 0) score; returns the flagged or recovered ranks of this pass."""
        store = store if store is not None else self._client()
        self._publish(result, store)
        if result.group_rank != 0:
            return []
        fresh = self._gather(result, now, store)
        if not fresh:
            return []
        summaries = {rank: (node, summary) for rank, (_, node, _, summary) in self._latest.items()}
        scores, changes = self.scorer.update(summaries, now, fresh)
        log.debug("straggler scores (round %d): %s", result.round, "; ".join(
            f"rank {s.rank} {s.metric} {s.median:.4f}s rel {s.relative and round(s.relative, 3)}" for s in scores))
        for st in changes:
            self._report(st, result, store)
        return changes

    def _publish(self, result: RoundResult, store: Any) -> None:
        ranks: dict[str, Any] = {}
        for lr in range(self.monitors.nproc):
            e = self.monitors.latest_timing(lr, self._seen_t.get(lr, 0.0))
            if e is None:
                continue
            self._seen_t[lr] = e["t"]
            summary = summary_of_event(e)
            if summary:
                ranks[str(result.rank_offset + lr)] = summary_to_json(summary)
        if not ranks:
            return
        self._seq += 1
        value = {"seq": self._seq, "node": self.node_name, "node_id": self.node_id, "ranks": ranks}
        key = f"{self.prefix}r{result.round}/n{result.group_rank}"
        store.set(key, self.rs.auth.seal(key, result.round, value))  # signed: rdzv_auth

    def _gather(self, result: RoundResult, now: float, store: Any) -> set[int]:
        """Read every node's newest value; the global ranks with a summary not scored before."""
        fresh: set[int] = set()
        for g in range(len(result.nodes)):
            key = f"{self.prefix}r{result.round}/n{g}"
            if not store.check([key]):
                continue
            value = self._open(key, result.round, store.get(key))
            if value is None or value["seq"] <= self._node_seq.get(g, 0):
                continue
            self._node_seq[g] = value["seq"]
            for rank_text, raw in value["ranks"].items():
                summary = summary_from_json(raw)
                if rank_text.isdigit() and summary:
                    self._latest[int(rank_text)] = (now, value["node"], value["node_id"], summary)
                    fresh.add(int(rank_text))
        stale = now - 3 * self.ft.straggler_report_interval  # a rank that stopped reporting is nobody's peer
        for rank in [r for r, v in self._latest.items() if v[0] < stale]:
            del self._latest[rank]
        return fresh

    def _report(self, st: Straggler, result: RoundResult, store: Any) -> None:
        node_id = self._latest.get(st.rank, (0.0, st.node, "", {}))[2]
        limit = self.ft.straggler_exclude_after_reports
        exclude = bool(limit and st.state == "straggler" and st.reports >= limit and node_id)
        if exclude and node_id not in self._excluding:
            self._excluding.add(node_id)
            reason = (f"rank {st.rank} was a straggler for {st.reports} reports in a row "
                      f"({metric_text(st.metric)} {_ratio(st.relative)} the other ranks')")
            key = f"{self.prefix}exclude/{node_id}"
            store.set(key, self.rs.auth.seal(key, JOB_WIDE, {"reason": reason}))
        self.events.emit(StragglerEvent(
            rank=st.rank, node=st.node, metric=st.metric, state=st.state, relative=_round(st.relative),
            individual=_round(st.individual), median=round(st.median, 6), peers=_round(st.peers, 6),
            since=round(st.since, 3), reports=st.reports, round=result.round, exclude=exclude or None))
        if st.state == "recovered":
            log.info("straggler: rank %d on node %s recovered (%s %s the other ranks')", st.rank, st.node,
                     metric_text(st.metric), _ratio(st.relative))
            return
        own = f", {_ratio(st.individual)} its own earlier median" if st.individual is not None else ""
        log.warning("straggler: rank %d on node %s is slow for %d reports (since %s): %s %s the other ranks' "
                    "median (%.4f s vs %s s)%s%s", st.rank, st.node, st.reports,
                    time.strftime("%H:%M:%S", time.localtime(st.since)), metric_text(st.metric), _ratio(st.relative),
                    st.median, "?" if st.peers is None else f"{st.peers:.4f}", own,
                    "; its node sits out the next round" if exclude else "")

    # ---- between rounds
    def excluded(self) -> str | None:
        """Why this node must sit out the next round (the exclusion policy), or None."""
        if not self.ft.straggler_exclude_after_reports:
            return None
        try:
            store = self._client()
            key = f"{self.prefix}exclude/{self.node_id}"
            if not store.check([key]):
                return None
            value = json.loads(self.rs.auth.open(key, JOB_WIDE, store.get(key)))
        except BadRecord as exc:  # not written by an agent of this job: no reason to leave
            log.warning("ignoring the straggler exclusion mark %s (%s)", key, exc)
            return None
        except Exception as exc:  # an unreadable mark is no reason to leave
            log.debug("cannot read the straggler exclusion mark: %s", exc)
            return None
        reason = value.get("reason") if isinstance(value, dict) else None
        return str(reason) if reason else "a rank of this node was a persistent straggler"

    def _open(self, key: str, round: int, raw: bytes) -> dict[str, Any] | None:
        """A node's published value if it is signed for KEY and ROUND, else None (logged once per key)."""
        try:
            return _parse(self.rs.auth.open(key, round, raw).encode())
        except BadRecord as exc:
            if key not in self._rejected:
                self._rejected.add(key)
                log.warning("ignoring the straggler report %s in the rendezvous store (%s)", key, exc)
            return None

    def close(self) -> None:
        self.stop()
        self._store = None


def _parse(raw: bytes) -> dict[str, Any] | None:
    """A node's published value, or None if it is not one (the store is shared with other programs)."""
    if len(raw) > MAX_VALUE:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if (isinstance(value, dict) and isinstance(value.get("seq"), int) and isinstance(value.get("node"), str)
            and isinstance(value.get("node_id"), str) and isinstance(value.get("ranks"), dict)):
        return value
    return None


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _ratio(x: float | None) -> str:
    return "?x" if x is None else f"{x:.2f}x"
