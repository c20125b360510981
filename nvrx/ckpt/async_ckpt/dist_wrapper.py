"""Collectives for checkpoint planning and finalize, with JSON payloads instead of pickled objects.

torch's own object collectives pickle; these send JSON bytes in uint8 tensors over the (CPU)
process group. Without an initialized process group everything degenerates to one rank.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

import torch
import torch.distributed as dist

from nvrx.ckpt.errors import CheckpointError


class _Solo:
    """``process_group=SOLO``: this process saves alone, with no collective even when a process group exists.

    A just-in-time checkpoint (``nvrx.ckpt.jit``) is written by one surviving replica while its peers are dead
    or blocked: a collective would wait for them forever.
    """

    def __repr__(self) -> str:
        return "SOLO"


SOLO: Any = _Solo()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a CPU uint8 tensor, without numpy (which torch may lack)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())

class DistWrapper:
    """Rank facts and JSON collectives over PROCESS_GROUP (default: the world)."""

    def __init__(self, process_group: Any = None, coordinator_rank: int = 0) -> None:
        solo = process_group is SOLO
        self.group = None if solo else process_group
        self.use_dist = not solo and dist.is_available() and dist.is_initialized()
        self.coordinator_rank = coordinator_rank
        if self.use_dist:
            pg = process_group or dist.group.WORLD
            if torch.device("cpu") not in getattr(pg, "_device_types", [torch.device("cpu")]):
                raise CheckpointError("async checkpointing needs a CPU (gloo) process group: init_process_group("
                                      "backend='cpu:gloo,cuda:nccl') or pass process_group=dist.new_group(backend='gloo')")
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            self.global_coordinator_rank = (dist.get_global_rank(process_group, coordinator_rank)
                                            if process_group is not None else coordinator_rank)
        else:
            self.rank, self.world_size, self.global_coordinator_rank = 0, 1, 0
        if not 0 <= coordinator_rank < self.world_size:
            raise CheckpointError(f"coordinator_rank {coordinator_rank} is not a rank of the group (size {self.world_size})")
        self.is_coordinator = self.rank == coordinator_rank

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's OBJ, in rank order, on every rank."""
        if not self.use_dist or self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=self.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, padded, group=self.group)
        return [json.loads(_tensor_bytes(o[: int(s.item())])) for o, s in zip(out, sizes)]

    def broadcast_json(self, obj: Any) -> Any:
        """The coordinator's OBJ on every rank (OBJ is ignored elsewhere)."""
        if not self.use_dist or self.world_size == 1:
            return obj
        if self.is_coordinator:
            data = torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self.global_coordinator_rank, group=self.group)
        if not self.is_coordinator:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=self.global_coordinator_rank, group=self.group)
        return json.loads(_tensor_bytes(data))

    def all_min(self, flags: list[int]) -> list[int]:
        """Element-wise minimum of FLAGS over all ranks (one small collective)."""
        if not self.use_dist or self.world_size == 1:
            return list(flags)
        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def all_true(self, flag: bool) -> bool:
        return bool(self.all_min([int(bool(flag))])[0])
