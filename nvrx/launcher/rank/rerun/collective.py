"""The few collectives the machine needs: agree on flags, and share small JSON facts between ranks.

Every rank must take the same path (re-run or not, checkpoint or not), so per-rank flags are combined
with one all-reduce (MAX). Facts about the suspects (rank, node, result) are exchanged as JSON in uint8
tensors, never pickled (``all_gather_object`` would unpickle what other ranks send). Without an
initialized process group (one process) they are the identity.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _active(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


def _device(group: Any) -> torch.device:
    """Where the group's tensors must live: CUDA for an NCCL-only group, else the CPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """This process's rank in GROUP and its size ((0, 1) without a process group)."""
    if not _active(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def reduce_max(flags: list[int], group: Any = None) -> list[int]:
    """The element-wise maximum of FLAGS over all ranks (one all-reduce)."""
    if not _active(group):
        return list(flags)
    t = torch.tensor(flags, dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(x) for x in t.tolist()]


def all_gather_json(value: Any, group: Any = None) -> list[Any]:
    """VALUE (JSON-able) from every rank, in rank order."""
    if not _active(group):
        return [value]
    device = _device(group)
    data = json.dumps(value, separators=(",", ":")).encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else buf[:0]
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[:int(s.item())].cpu().tolist()).decode()) for b, s in zip(bufs, sizes)]
