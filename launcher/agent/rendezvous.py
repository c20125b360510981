"""Rounds of the job-wide rendezvous, kept entirely in the shared TCPStore.

Every (re)start of the ranks is a new round. Store layout, all under ``nvrx/<run id>/``:

* ``r<N>/count``          atomic join counter; joiner j writes ``r<N>/join/<j>`` (NodeInfo JSON)
* ``r<N>/closed``         the round's membership in group-rank order; first compare_set wins
* ``r<N>/pg``             where the ranks' process-group store of round N listens
* ``r<N>/stop``           the StopRecord that ended round N (first writer, via ``r<N>/stop_claim``)
* ``restarts``            the job-wide restart counter (never reset, survives agents rejoining)
* ``finished``            set when the job succeeded or gave up; late agents get JobFinished
* ``beat/<node id>``      keepalive counters
* ``round``               hint: the newest round that may be open (only a starting point for scans)

Everything is JSON, never pickle. Waiting is done by short polls with check()/add(key, 0)
(a timed-out torch wait prints C++ warnings); blocking get/wait is used only for keys
that another agent is in the middle of writing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist
from torch.distributed import TCPStore

from launcher.agent.config import RdzvSettings
from launcher.agent.rdzv_records import (FAULT_KINDS, BadRecord, NodeInfo, RoundResult, StopKind, StopRecord,
                                         parse_closed, parse_join, parse_node, parse_pg)
from launcher.agent.store import (
    PortInUse,
    RendezvousError,
    RendezvousMismatch,
    RendezvousStore,
    advertised_address,
    master_addr_for_ranks,
)
from monitors.events import (EventLog, RdzvBadRecord, RdzvJoin, RdzvRound, RdzvStandby, RdzvStop, StopDetail,
                             field_problem, spec_of)
from nvrx_common.net import port_in_use, start_store_server
from nvrx_common.errors import NvrxError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_POLL = 0.02  # seconds; the longest sleep between two polls
# One blocking wait for a key. Long on purpose: every round ends with a stop record, which wakes the wait,
# and torch logs a warning line at each timed-out wait; the thread is a daemon, so nothing waits for it.
WAIT_SLICE = datetime.timedelta(days=1)
# A joiner that waits for another agent to close the round looks for itself after this long (at least).
FOLLOWER_SLICE = 30.0
LINGER_MAX = 10.0  # how long the store host waits for peers to read the final stop record
BAD_STOP_GRACE = 15.0  # how long a malformed stop record may stand before the claimer overwrites it
_DETAIL_SPEC = spec_of(StopDetail)


class BadStoreRecord(RendezvousError):
    """A record in the rendezvous store that this agent cannot ignore is malformed: the job ends (one line)."""


def parse_stop(raw: bytes) -> StopRecord:
    """A stop record from the store with its detail checked against the event schema (it is logged as is)."""
    rec = StopRecord.from_json(raw)
    problem = field_problem(rec.detail, _DETAIL_SPEC, "detail.")
    if problem is not None:
        raise BadRecord(problem)
    return rec


class RendezvousTimeout(RendezvousError):
    """Not enough nodes joined a round within join_timeout."""


class JobFinished(NvrxError):
    """The job already succeeded or gave up; a late agent must not start a new round."""


def make_node_id() -> str:
    """Unique for this agent's lifetime, readable in logs: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def order_members(joined: list[dict], previous: list[str], fixed_ranks: bool) -> list[dict]:
    """Group-rank order of a round's members.

    Fixed ranks (--node-rank): the node rank is the group rank. Otherwise members of the
    previous round keep their relative order and newcomers follow, sorted by node id, so
    ranks stay stable across restarts. Raises RendezvousMismatch on clashing node ranks.
    """
    if fixed_ranks:
        by_rank: dict[int, dict] = {}
        for info in joined:
            other = by_rank.setdefault(info["node_rank"], info)
            if other is not info:
                raise RendezvousMismatch(
                    f"two agents use --node-rank {info['node_rank']} ({other['node_id']} and {info['node_id']}); "
                    f"give every node a distinct --node-rank 0..{len(joined) - 1}"
                )
        return [by_rank[r] for r in sorted(by_rank)]
    prev_pos = {node_id: i for i, node_id in enumerate(previous)}

    def key(n: dict) -> tuple[int, int, str]:
        pos = prev_pos.get(n["node_id"])
        return (0, pos, "") if pos is not None else (1, 0, n["node_id"])

    return sorted(joined, key=key)


class _Keys:
    """Store key names for one run."""

    def __init__(self, run_id: str) -> None:
        self.prefix = f"nvrx/{run_id}/"
        self.hint = self.prefix + "round"
        self.restarts = self.prefix + "restarts"
        self.finished = self.prefix + "finished"

    def r(self, n: int, name: str) -> str:
        return f"{self.prefix}r{n}/{name}"

    def join(self, n: int, j: int) -> str:
        return f"{self.prefix}r{n}/join/{j}"

    def beat(self, node_id: str) -> str:
        return f"{self.prefix}beat/{node_id}"


class _Backoff:
    """Poll sleeps growing from 1 ms to MAX_POLL: fast when things move, cheap when idle."""

    def __init__(self, closing: threading.Event) -> None:
        self.delay = 0.001
        self.closing = closing

    def sleep(self) -> None:
        if self.closing.wait(self.delay):
            raise RendezvousError("the rendezvous was closed by this agent while waiting")
        self.delay = min(self.delay * 2, MAX_POLL)


class _Liveness:
    """Tracks when each watched node's beat counter last moved (local clock, no skew issues)."""

    def __init__(self, nodes: list[tuple[int, NodeInfo]], timeout: float) -> None:
        now = time.monotonic()
        self.timeout = timeout
        self.state = {n.node_id: (g, -1, now) for g, n in nodes}

    def update(self, node_id: str, beats: int) -> None:
        g, last, _ = self.state[node_id]
        if beats != last:
            self.state[node_id] = (g, beats, time.monotonic())

    def silent(self) -> tuple[str, int] | None:
        now = time.monotonic()
        for node_id, (g, _, since) in self.state.items():
            if now - since > self.timeout:
                return node_id, g
        return None


def watched_nodes(result: RoundResult, span: int = 2) -> list[tuple[int, NodeInfo]]:
    """The nodes this node watches: SPAN neighbours each way on the ring (all others when few).

    Any single report stops the round, so neighbour watching detects every loss while the
    store load stays linear in the number of nodes.
    """
    n = len(result.nodes)
    picks = {(result.group_rank + d) % n for d in range(-span, span + 1)} - {result.group_rank}
    return [(g, result.nodes[g]) for g in sorted(picks)]


class Rendezvous:
    """One agent's view of the job-wide rendezvous: rounds, stops, the restart budget, keepalive."""

    def __init__(
        self,
        rs: RendezvousStore,
        settings: RdzvSettings,
        max_restarts: int,
        events: EventLog,
        node_id: str | None = None,
    ) -> None:
        self.rs = rs
        self.settings = settings
        self.max_restarts = max_restarts
        self.events = events
        self.keys = _Keys(settings.run_id)
        addr = advertised_address(settings, rs.host, rs.port)
        self.info = NodeInfo(node_id or make_node_id(), addr, settings.nproc_per_node)
        self._result: RoundResult | None = None
        self._pg_store: TCPStore | None = None
        self._master_name: str | None = None  # MASTER_ADDR when this node hosts the process-group store
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._clients: dict[str, TCPStore] = {}
        self._stops_seen: set[int] = set()
        self._bad_seen: set[tuple[str, bytes]] = set()  # malformed store values already reported
        self._succeeded: set[int] = set()
        self._ka_thread: threading.Thread | None = None
        self._ka_stop = threading.Event()
        self._joiner = 0  # this agent's join index in the round it is joining

    @property
    def node_id(self) -> str:
        return self.info.node_id

    # ------------------------------------------------------------ plumbing

    def _client(self, purpose: str = "main") -> TCPStore:
        """The main client for short calls; one extra connection per background purpose."""
        if purpose == "main" and self.rs.store is not None:
            return self.rs.store
        with self._lock:
            if purpose not in self._clients:
                if self._closing.is_set():
                    raise RendezvousError("the rendezvous was closed by this agent")
                self._clients[purpose] = self.rs.new_client()
            return self._clients[purpose]

    @contextlib.contextmanager
    def _store_errors(self) -> Iterator[None]:
        """Report a lost or broken store as one RendezvousError line."""
        try:
            yield
        except dist.DistError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RendezvousError(
                f"lost the rendezvous store at {self.rs.host}:{self.rs.port} ({first}); "
                "the agent hosting it has probably exited"
            ) from None

    def _read(self, store: TCPStore, key: str, parse: Callable[[bytes], T], fatal: bool) -> T | None:
        """KEY's value, checked by PARSE. A malformed one (garbage, or forged by a program that can reach the
        store) is logged once as an event; then None (ignored), or with FATAL one BadStoreRecord line."""
        raw = store.get(key)
        try:
            return parse(raw)
        except BadRecord as exc:
            self._bad_record(key, raw, str(exc), fatal)
            return None

    def _bad_record(self, key: str, raw: bytes, problem: str, fatal: bool) -> None:
        """Report a malformed store value once per key and value; raise BadStoreRecord if it cannot be ignored."""
        action = "job ends" if fatal else "ignored"
        with self._lock:
            fresh = (key, raw) not in self._bad_seen
            self._bad_seen.add((key, raw))
        if fresh:
            log.warning("malformed record %s in the rendezvous store (%s); %s", key, problem, action)
            self.events.emit(RdzvBadRecord(key=key, problem=problem, action=action))
        if fatal:
            raise BadStoreRecord(
                f"the rendezvous store at {self.rs.host}:{self.rs.port} holds a malformed record {key} ({problem}); "
                "another program wrote to it: keep the endpoint's port private to the job's nodes and relaunch"
            )

    def _raise_if_finished(self, store: TCPStore) -> None:
        if store.check([self.keys.finished]):
            rec = self._read(store, self.keys.finished, parse_stop, fatal=False)
            if rec is None:
                return
            how = "succeeded" if rec.kind is StopKind.SUCCEEDED else f"gave up after {rec.restart_count} restarts"
            raise JobFinished(f"job {self.settings.run_id} already {how} (round {rec.round})")

    def _nodes_text(self) -> str:
        s = self.settings
        return str(s.min_nodes) if s.min_nodes == s.max_nodes else f"{s.min_nodes}..{s.max_nodes}"

    # ------------------------------------------------------------ rounds

    def next_round(self) -> RoundResult:
        """Join the next open round and return once it closed with this node in it."""
        self._release_pg_store()
        store = self._client()
        with self._store_errors():
            self._ensure_previous_stopped(store)
            self._raise_if_finished(store)
            r = self._open_round(store, self._result.round + 1 if self._result else 0)
            while True:
                started = time.monotonic()
                self._join(store, r)
                record = self._wait_closed(store, r, started)
                if record.get("error"):
                    raise RendezvousMismatch(record["error"])
                if any(n["node_id"] == self.node_id for n in record["nodes"]):
                    return self._enter_round(store, r, record, started)
                self._standby(store, r, record)
                r = self._open_round(store, r + 1)

    def _ensure_previous_stopped(self, store: TCPStore) -> None:
        """Rounds advance only through stop records; write one if the caller skipped it."""
        if self._result and not store.check([self.keys.r(self._result.round, "stop")]):
            log.warning("round %d has no stop record; recording it as interrupted", self._result.round)
            self._report_stop(store, self._result.round, StopKind.INTERRUPTED, {"node": self.node_id})

    def _open_round(self, store: TCPStore, at_least: int) -> int:
        """The first round at or after max(AT_LEAST, hint) that has not stopped yet."""
        hint = int(store.add(self.keys.hint, 0))
        r = max(at_least, hint)
        while store.check([self.keys.r(r, "stop")]):
            r += 1
        return r

    def _join(self, store: TCPStore, r: int) -> None:
        j = store.add(self.keys.r(r, "count"), 1) - 1
        info = {**asdict(self.info), "node_rank": self.settings.node_rank}
        store.set(self.keys.join(r, j), json.dumps(info))
        self._joiner = j
        log.debug("joined round %d as joiner %d", r, j)
        self.events.emit(RdzvJoin(round=r, node_id=self.node_id))

    def _wait_closed(self, store: TCPStore, r: int, started: float) -> dict:
        """Wait until round R is closed, closing it ourselves when max or the last call is reached.

        One agent polls: the first joiner (it closes at the last call), and the joiner that brings the
        round to MAX closes it at once. Every other agent blocks on the closed record, so N joining agents
        cost the store O(1) requests per poll instead of O(N); after a slice without news (the first joiner
        may have died) it takes one look itself and can close the round as a backup.
        """
        s = self.settings
        closed_key = self.keys.r(r, "closed")
        min_seen: float | None = None
        backoff = _Backoff(self._closing)
        follower = 0 < self._joiner < s.max_nodes - 1
        while True:
            if follower and self._wait_slice(closed_key, max(s.last_call_timeout + 5.0, FOLLOWER_SLICE)):
                return self._read(store, closed_key, parse_closed, fatal=True)
            if store.check([closed_key]):
                return self._read(store, closed_key, parse_closed, fatal=True)
            self._raise_if_finished(store)
            count = store.add(self.keys.r(r, "count"), 0)
            now = time.monotonic()
            if count >= s.min_nodes:
                min_seen = min_seen if min_seen is not None else now
                if count >= s.max_nodes or now - min_seen >= s.last_call_timeout:
                    self._close(store, r, count)
                    continue
            elif now - started > s.join_timeout:
                raise RendezvousTimeout(
                    f"rendezvous round {r} timed out after {s.join_timeout:g} s with {count} of {self._nodes_text()} "
                    f"nodes joined; start the agents on the missing nodes or raise --rdzv-conf join_timeout"
                )
            if not follower:
                backoff.sleep()

    def _wait_slice(self, key: str, seconds: float) -> bool:
        """True once KEY exists, False after SECONDS without it (one blocking wait: no polling).

        The store's wait blocks in C++, where Python cannot run a signal handler: it runs on a helper
        thread with its own connection while this thread waits on an Event, so a Ctrl-C or SIGTERM to
        the agent is handled at once.
        """
        store = self._client("join-wait")
        done, box = threading.Event(), []

        def wait() -> None:
            try:
                store.wait([key], datetime.timedelta(seconds=seconds))
                box.append(True)
            except dist.DistStoreError as exc:
                box.append(exc if "timeout" not in str(exc).lower() else False)
            except BaseException as exc:  # handed to the waiting thread
                box.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait, name="nvrx-rdzv-join-wait", daemon=True).start()
        while not done.wait(0.2):
            if self._closing.is_set():
                raise RendezvousError("the rendezvous was closed by this agent while waiting")
        if isinstance(box[0], BaseException):
            raise box[0]
        return bool(box[0])

    def _previous_order(self, store: TCPStore, r: int) -> list[str]:
        key = self.keys.r(r - 1, "closed")
        if r == 0 or not store.check([key]):
            return []
        record = self._read(store, key, parse_closed, fatal=False)
        return [n["node_id"] for n in record["nodes"]] if record else []

    def _close(self, store: TCPStore, r: int, count: int) -> None:
        """Write round R's membership; if another node closed it first, theirs stands."""
        k = min(count, self.settings.max_nodes)
        keys = [self.keys.join(r, j) for j in range(k)]
        store.wait(keys)  # each joiner writes its record right after taking its index
        joined = []
        for key, raw in zip(keys, store.multi_get(keys)):
            try:
                info = parse_join(raw)
                if any(j["node_id"] == info["node_id"] for j in joined):
                    raise BadRecord(f"node {info['node_id']} joined twice")
                joined.append(info)
            except BadRecord as exc:  # a joiner nobody can reach: leave it out of the round
                self._bad_record(key, raw, str(exc), fatal=False)
        record: dict[str, Any] = {"round": r, "restart_count": int(store.add(self.keys.restarts, 0))}
        try:
            members = order_members(joined, self._previous_order(store, r), self.settings.node_rank is not None)
            record["nodes"] = [{"node_id": m["node_id"], "addr": m["addr"], "nproc": m["nproc"]} for m in members]
        except RendezvousMismatch as exc:
            record["nodes"], record["error"] = [], str(exc)
        store.compare_set(self.keys.r(r, "closed"), "", json.dumps(record))

    def _enter_round(self, store: TCPStore, r: int, record: dict, started: float) -> RoundResult:
        nodes = tuple(parse_node(n) for n in record["nodes"])
        g = next(i for i, n in enumerate(nodes) if n.node_id == self.node_id)
        addr, port, hosted = self._pg_endpoint(store, r, g, nodes)
        result = RoundResult(r, g, nodes, record["restart_count"], addr, port, hosted)
        self._result = result
        waited = round(time.monotonic() - started, 3)
        log.info("round %d: group rank %d of %d nodes, world size %d", r, g, len(nodes), result.world_size)
        self.events.emit(RdzvRound(
            round=r,
            group_rank=g,
            nodes=[n.node_id for n in nodes],
            world_size=result.world_size,
            restart_count=result.restart_count,
            waited=waited,
        ))
        return result

    def _pg_endpoint(self, store: TCPStore, r: int, g: int, nodes: tuple[NodeInfo, ...]) -> tuple[str, int, bool]:
        """Where the ranks' process-group store is: fixed by the user, or fresh on group rank 0."""
        s = self.settings
        if s.master_port is not None:
            if g == 0:  # rank 0 listens on it: check before any rank starts, instead of EADDRINUSE in every rank
                self._check_master_port(store, r, s.master_port, len(nodes))
            return s.master_addr or nodes[0].addr, s.master_port, False
        key = self.keys.r(r, "pg")
        if g == 0:
            try:
                self._pg_store, port = start_store_server(self.info.addr)
            except OSError as exc:
                msg = (
                    f"node {self.node_id} cannot host the process-group store on {self.info.addr} "
                    f"({exc.strerror}); fix --local-addr"
                )
                store.set(key, json.dumps({"error": msg}))
                raise RendezvousError(msg) from None
            if self._master_name is None:  # resolved once: torchrun's getfqdn() can be slow
                self._master_name = master_addr_for_ranks(self.info.addr, s.local_addr)
            store.set(key, json.dumps({"addr": self._master_name, "port": port}))
            return self._master_name, port, True
        store.wait([key])  # group rank 0 publishes it right after the round closed
        pg = self._read(store, key, parse_pg, fatal=True)
        if "error" in pg:
            raise RendezvousError(pg["error"])
        return pg["addr"], pg["port"], True

    def _check_master_port(self, store: TCPStore, r: int, port: int, nnodes: int) -> None:
        """Raise PortInUse (one line, exit 2) if --master-port is taken here; the other NNODES-1 nodes, whose
        ranks would wait for rank 0 in vain, are told through a stop record that gives up."""
        why = port_in_use(port)
        if why is None:
            return
        msg = (f"--master-port {port} is already in use on node {self.info.addr} ({why}); choose a free port, "
               f"or drop --master-port to let nvrx pick a fresh one per round")
        if nnodes > 1:
            self._report_stop(store, r, StopKind.FAILED, {"describe": msg, "no_restart": True, "round": r})
        raise PortInUse(msg)

    def _standby(self, store: TCPStore, r: int, record: dict) -> None:
        """Round R closed without us: ask it to make room, or wait for it to end."""
        room = len(record["nodes"]) < self.settings.max_nodes
        reason = "scale_up" if room else "round full"
        log.info("round %d already running with %d nodes; standing by (%s)", r, len(record["nodes"]), reason)
        self.events.emit(RdzvStandby(round=r, node_id=self.node_id, reason=reason, nodes=len(record["nodes"])))
        if room:
            self._report_stop(store, r, StopKind.SCALE_UP, {"node": self.node_id})
            return
        self._wait_standby(store, r, record)

    def _wait_standby(self, store: TCPStore, r: int, record: dict) -> None:
        """No timeout while the round lives; a round whose nodes fell silent is ended as node_left."""
        members = [(g, parse_node(n)) for g, n in enumerate(record["nodes"])]
        alive = _Liveness(members, self.settings.keepalive_timeout)
        stop_key = self.keys.r(r, "stop")
        next_check = 0.0
        backoff = _Backoff(self._closing)
        while not store.check([stop_key]):
            self._raise_if_finished(store)
            if time.monotonic() >= next_check:
                for _, node in members:
                    alive.update(node.node_id, store.add(self.keys.beat(node.node_id), 0))
                silent = alive.silent()
                if silent:
                    self._report_stop(store, r, StopKind.NODE_LEFT, {"node": silent[0], "group_rank": silent[1]})
                next_check = time.monotonic() + self.settings.keepalive_interval
            backoff.sleep()

    # ------------------------------------------------------------ stops and the restart budget

    def report_stop(self, round: int, kind: StopKind | str, detail: dict) -> StopRecord:
        """End ROUND; idempotent across nodes: the first record wins and is returned to everyone."""
        with self._store_errors():
            return self._report_stop(self._client(), round, kind, detail)

    def _report_stop(self, store: TCPStore, r: int, kind: StopKind | str, detail: dict) -> StopRecord:
        try:
            kind = StopKind(kind)
        except ValueError:
            raise ValueError(f"unknown stop kind {kind!r}; expected one of {', '.join(StopKind)}") from None
        stop_key = self.keys.r(r, "stop")
        if store.add(self.keys.r(r, "stop_claim"), 1) == 1:
            spends = kind in FAULT_KINDS and not detail.get("leaves")  # a node leaving for a standby: no restart
            count = int(store.add(self.keys.restarts, 1 if spends else 0))
            give_up = kind in FAULT_KINDS and ((spends and count > self.max_restarts) or bool(detail.get("no_restart")))
            rec = StopRecord(r, kind, self.node_id, dict(detail), count, give_up)
            if give_up or kind is StopKind.SUCCEEDED:
                store.set(self.keys.finished, rec.to_json())  # before the stop: whoever sees it sees this
            store.set(stop_key, rec.to_json())
            store.set(self.keys.hint, str(r + 1))
        else:
            store.wait([stop_key])  # the claimer writes it right after claiming
            rec = self._valid_stop(store, r, claimed=True)
        self._saw_stop(store, rec)
        return rec

    def _valid_stop(self, store: TCPStore, r: int, claimed: bool) -> StopRecord:
        """Round R's stop record, waiting out a malformed one (reported, ignored) until a real one replaces it.

        The first agent to claim the round overwrites whatever stands there. Once the round is CLAIMED (a
        forger may have taken the claim too) and the value stays malformed for BAD_STOP_GRACE, nothing will
        replace it: the job ends with one line.
        """
        key = self.keys.r(r, "stop")
        backoff = _Backoff(self._closing)
        since: float | None = None
        while True:
            raw = store.get(key)
            try:
                return parse_stop(raw)
            except BadRecord as exc:
                claimed = claimed or store.add(self.keys.r(r, "stop_claim"), 0) > 0
                since = since if since is not None else time.monotonic()
                fatal = claimed and time.monotonic() - since > BAD_STOP_GRACE
                self._bad_record(key, raw, str(exc), fatal=fatal)
            backoff.sleep()

    def _saw_stop(self, store: TCPStore, rec: StopRecord) -> None:
        """Log/emit a round's stop once per agent, and ack it for the store host's linger."""
        with self._lock:
            if rec.round in self._stops_seen:
                return
            self._stops_seen.add(rec.round)
        if self._result is not None and self._result.round == rec.round:
            store.add(self.keys.r(rec.round, "acked"), 1)
        log.info("round %d stopped: %s by %s (restarts %d%s)", rec.round, rec.kind, rec.by_node,
                 rec.restart_count, ", giving up" if rec.give_up else "")
        self.events.emit(RdzvStop(round=rec.round, kind=str(rec.kind), by_node=rec.by_node,
                                  detail=StopDetail.of(rec.detail), restart_count=rec.restart_count,
                                  give_up=rec.give_up))

    def wait_stop(self, round: int) -> StopRecord:
        """Block until ROUND has a stop record (for a watcher thread; uses its own connection)."""
        with self._store_errors():
            store = self._client("watch")
            key = self.keys.r(round, "stop")
            self._wait_for_key(store, key)
            rec = self._valid_stop(store, round, claimed=False)
            self._saw_stop(store, rec)
            return rec

    def _wait_for_key(self, store: TCPStore, key: str) -> None:
        """Block until KEY exists: the store wakes us when it is set (no polling, so N waiting agents cost
        the store nothing between events and learn of it at once)."""
        while True:
            if self._closing.is_set():
                raise RendezvousError("the rendezvous was closed by this agent while waiting")
            try:
                store.wait([key], WAIT_SLICE)
                return
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    raise

    def standbys(self, round: int) -> int:
        """How many agents joined ROUND after it closed full: the standbys waiting for it to end."""
        with self._store_errors():
            store = self._client()
            joined = int(store.add(self.keys.r(round, "count"), 0))
            closed = self._read(store, self.keys.r(round, "closed"), parse_closed, fatal=False)
        return max(0, joined - len(closed["nodes"])) if closed else 0

    def node_succeeded(self, round: int) -> None:
        """All ranks of this node exited 0 in ROUND; the last node to say so ends the round."""
        with self._store_errors():
            store = self._client()
            if round in self._succeeded:
                return
            self._succeeded.add(round)
            done = store.add(self.keys.r(round, "succeeded"), 1)
            members = len(self._read(store, self.keys.r(round, "closed"), parse_closed, fatal=True)["nodes"])
            if done >= members:
                self._report_stop(store, round, StopKind.SUCCEEDED, {"nodes": members})

    # ------------------------------------------------------------ keepalive

    def start_keepalive(self, result: RoundResult) -> None:
        """Beat this node's counter and watch neighbours until stop_keepalive()."""
        self.stop_keepalive()
        self._ka_stop = threading.Event()
        self._ka_thread = threading.Thread(
            target=self._keepalive_loop,
            args=(result, self._ka_stop),
            name=f"nvrx-keepalive-r{result.round}",
            daemon=True,
        )
        self._ka_thread.start()

    def stop_keepalive(self) -> None:
        self._ka_stop.set()
        if self._ka_thread is not None:
            self._ka_thread.join(timeout=self.settings.keepalive_interval + 5.0)
            self._ka_thread = None

    def _keepalive_loop(self, result: RoundResult, stop: threading.Event) -> None:
        try:
            store = self._client("keepalive")
            alive = _Liveness(watched_nodes(result), self.settings.keepalive_timeout)
            watching = bool(alive.state)
            stop_key = self.keys.r(result.round, "stop")
            while not stop.is_set():
                store.add(self.keys.beat(self.node_id), 1)
                if watching:
                    watching = self._watch_once(store, result.round, alive, stop_key)
                stop.wait(self.settings.keepalive_interval)
        except (dist.DistError, RendezvousError) as exc:
            if not stop.is_set() and not self._closing.is_set():
                log.warning("keepalive stopped: lost the rendezvous store (%s)", str(exc).splitlines()[0])

    def _watch_once(self, store: TCPStore, r: int, alive: _Liveness, stop_key: str) -> bool:
        """One look at the neighbours; False once the round is over (nothing left to watch)."""
        if store.check([stop_key]):
            return False
        for node_id in alive.state:
            alive.update(node_id, store.add(self.keys.beat(node_id), 0))
        silent = alive.silent()
        if silent is None:
            return True
        log.warning("node %s (group rank %d) stopped beating for %g s", silent[0], silent[1], alive.timeout)
        self._report_stop(store, r, StopKind.NODE_LEFT, {"node": silent[0], "group_rank": silent[1]})
        return False

    # ------------------------------------------------------------ shutdown

    def _release_pg_store(self) -> None:
        if self._pg_store is not None:
            self._pg_store = None  # destroying the server closes its listening socket

    def _linger_for_peers(self) -> None:
        """On the store host: give the other agents a moment to read the final stop record."""
        res = self._result
        store = self.rs.store
        if res is None or store is None or len(res.nodes) < 2:
            return
        with contextlib.suppress(dist.DistError):
            if not store.check([self.keys.r(res.round, "stop")]):
                return
            deadline = time.monotonic() + min(self.settings.keepalive_timeout, LINGER_MAX)
            while store.add(self.keys.r(res.round, "acked"), 0) < len(res.nodes) and time.monotonic() < deadline:
                time.sleep(MAX_POLL)

    def close(self) -> None:
        """Stop background work, release this node's round resources; the RendezvousStore stays open."""
        self.stop_keepalive()
        if self.rs.is_host:
            self._linger_for_peers()
        self._closing.set()
        self._release_pg_store()
        with self._lock:
            self._clients.clear()
