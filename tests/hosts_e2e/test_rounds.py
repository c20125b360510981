"""Multi-node rounds on emulated hosts (tests/hosts.py): every agent on a host of its own, with its own address
and host name, as on a cluster (the 127.0.0.1 versions of these live in tests/faults and tests/integration)."""

from __future__ import annotations

import pytest

from tests.conftest import wait_for
from tests.faults.conftest import kill

pytestmark = pytest.mark.slow

PORT = 29400
CONF = "last_call_timeout=1,keepalive_interval=0.5,keepalive_timeout=2"


def _args(job, run_id: str, nnodes: str, steps: int, fault: str = "none") -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", f"{job.hosts[0].addr}:{PORT}",
            "--rdzv-id", run_id, "--max-restarts", "2", "--rdzv-conf", CONF, "--term-timeout", "2",
            *job.train(steps, fault)]


def test_rank_crash_restarts_across_hosts(host_job):
    """A rank on the second host crashes once: every host restarts its ranks in place and the job finishes."""
    job = host_job(2)
    procs = [job.start_on(h, *_args(job, "crash", "2", 30, "crash"), env={"FAULT_STEP_TIME": "0.05"})
             for h in job.hosts]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    rounds = [e for e in job.events("crash") if e["ev"] == "rdzv_round"]
    assert max(e["restart_count"] for e in rounds) == 1
    assert {e["world_size"] for e in rounds} == {2}
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_standby_host_takes_a_lost_hosts_place(host_job):
    """Three hosts, --nnodes 2:2: the third waits as a standby; a member host's agent is SIGKILLed and the
    standby takes its place; the job finishes with two nodes, exit 0."""
    job = host_job(3)
    env = {"FAULT_STEP_TIME": "0.05"}
    procs = {h.name: job.start_on(h, *_args(job, "standby", "2:2", 120), env=env) for h in job.hosts}
    assert wait_for(lambda: any(e["ev"] == "rdzv_standby" for e in job.events("standby")), 90)
    standby = next(e["node_id"] for e in job.events("standby") if e["ev"] == "rdzv_standby")
    member = next(h for h in job.hosts[1:] if not standby.startswith(h.name + "-"))
    job.wait_running(rank=1)
    kill(procs[member.name])
    procs[member.name].wait()
    for name, proc in procs.items():
        if name != member.name:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err
    last = max((e for e in job.events("standby") if e["ev"] == "rdzv_round"), key=lambda e: e["round"])
    assert last["world_size"] == 2 and any(n.startswith(standby.split("-")[0] + "-") for n in last["nodes"])
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()
