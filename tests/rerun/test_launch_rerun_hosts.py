"""The re-run state machine swapping a node within one job, on emulated hosts (tests/hosts.py): every agent on a host
of its own with its own address and host name, which is how the ranks and the agents name the node (no
SLURMD_NODENAME). The NaN at step 3 reproduces only on host nvrx-n1 (train_rerun.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.rerun.test_launch_rerun import TRAIN, fault_free_weights, loss_hex, weights

PORT = 29400  # the hosts' network is the test's own


@pytest.fixture(scope="module")
def clean_weights(tmp_path_factory) -> list[str]:
    return fault_free_weights(tmp_path_factory.mktemp("clean"))  # as test_launch_rerun.py's, on one host


def start_hosts(job, run_id: str, standby: bool) -> tuple[dict, Path]:
    """`nvrx launch` agents of one job on hosts nvrx-n0 (first: it hosts the store) and nvrx-n1, and with STANDBY a
    third, nvrx-n2, once the round is full; the ranks wait before the bad step until all are there. Returns the
    agents by host name and the work directory."""
    work, gate = job.tmp_path / "work", job.tmp_path / f"gate-{run_id}"
    work.mkdir()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"{job.hosts[0].addr}:{PORT}",
              "--rdzv-id", run_id, "--rdzv-conf", "join_timeout=90,last_call_timeout=1"]

    def agent(index: int, node_rank: int):
        return job.start_on(job.hosts[index], *common, "--node-rank", str(node_rank), str(TRAIN), str(work), "node",
                            env={"RERUN_GATE": str(gate)})

    def seen(ev: str, n: int) -> bool:
        return sum(e["ev"] == ev for e in job.events(run_id)) >= n

    agents = {"nvrx-n0": agent(0, 0)}
    assert wait_for(lambda: seen("rdzv_join", 1), 60)
    agents["nvrx-n1"] = agent(1, 1)
    assert wait_for(lambda: seen("rdzv_round", 2), 60)
    if standby:
        agents["nvrx-n2"] = agent(2, 1)  # the round is full: a standby
        assert wait_for(lambda: seen("rdzv_standby", 1), 60)
    gate.touch()  # now the ranks may reach the bad step
    return agents, work


@pytest.mark.slow
def test_a_node_fault_swaps_in_the_standby_host_within_the_same_job(host_job, clean_weights):
    """Two hosts and a standby host under one `nvrx launch` job (no new job): the NaN reproduces only on
    nvrx-n1 -> only that host's agent leaves (exit 16), the standby host takes its place in a new round, the step
    re-runs there from the checkpoint -> persistent_error of nvrx-n1; training finishes."""
    job = host_job(3, stem="nvrx-n")
    agents, work = start_hosts(job, "swap", standby=True)
    _, err1 = agents["nvrx-n1"].communicate(timeout=120)
    assert agents["nvrx-n1"].returncode == 16, err1
    assert "node nvrx-n1 leaves the job (exit 16)" in err1
    for node in ("nvrx-n0", "nvrx-n2"):
        _, err = agents[node].communicate(timeout=120)
        assert agents[node].returncode == 0, err
    out = weights(work)
    assert out["verdicts"] == ["transient_error", "persistent_error"]
    assert out["weights"] == clean_weights  # bitwise, across the swap
    assert loss_hex(work, "nvrx-n2", 0) == loss_hex(work, "nvrx-n1", 0)  # the step re-ran exactly on the standby
    stops = [e for e in job.events("swap") if e["ev"] == "rdzv_stop" and e["kind"] == "failed"]
    assert stops and all(s["detail"]["leaves"] == ["nvrx-n1"] and not s["give_up"] for s in stops)
    assert {s["restart_count"] for s in stops} == {0}  # a swap does not spend the restart budget
    text = job.run_inspect("swap").stdout
    assert "nvrx-n1 leave the job (exit 16); the others go on in place" in text, text
    assert "re-run verdict for step 3: persistent error of the suspected node" in text
    assert "rank 1 on node nvrx-n1: loss is NaN or Inf (call 1) = nan, re-run on nvrx-n2" in text
    job.assert_clean()


def test_without_a_standby_host_the_job_ends_with_16_for_a_new_job(host_job):
    """The same fault without a standby (--nnodes 2): the other host waits for the suspected host's decision,
    which cannot leave (the re-run needs 2 nodes): every agent ends with 16, for `nvrx resume` (as before)."""
    job = host_job(2, stem="nvrx-n")
    agents, _ = start_hosts(job, "nostandby", standby=False)
    errs = {node: a.communicate(timeout=120)[1] for node, a in agents.items()}
    assert {node: a.returncode for node, a in agents.items()} == {"nvrx-n0": 16, "nvrx-n1": 16}, errs
    assert "node nvrx-n1 cannot leave the job for a standby (1 node(s) and 0 standby would be left, the re-run " \
           "needs 2)" in errs["nvrx-n1"]
    stops = [e for e in job.events("nostandby") if e["ev"] == "rdzv_stop"]
    assert stops and all(s["give_up"] and s["detail"]["steer"] == 16 and not s["detail"].get("leaves")
                         for s in stops)
    assert {s["detail"]["rank"] for s in stops} == {1}  # written by the suspected node's agent, not the other
    job.assert_clean()
