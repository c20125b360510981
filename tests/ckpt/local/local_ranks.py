"""One rank of a 4-rank job on 2 emulated nodes (ranks 0,1 on node0; 2,3 on node1), each node with its own local
root WORK/node<N>. Args: RANK PORT WORK SCENARIO. Writes WORK/<scenario>-rank<R>.json.

Scenarios: save (iterations 1 then 2), restore (find_latest + load), kill (save 1, start an async save of 2 and
SIGKILL this rank at once), disk_full (node1's root is a tiny tmpfs: a local save fails on every rank, clearly).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ckpt.local import LazyCliqueReplicationStrategy, LocalCheckpointManager, NoReplicasAvailableError
from ckpt.local.errors import LocalCheckpointError

WORLD, PER_NODE = 4, 2


def state(rank: int, iteration: int, big: int = 0) -> dict:
    """Rank- and iteration-specific values, so a shard restored from the wrong rank or iteration shows."""
    return {"model": {"w": torch.full((3, 4), float(100 * iteration + rank)), "b": torch.arange(5) + rank},
            "optimizer": {"state": {0: {"step": torch.tensor(iteration)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
            "iteration": iteration, "big": torch.ones(big, dtype=torch.uint8)}


def main() -> None:
    rank, port, work, scenario = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(message)s")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE),
                      LOCAL_WORLD_SIZE=str(PER_NODE), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo")
    mgr = LocalCheckpointManager(work / f"node{rank // PER_NODE}", session_id="job",
                                 repl_strategy=LazyCliqueReplicationStrategy())
    out: dict = {"clique": mgr._strategy().group_ranks}
    if scenario in ("save", "kill", "disk_full"):
        mgr.save(state(rank, 1), iteration=1)
    if scenario == "save":
        mgr.save(state(rank, 2), iteration=2, is_async=True)
        mgr.wait()
    if scenario == "kill":
        mgr.save(state(rank, 2, big=64 << 20), iteration=2, is_async=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "disk_full":
        try:
            mgr.save(state(rank, 2, big=8 << 20), iteration=2)
        except LocalCheckpointError as exc:
            out["error"] = str(exc)
        out["found_after_failure"] = mgr.find_latest()
    if scenario == "restore":
        out["found"] = mgr.find_latest()
        try:
            sd, id_ = mgr.load()
            d = sd.state_dict
            out.update(id=id_, source=mgr.last_load_source, w=d["model"]["w"].tolist(), b=d["model"]["b"].tolist(),
                       step=int(d["optimizer"]["state"][0]["step"]), betas=list(d["optimizer"]["param_groups"][0]["betas"]),
                       iteration=d["iteration"])
        except NoReplicasAvailableError as exc:
            out["no_replicas"] = str(exc)
    (work / f"{scenario}-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
