"""One rank of the 2-rank checkpoint scenario (real gloo process group, real writer processes).

usage: python two_ranks.py RANK PORT WORKDIR

1. load WORKDIR/from_one (saved by 1 process) into a DTensor sharded over both ranks (1 -> 2 resharding);
2. save WORKDIR/root/step_1 with a sharded DTensor, a replicated tensor and nested non-tensor values,
   then change every tensor in place at once (the checkpoint must hold the values of the call);
3. save step_2 with the same structure (plan cache hit), step_3 with another structure (cache miss);
4. a state dict whose shapes differ between ranks must fail on both ranks with one clear error;
5. a fresh checkpointer resumes from step_3 and reuses the plans recorded in it for step_4;
6. maybe_finalize with nothing pending (rank 0 only: it must not wait for rank 1).
Writes WORKDIR/rank<R>.json with what it observed.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from nvrx import ckpt
from nvrx.ckpt.async_ckpt.state_dict_saver import get_metadata_caching_status  # noqa: F401  (spec name importable)


def main() -> None:
    rank, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    out: dict = {"rank": rank}

    # 1 -> 2: a checkpoint written by one process, loaded into shards
    target = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}
    dcp.load(target, checkpoint_id=f"{work}/from_one")
    out["loaded_shard"] = target["w"].to_local().tolist()

    # 2 -> checkpoint: sharded + replicated + nested non-tensor values
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4) * (1 + rank * 0)  # same global tensor on both ranks
    state = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]),
             "b": torch.full((3,), 5.0),
             "meta": {"step": 7, "name": "run-a", "lrs": [0.1, 0.2]}}
    cp = ckpt.AsyncCheckpointer(keep_last=None)
    cp.async_save(state, f"{work}/root/step_1")
    with torch.no_grad():
        state["w"].to_local().add_(1000)  # the training step right after the call
        state["b"].add_(1000)
    state["meta"]["step"] = 8
    cp.wait()

    cp.async_save(state, f"{work}/root/step_2")  # same structure: the cached plans are reused
    cp.wait()
    out["after_identical"] = cp.cache.get_metadata_caching_status()

    state["extra"] = torch.full((2, 2), 3.0)  # new key (replicated, same on both ranks): the cache must be invalidated
    cp.async_save(state, f"{work}/root/step_3")
    cp.wait()
    out["after_changed"] = cp.cache.get_metadata_caching_status()

    # ranks disagree on a shape
    bad = {"x": torch.zeros(4 + rank)}
    try:
        cp.async_save(bad, f"{work}/root/bad")
        out["mismatch_error"] = None
    except ckpt.CheckpointError as exc:
        out["mismatch_error"] = str(exc)
    out["pending_after_mismatch"] = cp.pending

    # resume with a fresh checkpointer: the plans recorded in step_3 are reused for step_4
    cp2 = ckpt.AsyncCheckpointer()
    resumed = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "b": torch.zeros(3),
               "meta": {"step": 0, "name": "", "lrs": [0.0, 0.0]}, "extra": torch.zeros(2, 2)}
    info = cp2.resume(f"{work}/root", resumed)
    out["resumed_from"] = info.path.name if info else None
    out["resumed_meta_step"] = resumed["meta"]["step"]
    cp2.async_save(resumed, f"{work}/root/step_4")
    cp2.wait()
    out["after_resume"] = cp2.cache.get_metadata_caching_status()

    dist.barrier()
    if rank == 0:
        out["finalize_nothing"] = cp.maybe_finalize()  # nothing pending: no collective, no wait for rank 1
    dist.barrier()
    cp.finalize_before_exit()
    cp2.finalize_before_exit()
    with open(f"{work}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
