"""One rank of the staging-failure scenario (real gloo group, real writer processes).

usage: python staging_fault_ranks.py RANK PORT WORKDIR

1. save ROOT/step_1 on both ranks (the checkpoint that must survive);
2. A: the staging buffer cannot be allocated on rank 1 only (MemoryError injected into the pool);
3. B: with overlap_write, rank 1's copy fails midway while rank 0's writer already writes its files;
4. after each: both ranks must raise, nothing pending, step_1 still `latest` and loadable (collective load);
5. save ROOT/step_2 - the name of the abandoned saves - which must work and hold the new values.
Writes WORKDIR/rank<R>.json with what it observed. The gloo timeout is short: a rank left waiting
in a collective fails the run in seconds instead of hanging it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nvrx import ckpt
from nvrx.ckpt.async_ckpt import staging
from nvrx.ckpt.async_ckpt.writer_process import default_writer


KEYS = ("a", "b", "c", "d")  # replicated: DCP spreads them over the ranks, two tensors staged by each


def state(value: float) -> dict:
    return {**{k: torch.full((1 << 21,), value) for k in KEYS}, "meta": {"step": int(value)}}


def listing(root: Path) -> dict:
    names = sorted(os.listdir(root))
    return {"visible": [n for n in names if not n.startswith(".")], "hidden": [n for n in names if n.startswith(".")],
            "latest": (root / "latest").read_text().strip()}


def load_value(root: Path, name: str) -> float:
    target = {**{k: torch.zeros(1 << 21) for k in KEYS}, "meta": {"step": -1}}
    dcp.load(target, checkpoint_id=str(root / name))
    value = float(target["a"][0])
    assert all(torch.all(target[k] == value) for k in KEYS) and target["meta"]["step"] == int(value)
    return value


def failing_save(cp: ckpt.AsyncCheckpointer, root: Path, value: float, fault: tuple[type, str, Any] | None) -> dict:
    """Save ROOT/step_2 with FAULT (class, method name, replacement) injected here, then report what this rank saw."""
    injected = mock.patch.object(*fault) if fault else contextlib.nullcontext()
    try:
        with injected:
            cp.async_save(state(value), root / "step_2")
        error = None
    except ckpt.CheckpointWriteError as exc:
        error = str(exc)
    dist.barrier()  # every rank is out of the failed save before the directory is looked at
    seen = {"error": error, "pending": cp.pending, "listing": listing(root), "step_1": load_value(root, "step_1")}
    ckpt.verify_checkpoint(root / "step_1")
    return seen


def main() -> None:
    rank, port, work = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    root = work / "root"
    out: dict = {"rank": rank, "writer_pid": default_writer().pid}
    cp = ckpt.AsyncCheckpointer()
    cp.async_save(state(1.0), root / "step_1")
    cp.wait()

    # A: no staging memory on rank 1 (as when the node is out of memory)
    def no_memory(self: staging.StagingPool, nbytes: int, populate: bool = True) -> staging.StagingBuffer:
        raise MemoryError(f"cannot allocate {nbytes} bytes of staging memory (injected)")

    out["A"] = failing_save(cp, root, 2.0, (staging.StagingPool, "acquire", no_memory) if rank == 1 else None)

    # B: the copy fails midway on rank 1 while rank 0's writer is already writing (overlap_write)
    overlapping = ckpt.AsyncCheckpointer(overlap_write=True)
    real_copy = staging.StagingBuffer.copy_tensor
    copies = []

    def copy_then_fail(self: staging.StagingBuffer, offset: int, tensor: torch.Tensor) -> None:
        copies.append(offset)
        if len(copies) == 2:  # the second of this rank's two tensors: the writer already has the first
            raise RuntimeError("device lost while copying (injected)")
        real_copy(self, offset, tensor)

    out["B"] = failing_save(overlapping, root, 3.0,
                            (staging.StagingBuffer, "copy_tensor", copy_then_fail) if rank == 1 else None)

    # the next save - to the very name of the abandoned ones - works on both ranks
    overlapping.async_save(state(4.0), root / "step_2")
    overlapping.wait()
    dist.barrier()
    out["after"] = listing(root)
    out["step_2"] = load_value(root, "step_2")
    out["writer_pid_after"] = default_writer().pid
    cp.finalize_before_exit()
    overlapping.finalize_before_exit()
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
