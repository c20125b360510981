"""One of 2 ranks, each on its own emulated node (local roots WORK/node0, WORK/node1; J = 1, F = 2: one clique
{0, 1}), sharing a global DCP root WORK/global. Args: RANK PORT WORK SCENARIO [REJECT].

train: steps 1..7, local every step, global every 3 (3, 6). resume: a fresh state, TwoTierCheckpointer.resume;
with REJECT=1 the validation hook rejects rank 1's restored local state. Writes WORK/<scenario>-rank<R>.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx.ckpt.local import LazyCliqueReplicationStrategy, LocalCheckpointManager, TwoTierCheckpointer


def state(rank: int, value: float, step: int) -> dict:
    """The model is replicated (the same on both ranks, as DCP expects of a plain tensor); "own_<rank>" is per rank."""
    return {"model": {"w": torch.full((4, 4), value)}, f"own_{rank}": torch.full((2,), value), "step": torch.tensor(step)}


def main() -> None:
    rank, port, work, scenario = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    reject = len(sys.argv) > 5 and sys.argv[5] == "1"
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(message)s")
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo")
    local = LocalCheckpointManager(work / f"node{rank}", session_id="job", repl_strategy=LazyCliqueReplicationStrategy())
    hook = (lambda sd: dist.get_rank() != 1) if reject else None
    tiers = TwoTierCheckpointer(local, work / "global", local_every=1, global_every=3, validate=hook)
    out: dict = {}
    if scenario == "train":
        sd = state(rank, 0.0, 0)
        out["kinds"] = []
        for step in range(1, 8):
            sd["model"]["w"].fill_(10.0 * step)
            sd[f"own_{rank}"].fill_(10.0 * step + rank)
            sd["step"].fill_(step)
            out["kinds"].append(tiers.step(step, sd))
            local.wait()  # steps longer than a local save: none is skipped (which tier restores is then known)
        tiers.close()
    else:
        sd = state(rank, -1.0, -1)
        w_before = sd["model"]["w"]
        res = tiers.resume(sd)
        out.update(iteration=res.iteration, tier=res.tier, reason=res.reason, w=float(sd["model"]["w"][0, 0]),
                   own=float(sd[f"own_{rank}"][0]),
                   step=int(sd["step"]), same_tensor=sd["model"]["w"] is w_before)
    (work / f"{scenario}-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
