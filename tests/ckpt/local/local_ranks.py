"""One rank of a 4-rank job on 2 emulated nodes (ranks 0,1 on node0; 2,3 on node1), each node with its own local
root WORK/node<N>. Args: RANK PORT WORK SCENARIO. Writes WORK/<scenario>-rank<R>.json.

Scenarios: journey (one job, phases separated by barriers, rank 0 doing the damage between them: save 1 and 2 ->
node 1's directory deleted, a fresh manager restores -> save 3, rank 1's own file corrupted, restore -> save 4,
node 1 lost again and, after find_latest, the replica rank 0 must send breaks -> save 5, both copies of rank 1's
shard deleted, restore), restore (find_latest + load), kill (save 1, start an async save
of 2 and SIGKILL this rank at once), disk_full (node1's root is a tiny tmpfs: a save fails on every rank, clearly),
queue (NVRx's pattern: save(is_async=True) -> AsyncCallsQueue.schedule_async_request -> maybe_finalize_async_calls;
the files are written by the persistent writer process), queue_disk_full (the same with node1's root full),
cut_off (a cut-off node's late files are never restored: nvrx/ckpt/fence.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx.ckpt.local import (BasicTensorAwareStateDict, LazyCliqueReplicationStrategy, LocalCheckpointManager,
                        NoReplicasAvailableError)
from nvrx.ckpt.local.errors import LocalCheckpointError

WORLD, PER_NODE = 4, 2


def state(rank: int, iteration: int, big: int = 0) -> dict:
    """Rank- and iteration-specific values, so a shard restored from the wrong rank or iteration shows."""
    return {"model": {"w": torch.full((3, 4), float(100 * iteration + rank)), "b": torch.arange(5) + rank},
            "optimizer": {"state": {0: {"step": torch.tensor(iteration)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
            "iteration": iteration, "big": torch.ones(big, dtype=torch.uint8)}


def restore(mgr: LocalCheckpointManager) -> dict:
    """find_latest + load; what was restored (values, id, source) or the NoReplicasAvailableError message."""
    out: dict = {"found": mgr.find_latest()}
    try:
        sd, id_ = mgr.load()
        d = sd.state_dict
        out.update(id=id_, source=mgr.last_load_source, w=d["model"]["w"].tolist(), b=d["model"]["b"].tolist(),
                   step=int(d["optimizer"]["state"][0]["step"]), betas=list(d["optimizer"]["param_groups"][0]["betas"]),
                   iteration=d["iteration"])
    except NoReplicasAvailableError as exc:
        out["no_replicas"] = str(exc)
    return out


def manager(work: Path, rank: int) -> LocalCheckpointManager:
    return LocalCheckpointManager(work / f"node{rank // PER_NODE}", session_id="job",
                                  repl_strategy=LazyCliqueReplicationStrategy())


def damage(work: Path, fn) -> None:
    """Rank 0 damages the files while every rank waits (barriers on both sides)."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def shard_file(work: Path, holder: int, owner: int, iteration: int) -> Path:
    return work / f"node{holder // PER_NODE}" / "job" / f"rank{holder}" / f"iter_{iteration:09d}_{owner}_local.nvrxl"


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # in the payload: only the checksum can tell
    path.write_bytes(bytes(data))


def journey(work: Path, rank: int) -> dict:
    mgr = manager(work, rank)
    out: dict = {"clique": mgr._strategy().group_ranks}
    got, ids = mgr.repl_strategy.replicate(BasicTensorAwareStateDict(state(rank, 9)), f"probe_{rank}")
    out["replicate_api"] = [ids, [float(g.state_dict["model"]["w"][0, 0]) for g in got]]
    mgr.save(state(rank, 1), iteration=1)
    mgr.save(state(rank, 2), iteration=2, is_async=True)
    mgr.wait()
    out["files"] = sorted(p.name for p in mgr.local_dir.iterdir())
    out["modes"] = [oct(p.stat().st_mode & 0o777) for p in (mgr.local_dir, mgr.session_dir)]
    damage(work, lambda: shutil.rmtree(work / "node1"))
    mgr = manager(work, rank)  # node 1 came back empty (or a standby took its place)
    out["lost_node"] = restore(mgr)
    mgr.save(state(rank, 3), iteration=3)
    damage(work, lambda: flip_last_byte(shard_file(work, 1, 1, 3)))
    out["corrupt"] = restore(mgr)
    out["corrupt_moved_aside"] = [p.name for p in mgr.local_dir.iterdir() if p.name.startswith(".corrupt-")]
    mgr.save(state(rank, 4), iteration=4)
    damage(work, lambda: shutil.rmtree(work / "node1"))
    mgr = manager(work, rank)
    out["late_found"] = mgr.find_latest()  # then rank 0's replica of rank 2's shard breaks before it is sent
    damage(work, lambda: shard_file(work, 0, 2, 4).write_bytes(b"torn"))
    try:
        mgr.load()
        out["late_error"] = None
    except LocalCheckpointError as exc:
        out["late_error"] = str(exc)
    out["late_moved_aside"] = sorted(p.name for p in mgr.local_dir.iterdir() if p.name.startswith(".corrupt-"))
    mgr.save(state(rank, 5), iteration=5)
    damage(work, lambda: (shard_file(work, 1, 1, 5).unlink(), shard_file(work, 3, 1, 5).unlink()))
    out["both_gone"] = restore(mgr)
    return out


def through_queue(work: Path, rank: int, big: int = 0) -> dict:
    """Two asynchronous saves finalized by an AsyncCallsQueue; the state changes right after each save returns."""
    from nvrx.ckpt.async_ckpt.core import AsyncCallsQueue, WriterJob
    from nvrx.ckpt.async_ckpt.writer_process import default_writer

    mgr, queue, out = manager(work, rank), AsyncCallsQueue(), {}
    sd = state(rank, 1, big)
    writer = default_writer()
    try:
        for it in (1, 2):
            sd["model"]["w"].fill_(float(100 * it + rank))
            sd["optimizer"]["state"][0]["step"].fill_(it)
            sd["iteration"] = it
            request = mgr.save(sd, iteration=it, is_async=True)
            sd["model"]["w"].fill_(-1.0)  # after the snapshot: must not reach the checkpoint
            job = request.async_fn
            out[f"job{it}"] = {"writer_job": isinstance(job, WriterJob) and job.job.get("op") == "local",
                               "same_writer": job.submitted_to is writer and writer.pid is not None and writer.running(),
                               "writer_pid_is_child": writer.pid != os.getpid()}
            queue.schedule_async_request(request)
            if it == 1:
                try:
                    mgr.save(sd, iteration=9, is_async=True)
                except LocalCheckpointError as exc:
                    out["unfinalized_error"] = str(exc)
            queue.maybe_finalize_async_calls(blocking=True)
            out[f"files{it}"] = sorted(p.name for p in mgr.local_dir.iterdir())
    except Exception as exc:  # the queue raises the write failure on every rank
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["files_after_error"] = sorted(p.name for p in mgr.local_dir.iterdir())
    out["threads"] = sorted(t.name for t in __import__("threading").enumerate())
    mgr.close()
    queue.close()
    return out


def writer_killed(work: Path, rank: int) -> dict:
    """Rank 0's checkpoint writer process is SIGKILLed during an asynchronous local save: the save fails on every
    rank, the previous iteration stays, and the next save runs on a new writer."""
    from nvrx.ckpt.async_ckpt.writer_process import default_writer

    mgr, out = manager(work, rank), {}
    mgr.save(state(rank, 1), iteration=1)
    mgr.save(state(rank, 2, big=128 << 20), iteration=2, is_async=True)
    first = default_writer().pid
    if rank == 0:
        os.kill(first, signal.SIGKILL)
    try:
        mgr.wait()
        out["error"] = None
    except LocalCheckpointError as exc:
        out["error"] = str(exc)
    out["found_after"] = mgr.find_latest()
    mgr.save(state(rank, 3), iteration=3, is_async=True)
    mgr.wait()
    out["new_writer"] = default_writer().pid != first if rank == 0 else True
    out.update(restore(mgr))
    mgr.close()
    return out


def in_round(launch: int, rnd: int) -> None:
    """This rank is in round RND of launch LAUNCH, as `nvrx launch` tells it (NVRX_LAUNCH, NVRX_ROUND)."""
    os.environ.update(NVRX_LAUNCH=str(launch), NVRX_ROUND=str(rnd))


def cut_off_writes(work: Path, rank: int, iteration: int) -> None:
    """What a cut-off node's ranks of round 0 write after the job went on without them: node 1's ranks (2, 3)
    write ITERATION, their own shards and the replicas their clique partners (0, 1) sent them before the cut,
    stamped with their round as the manager stamps them. (Their own saves cannot finish: the agreement needs the
    partners, which the job stopped.)"""
    from nvrx.ckpt import fence
    from nvrx.ckpt.local.codec import pack, seal, write_file
    from nvrx.ckpt.local.naming import SUFFIX, ckpt_id

    if rank // PER_NODE != 1:
        return
    for owner in (rank, rank - PER_NODE):
        packed = pack(state(owner, iteration), ckpt_id(iteration, owner), checksum=False)
        packed.header.update(world_size=WORLD, **fence.stamp())
        write_file(work / "node1" / "job" / f"rank{rank}" / f"{packed.id}{SUFFIX}", seal(packed))


def cut_off(work: Path, rank: int) -> dict:
    """No split brain in the local tier. Launch 7, round 0 on node 0 (ranks 0, 1) and node 1 (ranks 2, 3) saves
    iteration 1; node 1 is cut off, and round 1 runs on node 0 and a standby (node 2) and resumes from iteration 1;
    node 1's ranks of round 0 then write iteration 2 on their own disk (every shard has a copy there); round 2 runs
    on nodes 0 and 1 again. Without the fence it would restore node 1's iteration 2."""
    out: dict = {}
    in_round(7, 0)
    mgr = manager(work, rank)
    mgr.save(state(rank, 1), iteration=1)
    in_round(7, 1)
    standby = LocalCheckpointManager(work / ("node0" if rank < PER_NODE else "node2"), session_id="job",
                                     repl_strategy=LazyCliqueReplicationStrategy())
    out["round1"] = restore(standby)
    dist.barrier()
    in_round(7, 0)
    cut_off_writes(work, rank, 2)
    try:  # a save by round 0 where round 1 resumed (node 0's directories): refused on every rank
        mgr.save(state(rank, 3), iteration=3)
        out["stale_save"] = None
    except LocalCheckpointError as exc:
        out["stale_save"] = str(exc)
    dist.barrier()  # every rank has removed its refused files (each lists a peer's directory below)
    out["node0_files"] = sorted(p.name for p in (work / "node0" / "job" / f"rank{rank % PER_NODE}").iterdir())
    dist.barrier()
    in_round(7, 2)
    mgr = manager(work, rank)
    out["round2_files"] = sorted(p.name for p in mgr.local_dir.iterdir())
    out["round2"] = restore(mgr)
    out["round2_notes"] = mgr.find_notes
    mgr.save(state(rank, 4), iteration=4)  # the job's own round goes on
    out["round2_after_save"] = manager(work, rank).find_latest()
    in_round(9, 0)  # a later launch (nvrx resume)
    out["next_launch"] = restore(manager(work, rank))
    return out


def main() -> None:
    rank, port, work, scenario = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(message)s")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE),
                      LOCAL_WORLD_SIZE=str(PER_NODE), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo")
    if scenario == "cut_off":
        (work / f"cut_off-rank{rank}.json").write_text(json.dumps(cut_off(work, rank)))
        dist.destroy_process_group()
        return
    if scenario == "journey":
        (work / f"journey-rank{rank}.json").write_text(json.dumps(journey(work, rank)))
        dist.destroy_process_group()
        return
    mgr = manager(work, rank)
    out: dict = {"clique": mgr._strategy().group_ranks}
    if scenario in ("kill", "disk_full"):
        mgr.save(state(rank, 1), iteration=1)
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
        out.update(restore(mgr))
    if scenario == "writer_killed":
        out.update(writer_killed(work, rank))
    if scenario == "queue":
        out.update(through_queue(work, rank))
        out["restored"] = restore(manager(work, rank))
    if scenario == "queue_disk_full":
        out.update(through_queue(work, rank, big=8 << 20))
    (work / f"{scenario}-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
