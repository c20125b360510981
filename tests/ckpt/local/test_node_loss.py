"""A node lost for good under `nvrx launch`: 2 emulated nodes (2 ranks each) and a standby agent, each agent with its
own --local-ckpt-dir. After local checkpoints, node 1's agent is SIGKILLed; the standby, with an empty local
directory, takes its place; its ranks restore their shards from the replicas on node 0 and training finishes.
The job's local checkpoint directories of the nodes that saw the success are removed; nothing is left running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import free_port, run_events, wait_for

TRAIN = Path(__file__).with_name("node_loss_train.py")


@pytest.mark.slow
def test_a_standby_with_an_empty_local_dir_restores_every_shard_from_replicas(launcher, tmp_path: Path) -> None:
    work, logs = tmp_path / "work", tmp_path / "logs"
    work.mkdir()
    roots = {n: tmp_path / f"local-{n}" for n in ("n0", "n1", "n2")}
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "lossjob",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "join_timeout=90,last_call_timeout=1",
              "--log-dir", str(logs)]
    run_dir = logs / "lossjob"

    def agent(node: str, node_rank: int):
        return launcher.start(*common, "--node-rank", str(node_rank), "--local-ckpt-dir", str(roots[node]), str(TRAIN),
                              str(work), env={"SLURMD_NODENAME": f"nvrx-{node}"})

    def seen(ev: str, n: int) -> bool:
        return run_dir.exists() and sum(e["ev"] == ev for e in run_events(run_dir, "agent-")) >= n

    n0 = agent("n0", 0)  # first: it hosts the rendezvous store
    assert wait_for(lambda: seen("rdzv_join", 1), 60)
    n1 = agent("n1", 1)
    assert wait_for(lambda: seen("rdzv_round", 2), 60)
    n2 = agent("n2", 1)  # the round is full: a standby, with its own (empty) local directory
    assert wait_for(lambda: seen("rdzv_standby", 1), 60)
    assert wait_for(lambda: (work / "saved").exists(), 120)  # iteration 4 complete on every rank
    # the standby's agent made its session directory (with nvrx's marker) at start, but holds no shard
    assert (roots["n1"] / "lossjob" / "rank2").is_dir() and not list(roots["n2"].glob("lossjob/rank*"))
    n1.kill()  # the node is gone: its agent, and with it its ranks and their writer processes
    n1.wait()

    out0, err0 = n0.communicate(timeout=180)
    out2, err2 = n2.communicate(timeout=180)
    assert (n0.returncode, n2.returncode) == (0, 0), err0[-3000:] + err2[-3000:]
    assert launcher.leftovers() == []

    restored = [json.loads((work / f"restored-rank{r}.json").read_text()) for r in range(4)]
    for rank, r in enumerate(restored):
        assert (r["attempt"], r["step"], r["w"]) == (1, 4, [float(400 + rank)]), r
    assert [r["node"] for r in restored] == ["nvrx-n0", "nvrx-n0", "nvrx-n2", "nvrx-n2"]
    assert [r["source"] for r in restored] == ["own file", "own file", "replica", "replica"]
    # success: the job's local directories are removed where the job ended; the lost node's stays (it never knew)
    assert not (roots["n0"] / "lossjob").exists() and not (roots["n2"] / "lossjob").exists()
    assert (roots["n1"] / "lossjob").is_dir()
