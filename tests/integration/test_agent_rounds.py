"""The agent's round loop (Agent._supervise / _conclude) against a real rendezvous and a real peer.

The agent under test runs the production path (Agent.run in the main thread, so its signal
handlers work) with trivial ranks: `/bin/sh` (no Python, no fork server), told by PLAN_<round>
to exit with a code or to hold until stopped. Its peer is a bare Rendezvous in a thread on the
same TCPStore (the peer hosts it): it joins the rounds, beats, and writes the stop records another
node would write. Every wait is on a store key, a stop record or an event, each bounded.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from nvrx.launcher.agent.agent import Agent
from nvrx.launcher.agent.config import LaunchConfig, RdzvSettings, WorkerSettings
from nvrx.launcher.agent.rdzv_records import StopKind
from nvrx.launcher.agent.rendezvous import Rendezvous
from nvrx.launcher.agent.restart_policy import RestartPolicy
from nvrx.launcher.agent.store import RendezvousStore, open_rendezvous_store
from nvrx.events import EventLog, StopDetail
from nvrx.common import exit_codes
from tests.conftest import free_port

RANK = 'eval "what=\\${PLAN_$NVRX_ROUND:-hold}"; if [ "$what" = hold ]; then exec sleep 600; fi; exit "$what"'
WAIT = 30.0  # bound on every wait; reached only when something is broken


class Job:
    """One agent (the code under test) and one peer node, sharing a rendezvous on 127.0.0.1."""

    def __init__(self, tmp_path: Path, plan: dict[int, str], max_restarts: int = 1,
                 signals: tuple[signal.Signals, ...] = ()) -> None:
        self.settings = RdzvSettings(host="127.0.0.1", port=free_port(), run_id="rounds", min_nodes=2, max_nodes=2,
                                     nproc_per_node=1, node_rank=None, local_addr=None, join_timeout=WAIT,
                                     last_call_timeout=0.1, keepalive_interval=0.05, keepalive_timeout=WAIT)
        self.peer_store: RendezvousStore = open_rendezvous_store(self.settings)  # first on the port: it hosts
        self.peer = Rendezvous(self.peer_store, self.settings, RestartPolicy(max_restarts), EventLog(None, "peer"),
                               node_id="peer")
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        log = EventLog(None, "agent")
        log.subscribe(self._on_event)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **{f"PLAN_{r}": what for r, what in plan.items()}}
        workers = WorkerSettings(entrypoint="/bin/sh", args=("-c", RANK), nproc_per_node=1, no_python=True,
                                 fork_server=False, term_timeout=WAIT, kill_timeout=5.0, base_env=env)
        cfg = LaunchConfig(rdzv=self.settings, workers=workers, max_restarts=max_restarts,
                           signals_to_handle=signals, run_log_dir=tmp_path / "run", node_name="test-node")
        self.agent = Agent(cfg, log)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def evs(self, name: str) -> list[dict[str, Any]]:
        with self._changed:
            return [e for e in self.events if e["ev"] == name]

    def wait_event(self, name: str, **fields: Any) -> dict[str, Any]:
        """The agent's first NAME event with FIELDS, waiting for it (bounded)."""
        def match() -> dict[str, Any] | None:
            return next((e for e in self.events if e["ev"] == name and fields.items() <= e.items()), None)

        with self._changed:
            if not self._changed.wait_for(lambda: match() is not None, WAIT):
                raise AssertionError(f"the agent emitted no {name} {fields}; events: {self.events}")
            return match()  # type: ignore[return-value]

    @property
    def agent_node(self) -> str:
        return self.wait_event("rdzv_join")["node_id"]

    def wait_key(self, key: str) -> None:
        """Block until KEY exists in the rendezvous store (the store's own wait, not a poll)."""
        self.peer_store.store.wait([self.peer.keys.prefix + key])

    def run(self, peer_script: Callable[[Rendezvous], Any]) -> tuple[int, Any]:
        """Agent.run() here, PEER_SCRIPT in a thread; (the agent's exit code, what the script returned)."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            peer = pool.submit(self._guarded, peer_script)
            code = self.agent.run()
            return code, peer.result(timeout=WAIT)

    def _guarded(self, peer_script: Callable[[Rendezvous], Any]) -> Any:
        try:
            return peer_script(self.peer)
        except BaseException:
            # free the agent (it would wait for this peer until WAIT): end whatever round is open
            self.peer.report_stop(self.peer._open_round(self.peer_store.store, 0), "interrupted",
                                  StopDetail(signum=int(signal.SIGKILL)))
            raise

    def close(self) -> None:
        self.peer.close()
        self.peer_store.close()


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(plan: dict[int, str], **kw: Any) -> Job:
        jobs.append(Job(tmp_path, plan, **kw))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


@pytest.fixture
def transitions(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The agent's round-state transitions so far, as logged ("round 0: running -> failed")."""
    caplog.set_level(logging.DEBUG, logger="nvrx.launcher.agent.agent")
    return lambda: [r.getMessage() for r in caplog.records
                    if r.name == "nvrx.launcher.agent.agent" and " -> " in r.getMessage()]


def join_and_beat(peer: Rendezvous) -> Any:
    result = peer.next_round()
    peer.start_keepalive(result)
    return result


# ---------------------------------------------------------------- a stop record written by the peer


@pytest.mark.parametrize("kind", [StopKind.FAILED, StopKind.NODE_LEFT])
def test_peer_fault_sends_the_agent_to_the_next_round(job_factory, transitions, kind: StopKind) -> None:
    job = job_factory({0: "hold", 1: "0"}, max_restarts=1)

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        # node_left names the node that fell silent (a member of the round: here the peer itself)
        peer.report_stop(0, kind, StopDetail(rank=1, node="peer" if kind is StopKind.NODE_LEFT else None))
        r1 = join_and_beat(peer)  # returns only once the agent joined round 1 too
        peer.node_succeeded(1)
        return r1, peer.wait_stop(1)

    code, (r1, stop) = job.run(peer_script)
    assert code == exit_codes.OK
    assert (r1.round, len(r1.nodes), r1.restart_count) == (1, 2, 1)
    assert (stop.kind, stop.give_up) == (StopKind.SUCCEEDED, False)
    named = {"node": "peer"} if kind is StopKind.NODE_LEFT else {}
    assert job.agent.failures == [{"round": 0, "kind": kind, "rank": 1, **named}]
    r0_exit = job.wait_event("rank_exit", attempt=0)
    assert r0_exit["signal"] == "SIGTERM"  # the held rank was stopped for the restart
    assert transitions() == ["round 1: running -> succeeded"]  # round 0 ended by the peer's record alone
    assert job.evs("job_end")[0]["status"] == "succeeded"


def test_peer_fault_with_the_budget_spent_gives_up(job_factory, transitions) -> None:
    job = job_factory({0: "hold"}, max_restarts=0)

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        return peer.report_stop(0, "failed", StopDetail(rank=1, exitcode=1))

    code, stop = job.run(peer_script)
    assert stop.give_up and stop.restart_count == 1
    assert code == exit_codes.FAILED
    assert job.evs("rdzv_join") and [e["round"] for e in job.evs("rdzv_join")] == [0]  # no next round
    assert job.wait_event("rank_exit", attempt=0)["signal"] == "SIGTERM"
    assert transitions() == []
    assert job.evs("job_end")[0]["status"] == "failed"


def test_peer_steering_code_ends_the_job_with_it(job_factory) -> None:
    job = job_factory({0: "hold"}, max_restarts=5)

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        steer = exit_codes.RESUME_ELSEWHERE
        return peer.report_stop(0, "failed", StopDetail(rank=1, exitcode=steer, steer=steer, no_restart=True))

    code, stop = job.run(peer_script)
    assert stop.give_up and stop.restart_count == 1  # budget left, but the rank asked for no restart
    assert code == exit_codes.RESUME_ELSEWHERE
    assert job.evs("job_end")[0]["status"] == "steered"


def test_peer_interrupt_passes_its_signal_to_the_ranks(job_factory, transitions) -> None:
    job = job_factory({0: "hold"})

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        job.wait_event("rank_start", attempt=0)
        return peer.report_stop(0, "interrupted", StopDetail(signal="SIGUSR1", signum=int(signal.SIGUSR1)))

    code, stop = job.run(peer_script)
    assert stop.by_node == "peer"
    assert code == exit_codes.interrupted(signal.SIGUSR1)
    # SIGUSR1 (not the SIGTERM/SIGKILL of stopping) killed the rank: the agent passed the peer's signal on
    assert job.wait_event("rank_exit", attempt=0)["signal"] == "SIGUSR1"
    assert transitions() == []
    assert job.agent.failures == []


# ---------------------------------------------------------------- a stop record written by the agent


def test_local_failure_is_reported_then_the_next_round_succeeds(job_factory, transitions) -> None:
    job = job_factory({0: "3", 1: "0"}, max_restarts=1)

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        stop = peer.wait_stop(0)
        join_and_beat(peer)
        peer.node_succeeded(1)
        peer.wait_stop(1)  # as an agent would: seeing the final record acks it, so the store host need not linger
        return stop

    code, stop = job.run(peer_script)
    assert code == exit_codes.OK
    assert (stop.kind, stop.by_node, stop.restart_count, stop.give_up) == ("failed", job.agent_node, 1, False)
    rank = stop.detail.rank  # 0 or 1: group ranks of newcomers follow their node ids
    assert stop.detail.exitcode == 3 and stop.detail.describe == f"rank {rank} (local 0) exited with code 3"
    assert transitions() == ["round 0: running -> failed", "round 1: running -> succeeded"]


def test_local_success_then_peer_failure_restarts_the_round(job_factory, transitions) -> None:
    job = job_factory({0: "0", 1: "0"}, max_restarts=1)

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        g = job.wait_event("rdzv_round", round=0)["group_rank"]
        job.wait_key(f"r0/succeeded/{g}")  # the agent's node reported all its ranks done
        first = peer.report_stop(0, "failed", StopDetail(rank=1))
        join_and_beat(peer)
        peer.node_succeeded(1)
        peer.wait_stop(1)
        return first

    code, first = job.run(peer_script)
    assert first.kind == "failed" and first.by_node == "peer"  # the agent's success did not end round 0
    assert code == exit_codes.OK
    assert transitions() == ["round 0: running -> succeeded", "round 1: running -> succeeded"]
    assert [e["round"] for e in job.evs("rdzv_round")] == [0, 1]


def test_both_nodes_succeeding_ends_the_job(job_factory, transitions) -> None:
    job = job_factory({0: "0"})

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        peer.node_succeeded(0)
        return peer.wait_stop(0)

    code, stop = job.run(peer_script)
    assert code == exit_codes.OK
    assert (stop.kind, stop.restart_count, stop.detail.to_fields()) == ("succeeded", 0, {"nodes": 2})
    assert transitions() == ["round 0: running -> succeeded"]


def test_signal_to_the_agent_interrupts_the_round_for_every_node(job_factory, transitions) -> None:
    job = job_factory({0: "hold"}, signals=(signal.SIGTERM,))

    def peer_script(peer: Rendezvous) -> Any:
        join_and_beat(peer)
        job.wait_event("rank_start", attempt=0)  # past the rendezvous: the agent now forwards signals
        os.kill(os.getpid(), signal.SIGTERM)
        return peer.wait_stop(0)

    code, stop = job.run(peer_script)
    assert (stop.kind, stop.by_node, stop.detail.signal) == ("interrupted", job.agent_node, "SIGTERM")
    assert code == exit_codes.interrupted(signal.SIGTERM)
    assert job.wait_event("rank_exit", attempt=0)["signal"] == "SIGTERM"
    assert transitions() == ["round 0: running -> interrupted"]
    assert job.evs("job_end")[0]["status"] == "interrupted"
