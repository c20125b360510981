"""Rounds of the job-wide rendezvous, kept entirely in the shared TCPStore.

Every (re)start of the ranks is a new round. Store layout, all under ``nvrx/<run id>/``:

* ``r<N>/count``          join counter (a hint: where a joiner starts looking for a free slot, and how many slots
                          the closer looks at); joiner j claims ``r<N>/join/<j>`` (NodeInfo) with compare_set
* ``r<N>/closed``         the round's membership in group-rank order and its restart count; first valid writer wins
* ``r<N>/pg``             where the ranks' process-group store of round N listens
* ``r<N>/stop``           the StopRecord that ended round N (first valid writer wins, compare_set); it carries
                          the job-wide restart count, which the next round's closed record takes over. It must name
                          members of round N (a standby's scale_up: a node that joined it)
* ``r<N>/succeeded/<g>``  group rank g's ranks all exited 0
* ``r<N>/ack/<g>``        group rank g saw the stop record (the store host lingers for these before it exits)
* ``r<N>/beat/<node id>`` keepalive: a sequence number that must keep growing
* ``finished``            written when the job succeeded or gave up; late agents get JobFinished
* ``round``               hint: the newest round that may be open (only a starting point for scans)

Every record is JSON (never pickle) in a signed envelope (nvrx/launcher/agent/rdzv_auth.py): its HMAC covers the run
id, the launch (a nonce the store host draws), the round and the key, so a value written without the job secret,
or copied from another round, run or launch, is ignored and reported (rdzv_forged_record). The only counter left,
``count``, is a hint: a forged bump costs at most a delay, never a decision or a number in a message. A forged
value cannot block a real one either: the first *valid* record wins (compare_set replaces exactly the forged bytes
it read).

Waiting is done by short polls with check() (a timed-out torch wait prints C++ warnings); blocking get/wait is
used only for keys that another agent is in the middle of writing.
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
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist
from torch.distributed import TCPStore

from nvrx.launcher.agent.config import RdzvSettings
from nvrx.launcher.agent.rdzv_auth import JOB_WIDE, ForgedRecord, RejectedRecords
from nvrx.launcher.agent.rdzv_records import (BadRecord, NodeInfo, RoundResult, StopKind, StopRecord, parse_closed,
                                              parse_join, parse_pg)
from nvrx.launcher.agent.restart_policy import RestartPolicy
from nvrx.launcher.agent.store import (
    PortInUse,
    RendezvousError,
    RendezvousMismatch,
    RendezvousStore,
    advertised_address,
    master_addr_for_ranks,
)
from nvrx.events import EventLog, RdzvJoin, RdzvRound, RdzvStandby, RdzvStop, StopDetail
from nvrx.common.net import port_in_use, start_store_server
from nvrx.common.errors import NvrxError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_POLL = 0.02  # seconds; the longest sleep between two polls
# One blocking wait for a key. Long on purpose: every round ends with a stop record, which wakes the wait,
# and torch logs a warning line at each timed-out wait; the thread is a daemon, so nothing waits for it.
WAIT_SLICE = datetime.timedelta(days=1)
# A joiner that waits for another agent to close the round looks for itself after this long (at least).
FOLLOWER_SLICE = 30.0
LINGER_MAX = 10.0  # how long the store host waits for peers to read the final stop record
# A join slot taken (counter bumped) but without a valid join record this long is left out of the round: the
# joiner writes its record right after taking the slot, so only a program without the secret leaves one empty.
JOIN_SLOT_GRACE = 10.0
FORGED_POLL_MAX = 0.5  # seconds between looks at a key that holds a forged value, waiting for the real one
PUT_TRIES = 64  # compare_set attempts against values that keep being replaced by forged ones


class BadStoreRecord(RendezvousError):
    """A record in the rendezvous store that this agent cannot ignore is malformed: the job ends (one line)."""


def parse_stop(raw: bytes | str) -> StopRecord:
    """A stop record from the store, its reason checked against the event schema (it is logged as is)."""
    return StopRecord.from_json(raw)


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
        self.finished = self.prefix + "finished"

    def r(self, n: int, name: str) -> str:
        return f"{self.prefix}r{n}/{name}"

    def join(self, n: int, j: int) -> str:
        return f"{self.prefix}r{n}/join/{j}"

    def beat(self, n: int, node_id: str) -> str:
        return f"{self.prefix}r{n}/beat/{node_id}"

    def succeeded(self, n: int, g: int) -> str:
        return f"{self.prefix}r{n}/succeeded/{g}"

    def ack(self, n: int, g: int) -> str:
        return f"{self.prefix}r{n}/ack/{g}"


class _Backoff:
    """Poll sleeps growing from 1 ms to MAX_POLL: fast when things move, cheap when idle."""

    def __init__(self, closing: threading.Event, longest: float = MAX_POLL) -> None:
        self.delay = 0.001
        self.closing = closing
        self.longest = longest

    def sleep(self) -> None:
        if self.closing.wait(self.delay):
            raise RendezvousError("the rendezvous was closed by this agent while waiting")
        self.delay = min(self.delay * 2, self.longest)


class _Liveness:
    """Tracks when each watched node's signed beat sequence last grew (local clock, no skew issues).

    A beat seen to grow is counted from this agent's previous look, not from the look that saw it: it was
    written after that look, so its node is silent from there at the latest. Counting from the look that saw it
    would add up to one keepalive_interval to the detection of a node that is cut off right after a beat."""

    def __init__(self, nodes: list[tuple[int, NodeInfo]], timeout: float) -> None:
        now = time.monotonic()
        self.timeout = timeout
        self.state = {n.node_id: (g, 0, now) for g, n in nodes}
        self.prev_look = now  # when the previous read of the beats started
        self._look = now

    def begin_look(self) -> None:
        self._look = time.monotonic()

    def end_look(self) -> None:
        self.prev_look = self._look

    def update(self, node_id: str, seq: int | None) -> None:
        g, last, _ = self.state[node_id]
        if seq is not None and seq > last:  # a replayed (older) beat never counts as a sign of life
            self.state[node_id] = (g, seq, self.prev_look)

    def deadline(self) -> float:
        """When the first watched node turns silent unless it beats before (monotonic)."""
        return min((since for _, _, since in self.state.values()), default=float("inf")) + self.timeout

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


def _present_slots(store: TCPStore, slots: list[int], keys: list[str]) -> list[int]:
    """The SLOTS whose KEYS exist: one check when all do, else the halves in turn. A joiner writes its record
    right after taking its slot, so the missing ones are a few recent slots: O(missing x log N) checks, not one
    request per slot."""
    if store.check(keys):
        return list(slots)
    if len(slots) == 1:
        return []
    mid = len(slots) // 2
    return _present_slots(store, slots[:mid], keys[:mid]) + _present_slots(store, slots[mid:], keys[mid:])


class _JoinSlots:
    """What the closing agent knows of a round's join slots: valid joins (kept once read), and when each slot
    still without a valid record was first seen (given up after JOIN_SLOT_GRACE)."""

    def __init__(self) -> None:
        self.valid: dict[int, dict] = {}
        self.first_seen: dict[int, float] = {}
        self.dropped: set[int] = set()

    def open_slots(self, count: int, limit: int) -> list[int]:
        return [j for j in range(min(count, limit)) if j not in self.valid and j not in self.dropped]

    def joined(self) -> list[dict]:
        """Valid joins in slot order, each node once."""
        out: dict[str, dict] = {}
        for j in sorted(self.valid):
            out.setdefault(self.valid[j]["node_id"], self.valid[j])
        return list(out.values())


def _parse_seq(body: str) -> int:
    seq = json.loads(body).get("seq") if body.startswith("{") else None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise BadRecord(f"seq is {str(seq)[:20]!r}")
    return seq


def _parse_hint(body: str) -> int:
    value = json.loads(body).get("round") if body.startswith("{") else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRecord(f"round is {str(value)[:20]!r}")
    return value


class KeepaliveTask:
    """One node's keepalive in one round: each tick writes its next signed beat and looks at its ring
    neighbours (reporting node_left for one silent past keepalive_timeout). Driven by the agent's own thread
    (bench/bench_rendezvous.py drives many from one thread)."""

    def __init__(self, rdzv: "Rendezvous", result: RoundResult) -> None:
        self.rdzv = rdzv
        self.round = result.round
        self.alive = _Liveness(watched_nodes(result), rdzv.settings.keepalive_timeout)
        self.watching = bool(self.alive.state)
        self.key = rdzv.keys.beat(result.round, rdzv.node_id)
        self.seq = 0
        self.last_beat = 0.0  # wall clock of the last beat written (what a silent node's detection counts from)

    def tick(self, store: TCPStore) -> None:
        self.seq += 1
        store.set(self.key, self.rdzv._seal(self.key, self.round, {"seq": self.seq}))
        self.last_beat = time.time()
        self.look(store)

    def look(self, store: TCPStore) -> None:
        """Only look at the neighbours (at a silence deadline between two beats)."""
        if self.watching:
            self.watching = self.rdzv._watch_once(store, self.round, self.alive)

    def wake_at(self, next_beat: float) -> float:
        """When the agent's keepalive thread must run next: the next beat, or a neighbour's silence deadline."""
        return min(next_beat, self.alive.deadline() + 0.001) if self.watching else next_beat


class Rendezvous:
    """One agent's view of the job-wide rendezvous: rounds, membership, the signed records, keepalive.

    What a stop costs (the restart budget, giving up) is the agent's POLICY (restart_policy.py), asked when this
    agent writes a stop record. bench/bench_rendezvous.py subclasses it for simulated agents (one connection,
    one keepalive thread and one record cache per process): _client, _check, start_keepalive, stop_keepalive.
    """

    def __init__(
        self,
        rs: RendezvousStore,
        settings: RdzvSettings,
        policy: RestartPolicy,
        events: EventLog,
        node_id: str | None = None,
    ) -> None:
        self.rs = rs
        self.auth = rs.auth
        self.settings = settings
        self.policy = policy
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
        self._stops: dict[int, StopRecord] = {}  # valid stop records seen (the restart count comes from them)
        self._closed: dict[int, dict] = {}  # valid closed records seen
        self._rejected = RejectedRecords(events, log)
        self._succeeded: set[int] = set()
        self._ka_thread: threading.Thread | None = None
        self._ka_stop = threading.Event()
        self._ka_task: KeepaliveTask | None = None
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

    def _seal(self, key: str, r: int, content: dict | StopRecord) -> str:
        return self.auth.seal(key, r, content.fields() if isinstance(content, StopRecord) else content)

    def _check(self, key: str, r: int, raw: bytes, parse: Callable[[str], T]) -> T:
        """RAW read from KEY as the record PARSE makes of it, if it is signed for KEY and round R (BadRecord if not)."""
        return parse(self.auth.open(key, r, raw))

    def _read(self, store: TCPStore, key: str, r: int, parse: Callable[[str], T], fatal: bool) -> T | None:
        """KEY's value (it must exist), checked. A malformed or unauthenticated one (garbage, or forged by a
        program that can reach the store) is reported (bounded); then None (ignored), or with FATAL one line."""
        raw = store.get(key)
        try:
            return self._check(key, r, raw, parse)
        except BadRecord as exc:
            self._bad_record(key, raw, exc, fatal)
            return None

    def _read_if(self, store: TCPStore, key: str, r: int, parse: Callable[[str], T]) -> T | None:
        """KEY's valid value, or None when it is absent or not valid (reported, ignored)."""
        return self._read(store, key, r, parse, fatal=False) if store.check([key]) else None

    def _bad_record(self, key: str, raw: bytes, exc: BadRecord, fatal: bool) -> None:
        """Report a rejected store value (once per key and value, rate-limited); raise BadStoreRecord if FATAL."""
        self._rejected.report(key, raw, exc, "job ends" if fatal else "ignored")
        if fatal:
            raise BadStoreRecord(
                f"the rendezvous store at {self.rs.host}:{self.rs.port} holds a malformed record {key} ({exc}); "
                "another program wrote to it: keep the endpoint's port private to the job's nodes and relaunch"
            )

    def _count(self, key: str, delta: int, repair: Callable[[TCPStore], int]) -> int:
        """Counter KEY after adding DELTA (a hint, never a decision), on a connection of its own.

        The store drops the connection of any client that adds to a value that is not an integer, so a program
        without the secret could cut an agent off by writing one. Here only the counter connection is lost: the
        value is reported (rdzv_forged_record), replaced by what REPAIR counts in the store (compare_set: one
        agent's repair wins), and the add is retried on a new connection. A store that is really gone raises
        RendezvousError when reconnecting.
        """
        for _ in range(PUT_TRIES):
            try:
                return int(self._client("counter").add(key, delta))
            except dist.DistError:
                self._drop_client("counter")
            probe = self._client("counter")
            raw = probe.get(key) if probe.check([key]) else b""
            if not raw or raw.strip().lstrip(b"-").isdigit():
                continue  # gone, or already repaired: add again
            self._bad_record(key, raw, ForgedRecord("a counter that is not an integer: written without the job "
                                                    "secret"), fatal=False)
            probe.compare_set(key, raw, str(repair(probe)))
        raise BadStoreRecord(f"another program keeps overwriting the counter {key} in the rendezvous store at "
                             f"{self.rs.host}:{self.rs.port}; keep the endpoint's port private to the job's nodes")

    def _join_slots_used(self, store: TCPStore, r: int) -> int:
        """A join counter to repair: one past the highest slot of round R with a record (slots past the limit the
        closer looks at do not count). A joiner between its add and its record may share a slot with a later one:
        that node then stands by for this round (a delay, the cost of the forged counter)."""
        for j in range(2 * self.settings.max_nodes + 63, -1, -1):
            if store.check([self.keys.join(r, j)]):
                return j + 1
        return 0

    def _free_slot(self, store: TCPStore, r: int, limit: int) -> int:
        """The first join slot of round R that holds nothing (the counter proposed one nobody reads)."""
        for j in range(limit):
            if not store.check([self.keys.join(r, j)]):
                return j
        raise BadStoreRecord(f"round {r}: all {limit} join slots are taken (another program filled them); keep the "
                             "endpoint's port private to the job's nodes")

    def _drop_client(self, purpose: str) -> None:
        with self._lock:
            self._clients.pop(purpose, None)

    def _put_first(self, store: TCPStore, key: str, r: int, value: str, parse: Callable[[str], T]) -> tuple[T, bool]:
        """Write VALUE at KEY unless a valid record is there: (the record that stands, whether it is ours).

        The first valid writer wins. A forged value in the way is replaced with compare_set on exactly its bytes,
        so two agents racing to replace it still agree on one winner.
        """
        expected = b""
        for _ in range(PUT_TRIES):
            current = store.compare_set(key, expected, value)
            if current == value.encode():
                return parse(self.auth.open(key, r, current)), True
            try:
                return self._check(key, r, current, parse), False
            except BadRecord as exc:
                self._bad_record(key, current, exc, fatal=False)
            # EXPECTED back unchanged: the key is gone (compare_set does not create it then); else replace CURRENT
            expected = b"" if current == expected else current
        raise BadStoreRecord(f"another program keeps overwriting {key} in the rendezvous store at "
                             f"{self.rs.host}:{self.rs.port}; keep the endpoint's port private to the job's nodes")

    def _wait_valid(self, store: TCPStore, key: str, r: int, parse: Callable[[str], T],
                    deadline: float | None = None) -> T | None:
        """KEY's valid record; KEY exists (the caller waited for it). Forged values are reported and waited out
        until an agent replaces them; None after DEADLINE (monotonic)."""
        rec = self._read(store, key, r, parse, fatal=False)  # the usual case: one request
        if rec is not None:
            return rec
        backoff = _Backoff(self._closing, FORGED_POLL_MAX)
        while True:
            if store.check([key]):
                rec = self._read(store, key, r, parse, fatal=False)
                if rec is not None:
                    return rec
            if deadline is not None and time.monotonic() > deadline:
                return None
            backoff.sleep()

    def _stop_parser(self, store: TCPStore, r: int) -> Callable[[str], StopRecord]:
        """Parses a stop record of round R and checks that the nodes it names are in that round."""
        def parse(body: str) -> StopRecord:
            rec = parse_stop(body)
            if rec.round != r:
                raise BadRecord(f"round is {rec.round}, not {r}")
            self._check_stop_nodes(store, rec)
            return rec
        return parse

    def _check_stop_nodes(self, store: TCPStore, rec: StopRecord) -> None:
        """BadRecord unless REC names members of its round: its writer (a standby asking to scale up, or reporting
        a silent member: a node that joined the round) and the node and group rank it is about."""
        closed = self._closed_of(store, rec.round)
        if closed is None:
            raise BadRecord(f"round {rec.round} has no valid closed record")
        members = [n.node_id for n in closed["nodes"]]
        standby_ok = rec.kind in (StopKind.SCALE_UP, StopKind.NODE_LEFT)
        if rec.by_node not in members and not (standby_ok and self._joined(store, rec.round, rec.by_node)):
            raise BadRecord(f"by_node {rec.by_node[:80]!r} is not a node of round {rec.round}")
        if rec.kind is StopKind.SCALE_UP and rec.by_node in members:
            raise BadRecord(f"scale_up by {rec.by_node[:80]!r}, a member of round {rec.round}, not a standby")
        subject = rec.detail.node if rec.kind is StopKind.NODE_LEFT else rec.by_node
        if rec.kind is StopKind.NODE_LEFT and subject not in members:
            raise BadRecord(f"node_left names {str(subject)[:80]!r}, not a node of round {rec.round}")
        g = rec.detail.group_rank
        if g is not None and subject in members and g != members.index(subject):
            raise BadRecord(f"group_rank {g} is not the place of {str(subject)[:80]!r} in round {rec.round}")

    def _joined(self, store: TCPStore, r: int, node_id: str) -> bool:
        """Whether NODE_ID has a valid join record in round R (looked for only for a standby's stop record)."""
        return node_id in self._joined_ids(store, r, self._slot_limit())

    def _joined_ids(self, store: TCPStore, r: int, limit: int) -> set[str]:
        """The node ids with a valid join record among round R's first LIMIT slots (the counter says how many)."""
        count = self._count(self.keys.r(r, "count"), 0, lambda probe: self._join_slots_used(probe, r))
        slots = list(range(min(count, limit) if count >= 0 else limit))
        keys = [self.keys.join(r, j) for j in slots]
        present = [keys[j] for j in _present_slots(store, slots, keys)] if keys else []
        ids = set()
        for key, raw in zip(present, store.multi_get(present) if present else []):
            try:
                ids.add(self._check(key, r, raw, parse_join)["node_id"])
            except BadRecord as exc:
                self._bad_record(key, raw, exc, fatal=False)
        return ids

    def _raise_if_finished(self, store: TCPStore) -> None:
        rec = self._read_if(store, self.keys.finished, JOB_WIDE, parse_stop)
        if rec is not None and self._stop_of(store, rec.round) != rec:  # it must repeat a valid stop record
            self._bad_record(self.keys.finished, store.get(self.keys.finished),
                             BadRecord(f"it does not match the stop record of round {rec.round}"), fatal=False)
            rec = None
        if rec is not None:
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
                if any(n.node_id == self.node_id for n in record["nodes"]):
                    return self._enter_round(store, r, record, started)
                self._standby(store, r, record)
                r = self._open_round(store, r + 1)

    def _ensure_previous_stopped(self, store: TCPStore) -> None:
        """Rounds advance only through stop records; write one if the caller skipped it."""
        if self._result and self._stop_of(store, self._result.round) is None:
            log.warning("round %d has no stop record; recording it as interrupted", self._result.round)
            self._report_stop(store, self._result.round, StopKind.INTERRUPTED, StopDetail(node=self.node_id))

    def _stop_of(self, store: TCPStore, r: int) -> StopRecord | None:
        """Round R's valid stop record, if it has one yet (a forged one does not count)."""
        if r in self._stops:
            return self._stops[r]
        rec = self._read_if(store, self.keys.r(r, "stop"), r, self._stop_parser(store, r))
        if rec is not None:
            self._stops[r] = rec
        return rec

    def _open_round(self, store: TCPStore, at_least: int) -> int:
        """The first round at or after max(AT_LEAST, hint) that has not stopped yet."""
        hint = self._read_if(store, self.keys.hint, JOB_WIDE, _parse_hint) or 0
        r = max(at_least, hint)
        while self._stop_of(store, r) is not None:
            r += 1
        return r

    def _slot_limit(self) -> int:
        """How many join slots of a round anybody looks at (members, standbys and a margin)."""
        return 2 * self.settings.max_nodes + 64

    def _join(self, store: TCPStore, r: int) -> None:
        """Claim a free join slot of round R with this node's signed join record.

        The counter only proposes a slot: the record goes in with compare_set, so a slot already holding a value
        (a forged one, or a racing joiner's after a repaired counter) is never overwritten, and a proposal past
        the slots anybody reads (a forged bump) makes the joiner take the first free slot instead.
        """
        content = {**self.info._asdict(), "node_rank": self.settings.node_rank}
        limit = self._slot_limit()
        for _ in range(PUT_TRIES):
            j = self._count(self.keys.r(r, "count"), 1, lambda probe: self._join_slots_used(probe, r)) - 1
            if not 0 <= j < limit:
                j = self._free_slot(store, r, limit)
            key = self.keys.join(r, j)
            value = self._seal(key, r, content)
            if store.compare_set(key, "", value) == value.encode():
                break
        else:
            raise BadStoreRecord(f"round {r}: every join slot this agent tried was taken by another program; keep "
                                 "the endpoint's port private to the job's nodes")
        self._joiner = j
        log.debug("joined round %d as joiner %d", r, j)
        self.events.emit(RdzvJoin(round=r, node_id=self.node_id))

    def _wait_closed(self, store: TCPStore, r: int, started: float) -> dict:
        """Wait until round R is closed, closing it ourselves when max or the last call is reached.

        One agent polls: the first joiner (it closes at the last call), and the joiner that brings the
        round to MAX closes it at once. Every other agent blocks on the closed record, so N joining agents
        cost the store O(1) requests per poll instead of O(N); after a slice without news (the first joiner
        may have died) it takes one look itself and can close the round as a backup. The join counter only
        says where to look: membership comes from valid join records.
        """
        s = self.settings
        closed_key = self.keys.r(r, "closed")
        min_seen: float | None = None
        backoff = _Backoff(self._closing)
        follower = 0 < self._joiner < s.max_nodes - 1
        slots = _JoinSlots()
        while True:
            if follower and self._wait_slice(closed_key, max(s.last_call_timeout + 5.0, FOLLOWER_SLICE)):
                follower = False  # a forged value stands there: poll (and close) like the first joiner
            if store.check([closed_key]):
                record = self._read(store, closed_key, r, parse_closed, fatal=False)
                if record is not None:
                    self._closed[r] = record
                    return record
            self._raise_if_finished(store)
            count = self._count(self.keys.r(r, "count"), 0, lambda probe: self._join_slots_used(probe, r))
            if not 0 <= count <= self._slot_limit():
                count = self._slot_limit()  # bumped by another program: joiners took free slots from 0 up
            now = time.monotonic()
            valid, pending = self._gather_joins(store, r, max(count, self._joiner + 1), slots, now)
            if valid >= s.min_nodes:
                min_seen = min_seen if min_seen is not None else now
                if valid >= s.max_nodes or (now - min_seen >= s.last_call_timeout and not pending):
                    self._close(store, r, slots.joined())
                    continue
            elif now - started > s.join_timeout:
                raise RendezvousTimeout(
                    f"rendezvous round {r} timed out after {s.join_timeout:g} s with {valid} of "
                    f"{self._nodes_text()} nodes joined; {self._refused_text()}start the agents on the missing "
                    "nodes or raise --rdzv-conf join_timeout"
                )
            if not follower:
                backoff.sleep()

    def _refused_text(self) -> str:
        """On the store host: where agents with another job secret came from, for the timeout message."""
        refused = self.rs.refused
        if not refused:
            return ""
        return (f"{len(refused)} agent(s) tried to join with another job secret (from {', '.join(refused[:3])}"
                f"{', ...' if len(refused) > 3 else ''}): give every agent the same secret file; ")

    def _gather_joins(self, store: TCPStore, r: int, count: int, slots: _JoinSlots, now: float) -> tuple[int, int]:
        """Read the join slots not known yet: (valid joins, slots still waiting for their record).

        Joiners claim slots with compare_set, so a slot holding an invalid value never gets a real record: it is
        left out at once. An empty slot is left out after JOIN_SLOT_GRACE (its counter value was taken by a
        program without the secret). At most 2 * max nodes + 64 slots are looked at.
        """
        todo = slots.open_slots(count, self._slot_limit())
        if todo:
            present = _present_slots(store, todo, [self.keys.join(r, j) for j in todo])
            raws = store.multi_get([self.keys.join(r, j) for j in present]) if present else []
            for j, raw in zip(present, raws):
                try:
                    slots.valid[j] = self._check(self.keys.join(r, j), r, raw, parse_join)
                except BadRecord as exc:
                    self._bad_record(self.keys.join(r, j), raw, exc, fatal=False)
                    slots.dropped.add(j)
            late = [j for j in todo if j not in slots.valid and j not in slots.dropped
                    and now - slots.first_seen.setdefault(j, now) > JOIN_SLOT_GRACE]
            if late:
                slots.dropped.update(late)
                # no count in the line: the slots come from the join counter, which anybody can move
                log.warning("round %d: join slots without a join record after %g s are left out (taken by another "
                            "program?)", r, JOIN_SLOT_GRACE)
        pending = sum(1 for j in todo if j not in slots.valid and j not in slots.dropped)
        return len(slots.joined()), pending

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

    def _closed_of(self, store: TCPStore, r: int) -> dict | None:
        """Round R's valid closed record, if there is one."""
        if r not in self._closed:
            record = self._read_if(store, self.keys.r(r, "closed"), r, parse_closed)
            if record is None:
                return None
            self._closed[r] = record
        return self._closed[r]

    def _previous_order(self, store: TCPStore, r: int) -> list[str]:
        record = self._closed_of(store, r - 1) if r > 0 else None
        return [n.node_id for n in record["nodes"]] if record else []

    def _restarts_before(self, store: TCPStore, r: int) -> int:
        """The job-wide restart count when round R starts: what round R-1's (signed) stop record says."""
        if r == 0:
            return 0
        prev = self._stop_of(store, r - 1)
        if prev is None:  # a round opens only after the previous one stopped: someone removed or replaced it
            raise BadStoreRecord(f"round {r - 1} has no valid stop record in the rendezvous store at "
                                 f"{self.rs.host}:{self.rs.port} (another program overwrote it); keep the endpoint's "
                                 "port private to the job's nodes and relaunch")
        return prev.restart_count

    def _close(self, store: TCPStore, r: int, joined: list[dict]) -> None:
        """Write round R's membership; if another node closed it first, theirs stands."""
        record: dict[str, Any] = {"round": r, "restart_count": self._restarts_before(store, r)}
        try:
            members = order_members(joined, self._previous_order(store, r), self.settings.node_rank is not None)
            record["nodes"] = [{"node_id": m["node_id"], "addr": m["addr"], "nproc": m["nproc"]} for m in members]
        except RendezvousMismatch as exc:
            record["nodes"], record["error"] = [], str(exc)
        key = self.keys.r(r, "closed")
        self._closed[r], _ = self._put_first(store, key, r, self._seal(key, r, record), parse_closed)

    def _enter_round(self, store: TCPStore, r: int, record: dict, started: float) -> RoundResult:
        nodes = record["nodes"]
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
                store.set(key, self._seal(key, r, {"error": msg}))
                raise RendezvousError(msg) from None
            if self._master_name is None:  # resolved once: torchrun's getfqdn() can be slow
                self._master_name = master_addr_for_ranks(self.info.addr, s.local_addr)
            store.set(key, self._seal(key, r, {"addr": self._master_name, "port": port}))
            return self._master_name, port, True
        store.wait([key])  # group rank 0 publishes it right after the round closed
        pg = self._wait_valid(store, key, r, parse_pg, deadline=time.monotonic() + s.join_timeout)
        if pg is None:
            raise BadStoreRecord(f"round {r}: no valid process-group address from group rank 0 in "
                                 f"{s.join_timeout:g} s (another program overwrote {key}); keep the endpoint's port "
                                 "private to the job's nodes")
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
            self._report_stop(store, r, StopKind.FAILED, StopDetail(describe=msg, no_restart=True, round=r))
        raise PortInUse(msg)

    def _standby(self, store: TCPStore, r: int, record: dict) -> None:
        """Round R closed without us: ask it to make room, or wait for it to end."""
        room = len(record["nodes"]) < self.settings.max_nodes
        reason = "scale_up" if room else "round full"
        log.info("round %d already running with %d nodes; standing by (%s)", r, len(record["nodes"]), reason)
        self.events.emit(RdzvStandby(round=r, node_id=self.node_id, reason=reason, nodes=len(record["nodes"])))
        if room:
            self._report_stop(store, r, StopKind.SCALE_UP, StopDetail(node=self.node_id))
            return
        self._wait_standby(store, r, record)

    def _wait_standby(self, store: TCPStore, r: int, record: dict) -> None:
        """No timeout while the round lives; a round whose nodes fell silent is ended as node_left."""
        members = list(enumerate(record["nodes"]))
        alive = _Liveness(members, self.settings.keepalive_timeout)
        next_check = 0.0
        backoff = _Backoff(self._closing)
        while self._stop_of(store, r) is None:
            self._raise_if_finished(store)
            if time.monotonic() >= next_check:
                self._read_beats(store, r, alive)
                silent = alive.silent()
                if silent:
                    self._report_stop(store, r, StopKind.NODE_LEFT, StopDetail(node=silent[0], group_rank=silent[1]))
                next_check = time.monotonic() + self.settings.keepalive_interval
            backoff.sleep()

    # ------------------------------------------------------------ stops

    def report_stop(self, round: int, kind: StopKind | str, detail: StopDetail) -> StopRecord:
        """End ROUND for the reason DETAIL; idempotent across nodes: the first record wins and is returned to
        everyone. Its restart count and give-up flag are the agent's policy's verdict."""
        with self._store_errors():
            return self._report_stop(self._client(), round, kind, detail)

    def _round_restarts(self, store: TCPStore, r: int) -> int:
        """The restart count round R started with (from its signed closed record)."""
        if self._result is not None and self._result.round == r:
            return self._result.restart_count
        closed = self._closed_of(store, r)
        if closed is not None:
            return closed["restart_count"]
        prev = self._stop_of(store, r - 1) if r > 0 else None  # a round that never closed (not ours to end)
        return prev.restart_count if prev is not None else 0

    def _report_stop(self, store: TCPStore, r: int, kind: StopKind | str, detail: StopDetail) -> StopRecord:
        try:
            kind = StopKind(kind)
        except ValueError:
            raise ValueError(f"unknown stop kind {kind!r}; expected one of {', '.join(StopKind)}") from None
        known = self._stop_of(store, r)
        if known is not None:
            self._saw_stop(store, known)
            return known
        count, give_up = self.policy.decide(kind, detail, self._round_restarts(store, r))
        mine = StopRecord(r, kind, self.node_id, detail, count, give_up)
        key = self.keys.r(r, "stop")
        rec, won = self._put_first(store, key, r, self._seal(key, r, mine), self._stop_parser(store, r))
        if won:
            if give_up or kind is StopKind.SUCCEEDED:  # late agents learn from it that the job is over
                store.set(self.keys.finished, self._seal(self.keys.finished, JOB_WIDE, mine.fields()))
            store.set(self.keys.hint, self._seal(self.keys.hint, JOB_WIDE, {"round": r + 1}))
        self._stops[r] = rec
        self._saw_stop(store, rec)
        return rec

    def _saw_stop(self, store: TCPStore, rec: StopRecord) -> None:
        """Log/emit a round's stop once per agent, and ack it for the store host's linger."""
        with self._lock:
            if rec.round in self._stops_seen:
                return
            self._stops_seen.add(rec.round)
            self._stops[rec.round] = rec
        if self._result is not None and self._result.round == rec.round:  # signed: a counter could be bumped
            key = self.keys.ack(rec.round, self._result.group_rank)
            store.set(key, self._seal(key, rec.round, {"node_id": self.node_id}))
        log.info("round %d stopped: %s by %s (restarts %d%s)", rec.round, rec.kind, rec.by_node,
                 rec.restart_count, ", giving up" if rec.give_up else "")
        self.events.emit(RdzvStop(round=rec.round, kind=str(rec.kind), by_node=rec.by_node,
                                  detail=rec.detail, restart_count=rec.restart_count,
                                  give_up=rec.give_up))

    def claim(self, round: int, what: str) -> bool:
        """True for the one node whose signed claim of WHAT in ROUND is the first in the store (e.g. who saves
        the round's just-in-time checkpoint when no node knows which ranks were lost)."""
        with self._store_errors():
            store = self._client()
            key = self.keys.r(round, f"claim/{what}")
            _, won = self._put_first(store, key, round, self._seal(key, round, {"node_id": self.node_id}), json.loads)
            return won

    def standbys(self, round: int) -> int:
        """How many agents wait as standbys of ROUND: valid join records of nodes that are not its members (the
        join counter only says how many slots to look at; at most 64 past the members)."""
        with self._store_errors():
            store = self._client()
            closed = self._closed_of(store, round)
            if closed is None:
                return 0
            members = {n.node_id for n in closed["nodes"]}
            return len(self._joined_ids(store, round, len(members) + 64) - members)

    def wait_stop(self, round: int) -> StopRecord:
        """Block until ROUND has a valid stop record (for a watcher thread; uses its own connection)."""
        with self._store_errors():
            store = self._client("watch")
            key = self.keys.r(round, "stop")
            self._wait_for_key(store, key)
            rec = self._wait_valid(store, key, round, self._stop_parser(store, round))
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

    def node_succeeded(self, round: int) -> None:
        """All ranks of this node exited 0 in ROUND; the node that finds every member's (signed) success
        record ends the round. The counter only tells each node when to look."""
        with self._store_errors():
            store = self._client()
            if round in self._succeeded:
                return
            self._succeeded.add(round)
            g = self._result.group_rank if self._result is not None and self._result.round == round else None
            closed = self._closed_of(store, round)
            if closed is None:
                raise BadStoreRecord(f"round {round} has no valid closed record in the rendezvous store")
            members = [n.node_id for n in closed["nodes"]]
            g = g if g is not None else members.index(self.node_id)
            key = self.keys.succeeded(round, g)
            store.set(key, self._seal(key, round, {"node_id": self.node_id}))
            # the last node to write its record finds them all (no counter: one a program could bump or lower)
            if self._all_succeeded(store, round, members):
                self._report_stop(store, round, StopKind.SUCCEEDED, StopDetail(nodes=len(members)))

    def _all_succeeded(self, store: TCPStore, r: int, members: list[str]) -> bool:
        return self._all_signed(store, r, [self.keys.succeeded(r, g) for g in range(len(members))], members)

    def _all_signed(self, store: TCPStore, r: int, keys: list[str], members: list[str]) -> bool:
        """True when each of KEYS holds a valid record of round R naming the member at its place (one check, and
        one multi_get once all exist)."""
        if not store.check(keys):
            return False
        for g, (key, raw) in enumerate(zip(keys, store.multi_get(keys))):
            try:
                node = json.loads(self._check(key, r, raw, lambda body: body)).get("node_id")
            except (BadRecord, ValueError, AttributeError) as exc:
                self._bad_record(key, raw, exc if isinstance(exc, BadRecord) else BadRecord("not a record"), False)
                return False
            if node != members[g]:
                return False
        return True

    # ------------------------------------------------------------ keepalive

    def start_keepalive(self, result: RoundResult) -> None:
        """Beat this node's signed sequence and watch neighbours until stop_keepalive(), on a thread of its own
        with its own connection."""
        self.stop_keepalive()
        task = KeepaliveTask(self, result)
        self._ka_task = task
        self._ka_stop = threading.Event()
        self._ka_thread = threading.Thread(
            target=self._keepalive_loop,
            args=(task, self._ka_stop),
            name=f"nvrx-keepalive-r{result.round}",
            daemon=True,
        )
        self._ka_thread.start()

    def stop_keepalive(self, join: bool = True) -> float | None:
        """Stop beating; returns when the last beat was written (wall clock), None if there was none.
        JOIN=False: do not wait for the thread (cut off from the store, it is blocked in a request)."""
        self._ka_stop.set()
        task, self._ka_task = self._ka_task, None
        if self._ka_thread is not None:
            self._ka_thread.join(timeout=self.settings.keepalive_interval + 5.0 if join else 0.0)
            self._ka_thread = None
        return (task.last_beat or None) if task is not None else None

    def _keepalive_loop(self, task: "KeepaliveTask", stop: threading.Event) -> None:
        try:
            store = self._client("keepalive")
            next_beat = time.monotonic()
            while not stop.is_set():
                if time.monotonic() >= next_beat:
                    task.tick(store)
                    next_beat = time.monotonic() + self.settings.keepalive_interval
                else:  # woken at a neighbour's deadline: notice it then, not at the next beat
                    task.look(store)
                stop.wait(max(0.0, task.wake_at(next_beat) - time.monotonic()))
        except (dist.DistError, RendezvousError) as exc:
            if not stop.is_set() and not self._closing.is_set():
                log.warning("keepalive stopped: lost the rendezvous store (%s)", str(exc).splitlines()[0])

    def _read_beats(self, store: TCPStore, r: int, alive: _Liveness) -> None:
        """Feed ALIVE the watched nodes' valid beat sequence numbers of round R: one check and one multi_get for
        all of them (key by key only while some has not beaten yet)."""
        ids = list(alive.state)
        keys = [self.keys.beat(r, n) for n in ids]
        if not keys:
            return
        alive.begin_look()
        if store.check(keys):
            found = list(zip(ids, keys, store.multi_get(keys)))
        else:
            found = [(n, k, store.get(k)) for n, k in zip(ids, keys) if store.check([k])]
        for node_id, key, raw in found:
            try:
                alive.update(node_id, self._check(key, r, raw, _parse_seq))
            except BadRecord as exc:
                self._bad_record(key, raw, exc, fatal=False)
        alive.end_look()

    def _watch_once(self, store: TCPStore, r: int, alive: _Liveness) -> bool:
        """One look at the neighbours; False once the round is over (known from this agent's stop watcher: no
        request; a silent neighbour of a round that already stopped finds that stop record instead)."""
        if r in self._stops:
            return False
        self._read_beats(store, r, alive)
        silent = alive.silent()
        if silent is None:
            return True
        log.warning("node %s (group rank %d) stopped beating for %g s", silent[0], silent[1], alive.timeout)
        self._report_stop(store, r, StopKind.NODE_LEFT, StopDetail(node=silent[0], group_rank=silent[1]))
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
            keys = [self.keys.ack(res.round, g) for g in range(len(res.nodes))]
            members = [n.node_id for n in res.nodes]
            while not self._all_signed(store, res.round, keys, members) and time.monotonic() < deadline:
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
