"""Pure functions of replication: the cliques of (W, J, F) and the plan of who sends which shard to whom.

Pure so that every rank computes the same answer from the same inputs without talking, and so the tests can
check them for any world size without processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from nvrx.ckpt.local.errors import NoReplicasAvailableError
from nvrx.common.errors import ConfigError


def resolve_jump(replication_jump: int) -> int:
    """J = REPLICATION_JUMP, or the ranks per node (LOCAL_WORLD_SIZE) for 0, so every clique spans nodes."""
    if replication_jump:
        return replication_jump
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1:
        raise ConfigError("replication_jump=0 means 'ranks per node', but LOCAL_WORLD_SIZE is not set; "
                          "run under nvrx launch / torchrun or pass replication_jump=<ranks per node>")
    return int(local)


def clique_groups(world_size: int, replication_jump: int, replication_factor: int) -> list[list[int]]:
    """The spec's cliques: {n, n+J, ..., n+(F-1)J} for n = a*J*F + b, a < W/(J*F), b < J, in that order."""
    j, f, w = replication_jump, replication_factor, world_size
    if j < 1 or f < 1 or w < 1:
        raise ConfigError(f"replication needs world size, replication_jump and replication_factor >= 1 "
                          f"(got W={w}, J={j}, F={f})")
    if w % (j * f):
        raise ConfigError(f"replication: world size {w} is not divisible by replication_jump * replication_factor "
                          f"= {j} * {f} = {j * f}; choose J and F so that J*F divides the world size")
    return [[a * j * f + b + i * j for i in range(f)] for a in range(w // (j * f)) for b in range(j)]


@dataclass(frozen=True)
class ExchangePlan:
    """How the members of one group get the shards they want: taken from their own files (``local``) or sent by
    another member (``transfers``: (sender, receiver, id), executed in this order by every member)."""

    group_ranks: tuple[int, ...]
    wanted: tuple[str | None, ...]
    local: Mapping[int, str] = field(default_factory=dict)
    transfers: tuple[tuple[int, int, str], ...] = ()


def make_plan(group_ranks: Sequence[int], available: Mapping[int, Sequence[str]],
              wanted: Sequence[str | None]) -> ExchangePlan:
    """WANTED[i] is the id the i-th member of GROUP_RANKS needs (None: nothing). A member that holds its id uses
    its own copy; otherwise the lowest-ranked member holding it sends it. NoReplicasAvailableError if nobody does."""
    if len(wanted) != len(group_ranks):
        raise ValueError(f"wanted has {len(wanted)} entries for a group of {len(group_ranks)} ranks")
    local: dict[int, str] = {}
    transfers: list[tuple[int, int, str]] = []
    for rank, id_ in zip(group_ranks, wanted):
        if id_ is None:
            continue
        if id_ in available.get(rank, ()):
            local[rank] = id_
            continue
        holders = [r for r in group_ranks if id_ in available.get(r, ())]
        if not holders:
            raise NoReplicasAvailableError(f"no copy of {id_} (wanted by rank {rank}) on any of ranks "
                                           f"{list(group_ranks)}: own file and replicas are lost; restore from "
                                           "the global checkpoint tier")
        transfers.append((holders[0], rank, id_))
    return ExchangePlan(tuple(group_ranks), tuple(wanted), local, tuple(transfers))
