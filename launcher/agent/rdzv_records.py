"""The values the rendezvous hands the agent: a round's membership and the record that ended it.

Torch-free (unlike rendezvous.py, which needs TCPStore), so the agent can name these types before
it imports torch: the fork server's `import torch` overlaps with the agent's only if the agent
defers its own.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass


class StopKind(str, enum.Enum):
    """Why a round ended; the value is what the store and the event files hold."""

    FAILED = "failed"  # a rank (or its monitor) failed
    NODE_LEFT = "node_left"  # a node stopped beating
    SUCCEEDED = "succeeded"  # every node's ranks exited 0
    SCALE_UP = "scale_up"  # a standby node asked a round below max nodes to make room
    INTERRUPTED = "interrupted"  # an agent got a stop signal

    def __str__(self) -> str:  # log lines and f-strings show "failed", as before the enum
        return self.value


FAULT_KINDS = (StopKind.FAILED, StopKind.NODE_LEFT)  # only these spend the restart budget


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    addr: str
    nproc: int


@dataclass(frozen=True)
class RoundResult:
    round: int
    group_rank: int
    nodes: tuple[NodeInfo, ...]
    restart_count: int
    master_addr: str
    master_port: int
    agent_hosts_pg_store: bool

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def rank_offset(self) -> int:
        return sum(n.nproc for n in self.nodes[: self.group_rank])


@dataclass(frozen=True)
class StopRecord:
    round: int
    kind: StopKind  # a plain string in the store; made a StopKind on construction
    by_node: str
    detail: dict
    restart_count: int
    give_up: bool  # a fault with the restart budget spent (or a rank asking for no restart): the job ends

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StopKind(self.kind))

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> "StopRecord":
        return cls(**json.loads(raw))
