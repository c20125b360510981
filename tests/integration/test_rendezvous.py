"""The rendezvous against a real TCPStore on 127.0.0.1, with several agents as threads.

Each "agent" has its own RendezvousStore (the first one on a port hosts it, the others join
as clients, exactly like several agents on one machine) and its own Rendezvous.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import psutil
import pytest

from nvrx.launcher.agent import rendezvous
from nvrx.launcher.agent.config import RdzvSettings
from nvrx.launcher.agent.rendezvous import (
    JobFinished,
    NodeInfo,
    Rendezvous,
    RendezvousTimeout,
    RoundResult,
    StopRecord,
    _parse_seq,
    order_members,
    watched_nodes,
)
from nvrx.launcher.agent.store import (
    EndpointUnreachable,
    PortInUse,
    RendezvousError,
    RendezvousMismatch,
    RendezvousStore,
    connect_client,
    master_addr_for_ranks,
    open_rendezvous_store,
)
from nvrx.common.net import resolve
from nvrx.events import EventLog, StopDetail
from nvrx.launcher.agent.restart_policy import RestartPolicy
from nvrx.common.net import start_store_server
from tests.conftest import free_port, wait_for

WAIT = 10.0  # bound on waits for something that must happen; reached only when it does not


def make_settings(port: int, **kw: Any) -> RdzvSettings:
    base: dict[str, Any] = dict(
        host="127.0.0.1",
        port=port,
        run_id="job",
        min_nodes=2,
        max_nodes=2,
        nproc_per_node=2,
        node_rank=None,
        local_addr=None,
        join_timeout=5.0,
        last_call_timeout=0.1,
        keepalive_interval=0.05,
        keepalive_timeout=0.5,
    )
    base.update(kw)
    return RdzvSettings(**base)


@dataclasses.dataclass
class Agent:
    rs: RendezvousStore
    rdzv: Rendezvous
    events: list[dict]
    changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def record(self, event: dict) -> None:
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def evs(self, name: str) -> list[dict]:
        with self.changed:
            return [e for e in self.events if e["ev"] == name]

    def wait_ev(self, name: str) -> dict:
        """This agent's first NAME event, waiting for it (bounded)."""
        with self.changed:
            assert self.changed.wait_for(lambda: self.evs(name), WAIT), f"no {name} event in {self.events}"
            return self.evs(name)[0]

    def beats(self, *node_ids: str, round_no: int = 0) -> Callable[[], list[int]]:
        """Reads the signed keepalive sequence numbers of NODE_IDS in ROUND_NO through a connection of its own."""
        store = self.rs.new_client()
        return lambda: [self.rdzv._read_if(store, self.rdzv.keys.beat(round_no, n), round_no, _parse_seq) or 0
                        for n in node_ids]

    def stopped(self, round_no: int) -> bool:
        """Whether ROUND_NO has a stop record yet."""
        return bool(self.rs.new_client().check([self.rdzv.keys.r(round_no, "stop")]))


def wait_for_beats(read: Callable[[], list[int]], more: int) -> None:
    """Wait until every counter READ returns has advanced by MORE beats."""
    start = read()
    assert wait_for(lambda: all(now >= s + more for now, s in zip(read(), start)), WAIT), (start, read())


def beats_past_timeout(s: RdzvSettings) -> int:
    """Beats whose spacing adds up to more than keepalive_timeout: long enough for a silent node to be noticed."""
    return int(s.keepalive_timeout / s.keepalive_interval) + 2


class Cluster:
    """Creates agents and closes them all (clients first, store host last) at teardown."""

    def __init__(self) -> None:
        self.agents: list[Agent] = []
        self.stores: list[RendezvousStore] = []

    def agent(self, settings: RdzvSettings, node_id: str, max_restarts: int = 3) -> Agent:
        rs = open_rendezvous_store(settings)
        self.stores.append(rs)
        log = EventLog(None, node_id)
        agent = Agent(rs, Rendezvous(rs, settings, RestartPolicy(max_restarts), log, node_id=node_id), [])
        log.subscribe(agent.record)
        self.agents.append(agent)
        return agent

    def close(self) -> None:
        for agent in sorted(self.agents, key=lambda a: a.rs.is_host):
            agent.rdzv.close()
        for rs in sorted(self.stores, key=lambda s: s.is_host):
            rs.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    extra = [t for t in set(threading.enumerate()) - before if t.name.startswith("nvrx-")]
    for thread in extra:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in extra if t.is_alive()]
    if left:
        pytest.fail(f"threads left behind: {left}")


def in_parallel(*calls: Callable[[], Any], timeout: float = 10.0) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futures]


def listen_addrs(port: int) -> set[str]:
    conns = psutil.Process().net_connections(kind="tcp")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


# ---------------------------------------------------------------- rounds


def test_two_nodes_form_one_round(cluster: Cluster) -> None:
    port = free_port()
    s = make_settings(port)
    b = cluster.agent(s, "node-b")
    a = cluster.agent(s, "node-a")
    assert b.rs.is_host and not a.rs.is_host
    assert listen_addrs(port) == {"127.0.0.1"}

    ra, rb = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    assert (ra.round, rb.round) == (0, 0)
    assert (ra.group_rank, rb.group_rank) == (0, 1)  # newcomers ordered by node id
    assert ra.nodes == rb.nodes == (NodeInfo("node-a", "127.0.0.1", 2), NodeInfo("node-b", "127.0.0.1", 2))
    assert ra.world_size == 4 and (ra.rank_offset, rb.rank_offset) == (0, 2)
    assert ra.restart_count == 0 and ra.agent_hosts_pg_store
    assert (ra.master_addr, ra.master_port) == (rb.master_addr, rb.master_port)
    # torchrun's MASTER_ADDR is the host's name; ours is that name only where it reaches the store's address
    assert ra.master_addr == master_addr_for_ranks("127.0.0.1", None)
    assert "127.0.0.1" in resolve(ra.master_addr)
    assert listen_addrs(ra.master_port) == {"127.0.0.1"}  # the ranks' store, hosted by group rank 0
    assert [e["round"] for e in a.evs("rdzv_join")] == [0]
    assert a.evs("rdzv_round")[0]["world_size"] == 4


def test_restart_round_keeps_group_ranks(cluster: Cluster) -> None:
    """The round after a failure keeps each node's group rank (its speed is measured in bench/bench_launch.py)."""
    s = make_settings(free_port())
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    r0a, _ = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    a.rdzv.report_stop(0, "failed", StopDetail(rank=0, exitcode=1))
    assert b.rdzv.wait_stop(0).kind == "failed"

    r1a, r1b = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    assert (r1a.round, r1a.group_rank, r1b.group_rank) == (1, 0, 1)
    assert r1a.restart_count == r1b.restart_count == 1
    assert r1a.master_port != r0a.master_port  # a fresh process-group store each round
    assert listen_addrs(r0a.master_port) == set()  # ...and the old one is gone


def test_scale_up_admits_a_late_node(cluster: Cluster) -> None:
    s = make_settings(free_port(), min_nodes=1, max_nodes=2, last_call_timeout=0.2)
    first = cluster.agent(s, "z-first")
    late = cluster.agent(s, "a-late")  # sorts before z-first, but must not take its rank
    r0 = first.rdzv.next_round()
    assert (r0.round, r0.group_rank, len(r0.nodes)) == (0, 0, 1)

    with ThreadPoolExecutor(max_workers=1) as pool:
        late_round = pool.submit(late.rdzv.next_round)
        stop = first.rdzv.wait_stop(0)
        assert (stop.kind, stop.by_node, stop.restart_count, stop.give_up) == ("scale_up", "a-late", 0, False)
        r1 = first.rdzv.next_round()
        r1_late = late_round.result(timeout=5)
    assert r1.round == r1_late.round == 1
    assert (r1.group_rank, r1_late.group_rank) == (0, 1)
    assert r1.restart_count == 0
    assert late.evs("rdzv_standby")[0]["reason"] == "scale_up"


def test_standby_waits_while_full_then_job_finished(cluster: Cluster) -> None:
    s = make_settings(free_port(), min_nodes=1, max_nodes=1)
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    r0 = a.rdzv.next_round()
    a.rdzv.start_keepalive(r0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(b.rdzv.next_round)
        assert b.wait_ev("rdzv_standby")["reason"] == "round full"
        # a beats for longer than keepalive_timeout while b watches it: a beating round is not ended
        wait_for_beats(a.beats("node-a"), beats_past_timeout(s))
        assert not waiting.done() and not a.stopped(0)
        a.rdzv.node_succeeded(0)
        with pytest.raises(JobFinished, match="succeeded"):
            waiting.result(timeout=5)
    a.rdzv.stop_keepalive()
    with pytest.raises(JobFinished):
        a.rdzv.next_round()


def test_standby_ends_a_silent_round(cluster: Cluster) -> None:
    s = make_settings(free_port(), min_nodes=1, max_nodes=1)
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    a.rdzv.next_round()  # a never beats: its node is gone as far as the job can tell
    r1 = b.rdzv.next_round()
    assert (r1.round, r1.nodes[0].node_id) == (1, "node-b")
    stop = a.rdzv.wait_stop(0)
    assert (stop.kind, stop.detail.node, stop.restart_count) == ("node_left", "node-a", 1)


def test_fixed_node_rank_is_the_group_rank(cluster: Cluster) -> None:
    port = free_port()
    a = cluster.agent(make_settings(port, node_rank=1), "node-a")
    b = cluster.agent(make_settings(port, node_rank=0), "node-b")
    ra, rb = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    assert (ra.group_rank, rb.group_rank) == (1, 0)


def test_duplicate_node_rank_is_a_mismatch(cluster: Cluster) -> None:
    s = make_settings(free_port(), node_rank=0)
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    with pytest.raises(RendezvousMismatch, match="two agents use --node-rank 0"):
        in_parallel(a.rdzv.next_round, b.rdzv.next_round)


def test_fixed_master_port_is_passed_through(cluster: Cluster) -> None:
    s = make_settings(free_port(), min_nodes=1, max_nodes=1, master_port=29999)
    r = cluster.agent(s, "node-a").rdzv.next_round()
    assert (r.master_addr, r.master_port, r.agent_hosts_pg_store) == ("127.0.0.1", 29999, False)


@pytest.mark.parametrize("nnodes, text", [((2, 2), "1 of 2 nodes"), ((2, 3), "1 of 2..3 nodes")])
def test_round_timeout_says_how_many_joined(cluster: Cluster, nnodes: tuple[int, int], text: str) -> None:
    s = make_settings(free_port(), min_nodes=nnodes[0], max_nodes=nnodes[1], join_timeout=0.3)
    with pytest.raises(RendezvousTimeout, match=f"round 0 timed out after 0.3 s with {text} joined"):
        cluster.agent(s, "node-a").rdzv.next_round()


# ---------------------------------------------------------------- stops and the restart budget


def test_restart_budget_is_job_wide(cluster: Cluster) -> None:
    s = make_settings(free_port())
    a, b = cluster.agent(s, "node-a", max_restarts=1), cluster.agent(s, "node-b", max_restarts=1)
    in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    sa, sb = in_parallel(
        lambda: a.rdzv.report_stop(0, "failed", StopDetail(rank=0)),
        lambda: b.rdzv.report_stop(0, "failed", StopDetail(rank=2)),
    )
    assert sa == sb and (sa.restart_count, sa.give_up) == (1, False)  # counted once
    assert a.rdzv.report_stop(0, "node_left", StopDetail()) == sa  # idempotent: the first record stands
    assert len(a.evs("rdzv_stop")) == 1

    # node b leaves; a new agent (new node id, new connection) takes its place
    b.rdzv.close()
    b2 = cluster.agent(s, "node-b2", max_restarts=1)
    r1a, r1b = in_parallel(a.rdzv.next_round, b2.rdzv.next_round)
    assert r1a.restart_count == r1b.restart_count == 1
    assert (r1a.group_rank, r1b.group_rank) == (0, 1)

    final = b2.rdzv.report_stop(1, "failed", StopDetail(rank=3))
    assert (final.restart_count, final.give_up) == (2, True)
    assert StopRecord.from_json(final.to_json()) == final
    late = cluster.agent(s, "node-late", max_restarts=1)
    for agent in (a, b2, late):
        with pytest.raises(JobFinished, match="gave up after 2 restarts"):
            agent.rdzv.next_round()


def test_keepalive_reports_a_silent_node(cluster: Cluster) -> None:
    s = make_settings(free_port())
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    ra, rb = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    a.rdzv.start_keepalive(ra)
    b.rdzv.start_keepalive(rb)
    wait_for_beats(a.beats("node-a", "node-b"), beats_past_timeout(s))
    assert not a.stopped(0)  # both beating for longer than keepalive_timeout: nothing happens
    b.rdzv.stop_keepalive()
    with ThreadPoolExecutor(max_workers=1) as pool:
        stop = pool.submit(a.rdzv.wait_stop, 0).result(timeout=WAIT)
    assert (stop.kind, stop.by_node, stop.detail.to_fields()) == ("node_left", "node-a", {"node": "node-b", "group_rank": 1})
    assert stop.restart_count == 1
    a.rdzv.stop_keepalive()


def forger(port: int) -> Any:
    """A plain TCPStore client without the job secret: what any process that reaches the port can open."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False)


def test_forged_records_cannot_form_stop_or_keep_alive(cluster: Cluster) -> None:
    """With a job secret: a forged membership and an empty join slot do not keep the round from forming; a forged
    stop neither ends it nor blocks the real one; forged beats do not keep a silent node alive; a replay of round
    0's stop record into round 1 is ignored."""
    s = make_settings(free_port(), job_secret=b"the-job-secret-0123456789", job_secret_file="test")
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    evil, p = forger(s.port), "nvrx/job/"
    evil.set(p + "r0/closed", '{"round":0,"restart_count":0,"nodes":[{"node_id":"evil","addr":"10.0.0.9","nproc":2}]}')
    evil.add(p + "r0/count", 1)  # a join slot nobody fills
    ra, rb = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    assert [n.node_id for n in ra.nodes] == [n.node_id for n in rb.nodes] == ["node-a", "node-b"]
    evil.set(p + "r0/stop", '{"round":0,"kind":"failed","by_node":"evil","detail":{},"restart_count":9,"give_up":true}')
    evil.set(p + "r0/beat/node-b", "nvrx1:" + "0" * 64 + ':{"seq":99}')
    a.rdzv.start_keepalive(ra)  # node-b never beats: only the forged beat speaks for it
    with ThreadPoolExecutor(max_workers=1) as pool:
        stop = pool.submit(b.rdzv.wait_stop, 0).result(timeout=WAIT)
    a.rdzv.stop_keepalive()
    assert (stop.kind, stop.by_node, stop.restart_count, stop.give_up) == ("node_left", "node-a", 1, False)
    assert a.rdzv.wait_stop(0) == stop
    forged = {e["key"] for e in a.evs("rdzv_forged_record") + b.evs("rdzv_forged_record")}
    assert {p + "r0/closed", p + "r0/stop", p + "r0/beat/node-b"} <= forged, forged

    r1a, r1b = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    assert r1a.round == r1b.round == 1 and r1a.restart_count == r1b.restart_count == 1
    evil.set(p + "r1/stop", evil.get(p + "r0/stop"))  # replay: a real, signed record of round 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        watching = pool.submit(b.rdzv.wait_stop, 1)
        assert not wait_for(watching.done, 1.0)  # the replay ends nothing
        a.rdzv.report_stop(1, "interrupted", StopDetail(signum=15))
        assert (watching.result(timeout=WAIT).kind, watching.result().restart_count) == ("interrupted", 1)


def test_counters_overwritten_with_garbage_are_reported_and_repaired(cluster: Cluster) -> None:
    """A plain TCPStore client without the secret overwrites the join counter with a non-integer (the store drops
    any connection that then adds to such a value): the agents report it (rdzv_forged_record), repair it and the
    round forms and succeeds as usual."""
    s = make_settings(free_port(), job_secret=b"the-job-secret-0123456789", job_secret_file="test")
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    evil, p = forger(s.port), "nvrx/job/"
    evil.set(p + "r0/count", "not-a-number")
    ra, rb = in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    assert [n.node_id for n in ra.nodes] == [n.node_id for n in rb.nodes] == ["node-a", "node-b"]
    a.rdzv.node_succeeded(0)
    b.rdzv.node_succeeded(0)
    stop = a.rdzv.wait_stop(0)
    assert (stop.kind, stop.restart_count, stop.give_up) == ("succeeded", 0, False)
    assert b.rdzv.wait_stop(0) == stop
    forged = {e["key"] for e in a.evs("rdzv_forged_record") + b.evs("rdzv_forged_record")}
    assert p + "r0/count" in forged, forged
    assert int(evil.add(p + "r0/count", 0)) == 2  # repaired to the slots in use


@pytest.mark.parametrize("bump", [1000, -1000])
def test_a_forged_counter_bump_decides_nothing(cluster: Cluster, bump: int, caplog: pytest.LogCaptureFixture) -> None:
    """The join counter moved by a program without the secret (issue 26: +1000 made both agents time out with
    "1002 of 2 nodes joined"): the joiners claim free slots, the round closes at once, no message repeats the
    forged number. Success needs every member's signed record whatever a counter says."""
    s = make_settings(free_port(), job_secret=b"the-job-secret-0123456789", join_timeout=30.0)
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    evil, p = forger(s.port), "nvrx/job/"
    evil.add(p + "r0/count", bump)
    started = time.monotonic()
    ra, rb = in_parallel(a.rdzv.next_round, b.rdzv.next_round, timeout=40)
    assert time.monotonic() - started < 10  # not join_timeout
    assert [n.node_id for n in ra.nodes] == [n.node_id for n in rb.nodes] == ["node-a", "node-b"]
    evil.add(p + "r0/succeeded", 1000)  # the success counter of earlier versions: means nothing now
    a.rdzv.node_succeeded(0)
    assert not a.stopped(0)  # node-b has not said so
    b.rdzv.node_succeeded(0)
    assert a.rdzv.wait_stop(0).kind == "succeeded"
    assert str(abs(bump)) not in caplog.text and str(abs(bump) + 2) not in caplog.text


def test_a_stop_record_naming_a_node_outside_the_round_is_refused(cluster: Cluster) -> None:
    """A stop record signed with the job secret but naming a node that is not in the round (writer, or the node a
    node_left is about, or a group rank that is not the writer's place) is ignored and reported."""
    secret = b"the-job-secret-0123456789"
    s = make_settings(free_port(), job_secret=secret)
    a, b = cluster.agent(s, "node-a"), cluster.agent(s, "node-b")
    in_parallel(a.rdzv.next_round, b.rdzv.next_round)
    evil, key = forger(s.port), "nvrx/job/r0/stop"
    outsider = {"round": 0, "kind": "succeeded", "by_node": "old-node", "detail": {}, "restart_count": 0,
                "give_up": False}
    assert evil.compare_set(key, "", a.rs.auth.seal(key, 0, outsider)) == a.rs.auth.seal(key, 0, outsider).encode()
    with ThreadPoolExecutor(max_workers=1) as pool:
        watching = pool.submit(b.rdzv.wait_stop, 0)
        assert not wait_for(watching.done, 1.0)  # refused: nothing ended
        for wrong in ({**outsider, "kind": "node_left", "by_node": "node-a", "detail": {"node": "old-node"}},
                      {**outsider, "kind": "failed", "by_node": "node-a", "detail": {"group_rank": 1}}):
            evil.set(key, a.rs.auth.seal(key, 0, wrong))
            assert not wait_for(watching.done, 0.5)
        a.rdzv.report_stop(0, "failed", StopDetail(rank=0, group_rank=0))
        assert (watching.result(timeout=WAIT).kind, watching.result().by_node) == ("failed", "node-a")
    problems = [e["problem"] for e in b.evs("rdzv_bad_record")]
    assert any("'old-node' is not a node of round 0" in p for p in problems), problems
    assert any("group_rank 1 is not the place of 'node-a'" in p for p in problems), problems


def test_records_of_an_earlier_launch_are_refused() -> None:
    """`nvrx resume` relaunches with the same run id and secret: every record of launch A (a signed stop record,
    the finished record, the greeting's answer) copied into launch B's store fails the check."""
    s = make_settings(free_port(), job_secret=b"the-job-secret-0123456789", job_secret_file="test")
    saved: dict[str, bytes] = {}
    launch_a = Cluster()
    try:
        a, b = launch_a.agent(s, "node-a"), launch_a.agent(s, "node-b")
        in_parallel(a.rdzv.next_round, b.rdzv.next_round)
        a.rdzv.node_succeeded(0)
        b.rdzv.node_succeeded(0)
        assert a.rdzv.wait_stop(0).kind == "succeeded"
        spy = forger(s.port)
        for key in ("nvrx/job/r0/stop", "nvrx/job/finished", "nvrx/job/r0/closed"):
            saved[key] = spy.get(key)
        assert a.rs.auth.launch != "" and a.rs.auth.launch == b.rs.auth.launch
        launch, launch_ns = a.rs.auth.launch, a.rs.launch
        assert launch_ns.isdigit() and b.rs.launch == launch_ns  # the checkpoint fence's launch, from the nonce
    finally:
        launch_a.close()
    launch_b = Cluster()
    try:
        host = launch_b.agent(s, "node-a2")
        evil = forger(s.port)
        for key, raw in saved.items():
            evil.set(key, raw)
        other = launch_b.agent(s, "node-b2")
        assert host.rs.auth.launch == other.rs.auth.launch != launch
        assert host.rs.launch == other.rs.launch and int(host.rs.launch) > int(launch_ns)  # a later launch orders after
        ra, rb = in_parallel(host.rdzv.next_round, other.rdzv.next_round)  # not JobFinished: the replay is refused
        assert ra.round == 0 and [n.node_id for n in ra.nodes] == ["node-a2", "node-b2"]
        with ThreadPoolExecutor(max_workers=1) as pool:
            watching = pool.submit(other.rdzv.wait_stop, 0)
            assert not wait_for(watching.done, 1.0)  # launch A's "succeeded" ends nothing
            host.rdzv.report_stop(0, "interrupted", StopDetail(signum=15))
            assert watching.result(timeout=WAIT).kind == "interrupted"
        forged = {e["key"] for e in host.evs("rdzv_forged_record") + other.evs("rdzv_forged_record")}
        assert {"nvrx/job/r0/stop", "nvrx/job/finished"} <= forged, forged
    finally:
        launch_b.close()


def test_an_empty_join_slot_is_left_out_after_a_grace(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A join counter bumped by a program without the secret (slots that never get a valid join record) delays an
    elastic round by at most JOIN_SLOT_GRACE; the round then closes with the agents that did join."""
    monkeypatch.setattr(rendezvous, "JOIN_SLOT_GRACE", 0.3)
    s = make_settings(free_port(), min_nodes=1, max_nodes=3, job_secret=b"the-job-secret-0123456789")
    a = cluster.agent(s, "node-a")
    evil = forger(s.port)
    evil.add("nvrx/job/r0/count", 2)
    evil.set("nvrx/job/r0/join/1", '{"node_id":"evil","addr":"10.0.0.9","nproc":2,"node_rank":null}')
    (r0,) = in_parallel(a.rdzv.next_round)
    assert [n.node_id for n in r0.nodes] == ["node-a"]
    assert [e["key"] for e in a.evs("rdzv_forged_record")] == ["nvrx/job/r0/join/1"]


def test_wait_stop_raises_when_the_store_is_lost() -> None:
    c = Cluster()
    s = make_settings(free_port(), min_nodes=1, max_nodes=2, last_call_timeout=0.0)
    host = c.agent(s, "node-a")
    client = c.agent(s, "node-b")
    host.rdzv.next_round()  # round 0 closes with the host alone (last call 0)
    host.rdzv.report_stop(0, "interrupted", StopDetail())
    client.rdzv.wait_stop(0)  # a stopped round: returns at once, and the watcher's own connection now exists
    with ThreadPoolExecutor(max_workers=1) as pool:
        watching = pool.submit(client.rdzv.wait_stop, 1)  # polls that connection until the host goes
        host.rdzv.close()
        host.rs.close()
        with pytest.raises(RendezvousError, match="lost the rendezvous store"):
            watching.result(timeout=5)
    client.rdzv.close()
    client.rs.close()


# ---------------------------------------------------------------- store errors


def test_rdzv_id_mismatch(cluster: Cluster) -> None:
    port = free_port()
    cluster.agent(make_settings(port, run_id="alpha"), "node-a")
    with pytest.raises(RendezvousMismatch, match=r"--rdzv-id beta but the rendezvous at 127.0.0.1:\d+ serves alpha"):
        open_rendezvous_store(make_settings(port, run_id="beta"))


def test_nproc_mismatch(cluster: Cluster) -> None:
    port = free_port()
    cluster.agent(make_settings(port, nproc_per_node=2), "node-a")
    with pytest.raises(RendezvousMismatch, match="--nproc-per-node 4 but the job .* uses 2"):
        open_rendezvous_store(make_settings(port, nproc_per_node=4))


def test_unreachable_endpoint_refused() -> None:
    # the message reports how long it tried: the bound given, not an endless retry
    with pytest.raises(EndpointUnreachable, match=r"after 1\.\d s \(connection refused\); start the agent"):
        connect_client("127.0.0.1", free_port(), wait=1.0)


def test_unreachable_endpoint_unresolvable() -> None:
    s = make_settings(4242, host="nvrx-no-such-host.invalid", join_timeout=1.0)
    with pytest.raises(EndpointUnreachable, match=r"nvrx-no-such-host.invalid:4242 after 1\.\d s"):
        open_rendezvous_store(s)


def test_port_held_by_a_plain_socket() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 .*--rdzv-endpoint 127.0.0.1:OTHER_PORT"):
            open_rendezvous_store(make_settings(port, join_timeout=1.0))
    finally:
        holder.close()  # releases the abandoned handshake thread


def _stall_first_connection(target_port: int) -> tuple[socket.socket, list[socket.socket]]:
    """A loopback listener that holds its first connection silent and pipes later ones to TARGET_PORT.

    It stands for a store whose first handshake stalls (torch resolves every peer's address; a resolver
    that drops a query holds the connection for seconds), not for a listener that never answers.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stalled: list[socket.socket] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def handle(conn: socket.socket) -> None:
        try:
            first = conn.recv(65536)
        except OSError:
            return
        if not first:  # a plain connect-and-close probe
            return
        if not stalled:
            stalled.append(conn)  # the first handshake: never answered
            return
        upstream = socket.create_connection(("127.0.0.1", target_port))
        held.append(upstream)
        upstream.sendall(first)
        threading.Thread(target=pipe, args=(conn, upstream), daemon=True).start()
        pipe(upstream, conn)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, held


def test_a_stalled_first_handshake_is_tried_once_more() -> None:
    server, port = start_store_server("127.0.0.1")
    listener, held = _stall_first_connection(port)
    try:
        client = connect_client("127.0.0.1", listener.getsockname()[1], wait=0.5, handshake_timeout=1.0)
        client.set("through-the-second-connection", "yes")
        assert server.get("through-the-second-connection") == b"yes"
        assert len(held) >= 3  # the silent first handshake, then the piped one and its upstream
        del client
    finally:
        listener.close()
        for conn in held:
            conn.close()
        del server


def test_port_held_by_a_foreign_tcpstore() -> None:
    foreign, port = start_store_server("127.0.0.1")
    try:
        with pytest.raises(PortInUse, match="not an nvrx rendezvous"):
            open_rendezvous_store(make_settings(port, join_timeout=1.0))
    finally:
        del foreign


def test_standalone_hosts_on_a_free_loopback_port() -> None:
    rs = open_rendezvous_store(make_settings(0, min_nodes=1, max_nodes=1, standalone=True))
    try:
        assert rs.is_host and rs.host == "127.0.0.1" and rs.port > 0
        assert listen_addrs(rs.port) == {"127.0.0.1"}
        extra = rs.new_client()
        extra.set("k", "v")
        assert rs.store.get("k") == b"v"
    finally:
        rs.close()


# ---------------------------------------------------------------- pure helpers


def test_order_members_keeps_previous_order_then_new_by_id() -> None:
    joined = [{"node_id": n} for n in ("d", "b", "x", "a")]
    assert [m["node_id"] for m in order_members(joined, ["x", "gone", "b"], False)] == ["x", "b", "a", "d"]


def test_watched_nodes_are_ring_neighbours() -> None:
    nodes = tuple(NodeInfo(str(i), "h", 1) for i in range(8))
    res = RoundResult(0, 0, nodes, 0, "h", 1, True)
    assert [g for g, _ in watched_nodes(res)] == [1, 2, 6, 7]
    small = dataclasses.replace(res, nodes=nodes[:3], group_rank=1)
    assert [g for g, _ in watched_nodes(small)] == [0, 2]


def test_the_host_names_an_agent_with_another_secret_at_once(cluster: Cluster,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A joiner with another job secret (or none) is refused with one line; the store host says at once, in one
    warning line, that it tried to join and from where, and its own join timeout repeats it."""
    import os

    s = make_settings(free_port(), job_secret=b"the-job-secret-0123456789", job_secret_file="/p/a", join_timeout=1.0)
    host = cluster.agent(s, "node-a")
    wrong = dataclasses.replace(s, job_secret=b"another-secret-of-another-job", job_secret_file="/p/b")
    with pytest.raises(RendezvousMismatch, match="differs"):
        open_rendezvous_store(wrong)
    where = f"host {socket.gethostname()} (pid {os.getpid()})"
    assert wait_for(lambda: host.rs.refused == [where], WAIT), host.rs.refused
    lines = [r.getMessage() for r in caplog.records if "tried to join" in r.getMessage()]
    assert lines == [f"an agent on {where} tried to join job job with a different job secret (its secret: file /p/b); "
                     "it was refused: give every agent of the job the same secret file (NVRX_JOB_SECRET_FILE)"], lines
    with pytest.raises(RendezvousTimeout, match=f"1 agent\\(s\\) tried to join with another job secret \\(from "
                                                f"{re.escape(where)}\\)"):
        host.rdzv.next_round()


def test_a_forged_answer_to_the_greeting_is_not_taken() -> None:
    """An answer to a joiner's greeting written by a program without the secret (or copied from an earlier
    launch) does not check; the joiner waits for the host's own answer and gets the host's launch."""
    from torch.distributed import TCPStore

    from nvrx.launcher.agent import store as store_mod
    from nvrx.launcher.agent.rdzv_auth import RecordAuth

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    auth = RecordAuth("job", b"k" * 32, True, "test")
    joiner, evil = (TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(2))
    got: list[RecordAuth] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        learning = pool.submit(store_mod.learn_launch, joiner, auth, "127.0.0.1", server.port, 10.0)
        hello = json.loads(server.queue_pop(store_mod.HELLO_QUEUE, block=True))  # the "host" takes the greeting
        key = store_mod.LAUNCH_KEY + hello["challenge"]
        old = auth.for_launch("").seal(store_mod.LAUNCH_KEY + "0" * 32, -1, {"launch": "old", "challenge": "0" * 32})
        evil.set(key, old)  # an earlier launch's answer, moved to this challenge's key
        assert not wait_for(learning.done, 0.5)
        evil.set(key, auth.for_launch("").seal(key, -1, {"launch": "old", "challenge": "f" * 32}))  # wrong challenge
        assert not wait_for(learning.done, 0.5)
        server.set(key, auth.for_launch("").seal(key, -1, {"launch": "fresh", "challenge": hello["challenge"]}))
        got.append(learning.result(timeout=WAIT))
    assert got[0].launch == "fresh"


def test_the_checkpoint_fences_launch_comes_only_from_the_hosts_signed_answer() -> None:
    """NVRX_LAUNCH (the checkpoint fence's launch, nvrx/ckpt/fence.py) is the time part of the launch nonce, which a
    joiner takes only from the host's signed answer: a program without the secret that answers first with an early
    or late launch time, or writes the unsigned meta key older agents read, changes nothing."""
    from torch.distributed import TCPStore

    from nvrx.launcher.agent import store as store_mod
    from nvrx.launcher.agent.rdzv_auth import RecordAuth, launch_time_ns, new_launch

    real = new_launch()
    assert launch_time_ns(real).isdigit() and abs(int(launch_time_ns(real)) - time.time_ns()) < 60e9
    assert launch_time_ns("fresh") == "" and launch_time_ns("12x-ab") == "" and launch_time_ns("9" * 30 + "-a") == ""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    auth = RecordAuth("job", b"k" * 32, True, "test")
    outsider = RecordAuth("job", b"not-the-job-secret-0123", True, "test")
    joiner, evil = (TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(2))
    evil.set("nvrx/meta/launch_ns", "99999999999999999999")
    with ThreadPoolExecutor(max_workers=1) as pool:
        learning = pool.submit(store_mod.learn_launch, joiner, auth, "127.0.0.1", server.port, 10.0)
        hello = json.loads(server.queue_pop(store_mod.HELLO_QUEUE, block=True))
        key = store_mod.LAUNCH_KEY + hello["challenge"]
        for forged in (f"1-{'0' * 32}", f"{'9' * 20}-{'0' * 32}"):
            evil.set(key, outsider.for_launch("").seal(key, -1, {"launch": forged, "challenge": hello["challenge"]}))
            assert not wait_for(learning.done, 0.5)
        server.set(key, auth.for_launch("").seal(key, -1, {"launch": real, "challenge": hello["challenge"]}))
        learnt = learning.result(timeout=WAIT)
    assert learnt.launch == real
    assert RendezvousStore(joiner, False, "127.0.0.1", server.port, learnt).launch == launch_time_ns(real)
