"""One rank of the Megatron-Core / NeMo asynchronous save sequence, written against NVRx's API (imports mapped).

usage: python megatron_ranks.py RANK PORT WORKDIR

1. a real model (Linear layers) and Adam optimizer after two steps, plus a weight sharded over both ranks (DTensor);
2. Megatron-Core's sequence: FileSystemWriterAsync(dir, thread_count=2) -> save_state_dict_async_plan(...)
   -> writer.get_save_function_and_args() -> AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
   -> add_finalize_fn(tracker on rank 0) -> queue.schedule_async_request(request) -> barrier; training changes the
   parameters at once; maybe_finalize_async_calls(blocking=False, no_dist=False) each "step", then blocking=True;
3. every rank loads the checkpoint back with torch.distributed.checkpoint.load and compares it to the saved values;
4. a second save whose write fails on rank 1 only: maybe_finalize_async_calls must raise torch's CheckpointException
   on both ranks, the finalize functions (tracker) must not run, nothing is published.
Writes WORKDIR/rank<R>.json with what it observed and WORKDIR/expected<R>.pt with the values it saved.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

# nvidia_resiliency_ext.checkpointing.async_ckpt.{core,filesystem_async,state_dict_saver} -> nvrx.ckpt.async_ckpt.*
from nvrx.ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from nvrx.ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvrx.ckpt.async_ckpt.state_dict_saver import (CheckpointMetadataCache, save_state_dict_async_finalize,
                                               save_state_dict_async_plan)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 6)).pow(2).mean().backward()
    opt.step()


def snapshot(state: dict) -> dict:
    """A deep copy of STATE's values (the DTensor as this rank's local shard)."""
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    if hasattr(state, "to_local"):
        return state.to_local().clone()
    return state.clone() if isinstance(state, torch.Tensor) else state


def equal(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def async_save(queue: AsyncCallsQueue, state: dict, path: str, rank: int, tracker: str, iteration: int,
               cache: CheckpointMetadataCache, before_schedule=None) -> int:
    """What megatron.core.dist_checkpointing (TorchDistSaveShardedStrategy.async_save) and save_checkpoint do."""
    writer = FileSystemWriterAsync(path, thread_count=2)
    save_state_dict_ret = save_state_dict_async_plan(state, writer, None, 0, planner=DefaultSavePlanner(),
                                                     enable_cache=True, metadata_cache=cache)
    save_state_dict_ret = cache.prepare_save_state_dict_ret(rank, 0, save_state_dict_ret)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn() -> None:
        save_state_dict_async_finalize(*save_state_dict_ret)

    request = AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)

    def iter_finalize_fn() -> None:  # Megatron's tracker file, rank 0 only
        if rank == 0:
            with open(tracker, "w") as f:
                f.write(str(iteration))

    request.add_finalize_fn(iter_finalize_fn)
    if before_schedule is not None:
        before_schedule()
    idx = queue.schedule_async_request(request)
    dist.barrier()
    return idx


def main() -> None:
    rank, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    out: dict = {"rank": rank}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for seed in (1, 2):
        train_step(model, opt, seed)
    sharded = distribute_tensor(torch.arange(24, dtype=torch.float32).reshape(8, 3), mesh, [Shard(0)])
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "embedding": sharded, "iteration": 2}
    expected = snapshot(state)
    torch.save(expected, f"{work}/expected{rank}.pt")

    queue = AsyncCallsQueue(persistent=True)
    cache = CheckpointMetadataCache()
    tracker = f"{work}/latest_checkpointed_iteration.txt"
    out["call_idx"] = async_save(queue, state, f"{work}/ckpt/iter_2", rank, tracker, 2, cache)
    out["unfinalized_after_schedule"] = queue.get_num_unfinalized_calls()
    train_step(model, opt, 3)  # the next step changes every parameter in place: the checkpoint must not see it
    with torch.no_grad():
        sharded.to_local().add_(100.0)
    finalized: list[int] = []
    for _ in range(3):  # the training loop's non-blocking calls (collective; may or may not finalize yet)
        finalized += queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
    finalized += queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    out["finalized"] = finalized
    out["unfinalized_after_blocking"] = queue.get_num_unfinalized_calls()

    # every rank loads the checkpoint back into fresh objects
    torch.manual_seed(42)
    model2 = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    train_step(model2, opt2, 9)  # creates the optimizer state the checkpoint fills
    loaded = {"model": model2.state_dict(), "optimizer": opt2.state_dict(),
              "embedding": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)]), "iteration": 0}
    dcp.load(loaded, checkpoint_id=f"{work}/ckpt/iter_2")
    out["loaded_equals_saved"] = equal(snapshot(loaded), expected)
    out["live_differs_from_saved"] = not equal(snapshot(state), expected)

    # a write that fails on rank 1 only: a directory where rank 1's first data file must go
    def break_rank1_write() -> None:
        if rank == 1:
            os.makedirs(f"{work}/ckpt/.iter_3.partial/__1_0.distcp")

    state["iteration"] = 3
    async_save(queue, state, f"{work}/ckpt/iter_3", rank, tracker, 3, cache, before_schedule=break_rank1_write)
    try:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        out["failure"] = None
    except CheckpointException as exc:
        out["failure"] = {"type": type(exc).__name__, "message": str(exc), "ranks": sorted(exc.failures),
                          "is_runtime_error": isinstance(exc, RuntimeError)}
    out["unfinalized_after_failure"] = queue.get_num_unfinalized_calls()
    dist.barrier()
    queue.close()
    with open(f"{work}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
