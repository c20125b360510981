"""The values the rendezvous hands the agent: a round's membership and the record that ended it.

Torch-free (unlike rendezvous.py, which needs TCPStore), so the agent can name these types before
it imports torch: the fork server's `import torch` overlaps with the agent's only if the agent
defers its own.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from nvrx.common.errors import NvrxError
from nvrx.events import StopDetail, field_problem, spec_of

MAX_RECORD_BYTES = 1 << 20  # a real record is a few KiB (a stop record carries 20 output lines)
MAX_NODES = 1 << 16


class StopKind(str, enum.Enum):
    """Why a round ended; the value is what the store and the event files hold."""

    FAILED = "failed"  # a rank (or its monitor) failed
    NODE_LEFT = "node_left"  # a node stopped beating
    SUCCEEDED = "succeeded"  # every node's ranks exited 0
    SCALE_UP = "scale_up"  # a standby node asked a round below max nodes to make room
    INTERRUPTED = "interrupted"  # an agent got a stop signal

    def __str__(self) -> str:  # log lines and f-strings show "failed", as before the enum
        return self.value


_DETAIL_SPEC = spec_of(StopDetail)


class NodeInfo(NamedTuple):
    """One member of a round. A named tuple (immutable, as a frozen dataclass would be), because every agent
    builds one per member from each closed record: ten times cheaper to make than a frozen dataclass."""

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


@dataclass(frozen=True, eq=False)
class StopRecord:
    """The record that ended a round. Its reason is typed (``StopDetail``, the event schema's record: the same
    fields the rdzv_stop event logs), so readers use attributes (``rec.detail.steer``), never keys of a dict."""

    round: int
    kind: StopKind  # a plain string in the store; made a StopKind on construction
    by_node: str
    detail: StopDetail
    restart_count: int
    give_up: bool  # a fault with the restart budget spent (or a rank asking for no restart): the job ends

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StopKind(self.kind))

    def fields(self) -> dict[str, Any]:
        """The record as JSON-ready fields (what the store holds)."""
        return {"round": self.round, "kind": self.kind.value, "by_node": self.by_node,
                "detail": self.detail.to_fields(), "restart_count": self.restart_count, "give_up": self.give_up}

    def to_json(self) -> str:
        return json.dumps(self.fields(), default=str, separators=(",", ":"))

    def __eq__(self, other: object) -> bool:  # by value (StopDetail, an event record, compares by identity)
        return isinstance(other, StopRecord) and self.fields() == other.fields()

    def __hash__(self) -> int:
        return hash(self.to_json())

    @classmethod
    def from_json(cls, raw: bytes | str) -> "StopRecord":
        """Parse a stop record from the store, checking every field (the detail against the event schema);
        BadRecord if it is not one we wrote."""
        obj = _json_object(raw)
        kind = obj.get("kind")
        if not isinstance(kind, str) or kind not in {k.value for k in StopKind}:
            raise BadRecord(f"kind is {_shown(kind)}, not one of {', '.join(k.value for k in StopKind)}")
        _need(obj, "round", _is_count)
        _need(obj, "restart_count", _is_count)
        _need(obj, "by_node", _is_name)
        _need(obj, "detail", lambda v: isinstance(v, dict))
        _need(obj, "give_up", lambda v: isinstance(v, bool))
        problem = field_problem(obj["detail"], _DETAIL_SPEC, "detail.")
        if problem is not None:
            raise BadRecord(problem)
        if obj["detail"].keys() - StopDetail.F.__dict__.keys():
            raise BadRecord(f"detail has unknown fields {sorted(obj['detail'].keys() - StopDetail.F.__dict__.keys())}")
        signum = obj["detail"].get("signum")
        if signum is not None and not (_is_count(signum) and 0 < signum < 128):
            raise BadRecord(f"detail.signum is {_shown(signum)}, not a signal number")
        return cls(obj["round"], StopKind(kind), obj["by_node"], StopDetail.of(obj["detail"]), obj["restart_count"],
                   obj["give_up"])


class BadRecord(NvrxError, ValueError):
    """A value read from the rendezvous store is not a record nvrx wrote (garbage, or forged by another
    program that can reach the store): the message says what is wrong with it, in a few words."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 512


def _need(obj: dict, key: str, ok: Any) -> None:
    if not ok(obj.get(key)):
        raise BadRecord(f"{key} is {_shown(obj.get(key))}" if key in obj else f"no {key}")


def _json_object(raw: bytes | str) -> dict:
    """RAW as a JSON object; BadRecord when it is too long, not UTF-8, not JSON or not an object."""
    if len(raw) > MAX_RECORD_BYTES:
        raise BadRecord(f"{len(raw)} bytes, more than any record nvrx writes")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise BadRecord("not JSON") from None
    if not isinstance(obj, dict):
        raise BadRecord(f"{type(obj).__name__}, not a JSON object")
    return obj


def parse_node(obj: Any) -> NodeInfo:
    """One node of a closed round or a join record; BadRecord unless it has a node id, address and nproc."""
    if not isinstance(obj, dict):
        raise BadRecord(f"a node is {_shown(obj)}, not an object")
    _need(obj, "node_id", _is_name)
    _need(obj, "addr", _is_name)
    _need(obj, "nproc", lambda v: _is_count(v) and v >= 1)
    return NodeInfo(obj["node_id"], obj["addr"], obj["nproc"])


def parse_nodes(objs: list) -> tuple[NodeInfo, ...]:
    """The nodes of a closed round, each checked as parse_node does (its message for the first bad one).

    Every agent reads every closed record, so the common case is inlined: a 1,024-node record costs each agent
    well under a millisecond instead of several (and a simulation of N agents on one machine N times that).
    """
    out = []
    for obj in objs:
        nid = addr = nproc = None
        if type(obj) is dict:
            nid, addr, nproc = obj.get("node_id"), obj.get("addr"), obj.get("nproc")
        if not (type(nid) is str and type(addr) is str and type(nproc) is int
                and 0 < len(nid) <= 512 and 0 < len(addr) <= 512 and nproc >= 1):
            parse_node(obj)  # raises BadRecord saying what is wrong
            raise BadRecord(f"a node is {_shown(obj)}")  # not reached: the checks above are parse_node's
        out.append(NodeInfo(nid, addr, nproc))
    return tuple(out)


def parse_join(raw: bytes | str) -> dict:
    """A join record (NodeInfo fields plus the joiner's --node-rank, maybe null)."""
    obj = _json_object(raw)
    parse_node(obj)
    _need(obj, "node_rank", lambda v: v is None or _is_count(v))
    return obj


def parse_closed(raw: bytes | str) -> dict:
    """A closed round: its number, restart count and members (or the error that stopped it from closing); its
    "nodes" come back as a tuple of NodeInfo."""
    obj = _json_object(raw)
    _need(obj, "round", _is_count)
    _need(obj, "restart_count", _is_count)
    _need(obj, "nodes", lambda v: isinstance(v, list) and len(v) <= MAX_NODES)
    if "error" in obj:
        _need(obj, "error", _is_name)
    obj["nodes"] = parse_nodes(obj["nodes"])  # parsed once: the members as NodeInfo, in group-rank order
    ids = [n.node_id for n in obj["nodes"]]
    if len(set(ids)) != len(ids):
        raise BadRecord("a node is listed twice")
    if not ids and "error" not in obj:
        raise BadRecord("no nodes")
    return obj


def parse_pg(raw: bytes | str) -> dict:
    """Where round N's process-group store listens: {addr, port}, or {error} from group rank 0."""
    obj = _json_object(raw)
    if "error" in obj:
        _need(obj, "error", _is_name)
        return obj
    _need(obj, "addr", _is_name)
    _need(obj, "port", lambda v: _is_count(v) and 0 < v < 65536)
    return obj
