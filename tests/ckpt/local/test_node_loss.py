"""A node lost for good under `nvrx launch`: 2 emulated hosts (2 ranks each) and a standby on a third, each agent
on a host of its own (tests/hosts.py: own network namespace, address and host name) with its own --local-ckpt-dir.
After local checkpoints, node 1's agent is SIGKILLed; the standby, with an empty local directory, takes its place;
its ranks restore their shards from the replicas on node 0 (sent between the hosts' own addresses) and training
finishes. The job's local checkpoint directories of the nodes that saw the success are removed; nothing is left
running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_events, wait_for

TRAIN = Path(__file__).with_name("node_loss_train.py")
PORT = 29400  # the hosts' network is the test's own


@pytest.mark.slow
def test_a_standby_with_an_empty_local_dir_restores_every_shard_from_replicas(host_job) -> None:
    job = host_job(3, stem="nvrx-n")
    tmp_path = job.tmp_path
    work, logs = tmp_path / "work", tmp_path / "logs"
    work.mkdir()
    roots = {h.name: tmp_path / f"local-{h.name}" for h in job.hosts}
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "lossjob",
              "--rdzv-endpoint", f"{job.hosts[0].addr}:{PORT}", "--rdzv-conf", "join_timeout=90,last_call_timeout=1",
              "--log-dir", str(logs)]
    run_dir = logs / "lossjob"

    def agent(index: int, node_rank: int):
        host = job.hosts[index]
        return job.start_on(host, *common, "--node-rank", str(node_rank), "--local-ckpt-dir", str(roots[host.name]),
                            str(TRAIN), str(work))

    def seen(ev: str, n: int) -> bool:
        return run_dir.exists() and sum(e["ev"] == ev for e in run_events(run_dir, "agent-")) >= n

    n0 = agent(0, 0)  # first: it hosts the rendezvous store
    assert wait_for(lambda: seen("rdzv_join", 1), 60)
    n1 = agent(1, 1)
    assert wait_for(lambda: seen("rdzv_round", 2), 60)
    n2 = agent(2, 1)  # the round is full: a standby, with its own (empty) local directory
    assert wait_for(lambda: seen("rdzv_standby", 1), 60)
    assert wait_for(lambda: (work / "saved").exists(), 120)  # iteration 4 complete on every rank
    # the standby's agent made its session directory (with nvrx's marker) at start, but holds no shard
    assert (roots["nvrx-n1"] / "lossjob" / "rank2").is_dir() and not list(roots["nvrx-n2"].glob("lossjob/rank*"))
    n1.kill()  # the node is gone: its agent, and with it its ranks and their writer processes
    n1.wait()

    _, err0 = n0.communicate(timeout=180)
    _, err2 = n2.communicate(timeout=180)
    assert (n0.returncode, n2.returncode) == (0, 0), err0[-3000:] + err2[-3000:]
    assert job.leftovers() == []

    restored = [json.loads((work / f"restored-rank{r}.json").read_text()) for r in range(4)]
    for rank, r in enumerate(restored):
        assert (r["attempt"], r["step"], r["w"]) == (1, 4, [float(400 + rank)]), r
    assert [r["node"] for r in restored] == ["nvrx-n0", "nvrx-n0", "nvrx-n2", "nvrx-n2"]
    assert [r["source"] for r in restored] == ["own file", "own file", "replica", "replica"]
    # every agent ran on its own host (node ids are <host name>-<pid>-<random>)
    rounds = [e for e in run_events(run_dir, "agent-") if e["ev"] == "rdzv_round"]
    assert {n.rsplit("-", 2)[0] for e in rounds for n in e["nodes"]} == {"nvrx-n0", "nvrx-n1", "nvrx-n2"}
    # success: the job's local directories are removed where the job ended; the lost node's stays (it never knew)
    assert not (roots["nvrx-n0"] / "lossjob").exists() and not (roots["nvrx-n2"] / "lossjob").exists()
    assert (roots["nvrx-n1"] / "lossjob").is_dir()
