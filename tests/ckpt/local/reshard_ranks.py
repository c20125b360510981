"""One rank of an elastic job that shrank: WORLD ranks train with TwoTierCheckpointer (a DTensor and a ShardedTensor
sharded over all ranks, a replicated tensor, a step), then a smaller job resumes. Args: RANK PORT WORK WORLD SCENARIO.

save (world 4, 2 emulated nodes WORK/node0 and WORK/node1): steps 1..3, local every step, global every 2 (step 2).
load (world 2, both ranks on node 0, where the 4-rank job left the local files of ranks 0 and 1 and their replicas):
the local tier (saved at world size 4) must not be used; the global tier's step 2 is resharded onto 2 ranks.
Writes WORK/<scenario>-rank<R>.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from nvrx.ckpt.local import LazyCliqueReplicationStrategy, LocalCheckpointManager, TwoTierCheckpointer

ROWS, COLS = 8, 4


def full(step: float) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step


def state(world: int, step: float) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    st = sharded_tensor.empty(ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)]), ROWS, COLS)
    shard = st.local_shards()[0]
    rows = slice(shard.metadata.shard_offsets[0], shard.metadata.shard_offsets[0] + shard.metadata.shard_sizes[0])
    shard.tensor.copy_(full(step)[rows] * 2)
    return {"model": {"dt": distribute_tensor(full(step), mesh, [Shard(0)]), "st": st},
            "rep": torch.full((3,), float(step)), "step": torch.tensor(int(step))}


def main() -> None:
    rank, port, work, world, scenario = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(message)s")
    warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice
    per_node = 2
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                      LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo")
    node = rank // per_node
    jump = 2 if world == 4 else 1  # the small job: its two ranks replicate to each other
    local = LocalCheckpointManager(work / f"node{node}", session_id="job",
                                   repl_strategy=LazyCliqueReplicationStrategy(replication_jump=jump))
    tiers = TwoTierCheckpointer(local, work / "global", local_every=1, global_every=2)
    out: dict = {}
    if scenario == "save":
        sd = state(world, 0)
        out["kinds"] = []
        for step in (1, 2, 3):
            new = state(world, step)
            sd["model"]["dt"].to_local().copy_(new["model"]["dt"].to_local())
            sd["model"]["st"].local_shards()[0].tensor.copy_(new["model"]["st"].local_shards()[0].tensor)
            sd["rep"].fill_(step)
            sd["step"].fill_(step)
            out["kinds"].append(tiers.step(step, sd))
            local.wait()  # steps longer than a local save: none is skipped
        tiers.close()
        # the same world size restores the local tier (newest), shard for shard
        fresh = state(world, -1)
        res = tiers.resume(fresh)
        out["same_world"] = [res.iteration, res.tier]
        out["same_world_ok"] = bool(torch.equal(fresh["model"]["dt"].full_tensor(), full(3)))
    else:
        sd = state(world, -1)
        dt_before = sd["model"]["dt"]
        res = tiers.resume(sd)
        shard = sd["model"]["st"].local_shards()[0]
        off, n = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        out.update(iteration=res.iteration, tier=res.tier, reason=res.reason,
                   dt_local=sd["model"]["dt"].to_local().tolist(), dt_full_ok=bool(torch.equal(sd["model"]["dt"].full_tensor(), full(2))),
                   st_ok=bool(torch.equal(shard.tensor, full(2)[off: off + n] * 2)), st_rows=[off, n],
                   rep=sd["rep"].tolist(), step=int(sd["step"]), same_object=sd["model"]["dt"] is dt_before)
    (work / f"{scenario}-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
