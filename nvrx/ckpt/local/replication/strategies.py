"""Replication strategies (spec 002 names): each rank's local checkpoint is copied to the other members of its
clique, so that losing a node (its local files) loses no shard.

Everything moves over ``torch.distributed`` collectives inside the clique's process group: the header as JSON
bytes, the tensors as one flat uint8 buffer, so it works over gloo on CPU (``target_device='cpu'``) and over
NCCL with ``target_device='cuda'``. Nothing is pickled.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from nvrx.ckpt.local._buffers import byte_view
from nvrx.ckpt.local.base_state_dict import TensorAwareStateDict
from nvrx.ckpt.local.codec import Packed, check_payload, pack, unpack
from nvrx.ckpt.local.errors import LocalCheckpointError, NoReplicasAvailableError
from nvrx.ckpt.local.replication.group_utils import ExchangePlan, clique_groups, make_plan, resolve_jump

log = logging.getLogger(__name__)

__all__ = ["ReplicationStrategy", "CliqueReplicationStrategy", "LazyReplicationStrategyBuilder",
           "LazyCliqueReplicationStrategy", "NoReplicasAvailableError", "ExchangePlan"]


class ReplicationStrategy(ABC):
    """How local checkpoints are replicated and retrieved."""

    @abstractmethod
    def replicate(self, local_ckpt: TensorAwareStateDict, id_: str) -> tuple[list[TensorAwareStateDict], list[str]]:
        """Send LOCAL_CKPT (named ID_) to the replica holders; returns the checkpoints received, with their ids."""

    @abstractmethod
    def retrieve_plan(self, globally_available_ids: Mapping[int, Sequence[str]],
                      wanted: Sequence[str | None]) -> ExchangePlan:
        """Who sends what to whom so every member gets the id it wants (NoReplicasAvailableError if impossible)."""

    @abstractmethod
    def retrieve_execute(self, *args: Any, **kwargs: Any) -> Any:
        """Carry out a plan made by ``retrieve_plan``."""


def _send_or_receive(packed: Packed | None, src: int, group: Any, device: str, verify: bool = True) -> Packed:
    """Broadcast PACKED from global rank SRC within GROUP (sizes, header JSON, payload); every member returns it.
    With VERIFY a receiver checks the payload's CRC-32 against the header. Replication and retrieval skip it:
    a replica's file carries the sender's CRC-32 and is checked when read, and a retrieved shard comes from a file
    the sender has just verified; the transport (TCP / NCCL) guards the way between."""
    me = dist.get_rank()
    if me == src:
        head = torch.frombuffer(bytearray(packed.header_bytes()), dtype=torch.uint8)
        sizes = torch.tensor([head.numel(), packed.payload.numel()], dtype=torch.int64, device=device)
    else:
        sizes = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=src, group=group)
    n_head, n_payload = (int(v) for v in sizes.cpu())
    head = head.to(device) if me == src else torch.empty(n_head, dtype=torch.uint8, device=device)
    dist.broadcast(head, src=src, group=group)
    payload = packed.payload.to(device) if me == src else torch.empty(n_payload, dtype=torch.uint8, device=device)
    if n_payload:
        dist.broadcast(payload, src=src, group=group)
    if me == src:
        return packed
    header = json.loads(bytes(byte_view(head.cpu().contiguous())))
    if "error" in header:
        raise LocalCheckpointError(f"rank {src} could not send {header.get('id')}: {header['error']}")
    received = Packed(header, payload.cpu())
    if verify:
        check_payload(header, received.payload, f"replica {header.get('id')} from rank {src}")
    return received


def _load_or_error(load_local: Callable[[str], Packed], id_: str) -> Packed:
    """The packed checkpoint ID_, or a header carrying the error, so the receiver learns why instead of waiting."""
    try:
        return load_local(id_)
    except LocalCheckpointError as exc:
        return Packed({"id": id_, "error": str(exc)}, torch.empty(0, dtype=torch.uint8))


class CliqueReplicationStrategy(ReplicationStrategy):
    """All members of LOCAL_GROUP (a clique) hold every member's checkpoint."""

    def __init__(self, local_group: Any, target_device: str = "cpu") -> None:
        self.local_group = local_group
        self.target_device = target_device
        self.group_ranks: list[int] = list(dist.get_process_group_ranks(local_group))
        if target_device.startswith("cuda") and not torch.cuda.is_available():
            raise LocalCheckpointError(f"target_device={target_device!r} but CUDA is not available; use 'cpu' (gloo)")

    @classmethod
    def from_replication_params(cls, replication_jump: int = 0, replication_factor: int = 2,
                                target_device: str = "cpu") -> "CliqueReplicationStrategy":
        """Build every clique's process group (a collective: all ranks call this) and keep this rank's.
        J = 0 means ranks per node (LOCAL_WORLD_SIZE), so the F copies of a shard sit on F different nodes."""
        if not dist.is_initialized():
            raise LocalCheckpointError("replication needs torch.distributed: call dist.init_process_group() first")
        groups = clique_groups(dist.get_world_size(), resolve_jump(replication_jump), replication_factor)
        mine = None
        for ranks in groups:
            pg = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = pg
        log.debug("replication cliques: %s", groups)
        return cls(mine, target_device)

    def _exchange(self, mine: Packed) -> list[Packed]:
        """Every member's packed checkpoint, except this rank's own, in group order."""
        me = dist.get_rank()
        out = []
        for src in self.group_ranks:
            got = _send_or_receive(mine if src == me else None, src, self.local_group, self.target_device,
                                   verify=False)
            if src != me:
                out.append(got)
        return out

    def exchange_sizes(self, header_nbytes: int, payload_nbytes: int) -> list[tuple[int, int]]:
        """(header, payload) sizes of every member's checkpoint, in group order (one small all-gather in the
        clique), so receivers can stage replicas in place before the exchange starts."""
        mine = torch.tensor([header_nbytes, payload_nbytes], dtype=torch.int64, device=self.target_device)
        out = [torch.zeros(2, dtype=torch.int64, device=self.target_device) for _ in self.group_ranks]
        dist.all_gather(out, mine, group=self.local_group)
        return [(int(t[0]), int(t[1])) for t in (o.cpu() for o in out)]

    def exchange_into(self, head: bytes, payload: torch.Tensor, slots: Sequence[torch.Tensor | None],
                      sizes: Sequence[tuple[int, int]], on_received: Callable[[dict[str, Any], int], None]) -> None:
        """Send this rank's HEAD + PAYLOAD to the clique and receive every other member's payload straight into
        SLOTS[i] (a uint8 CPU view, e.g. of a staging buffer; None for this rank), with SIZES from
        ``exchange_sizes``. ON_RECEIVED(header, i) is called as each one lands. Every member must call it."""
        me = dist.get_rank()
        on_device = not self.target_device.startswith("cpu")
        for i, src in enumerate(self.group_ranks):
            n_head, n_payload = sizes[i]
            if src == me:
                h = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.target_device)
                p = payload.to(self.target_device) if on_device else payload
            else:
                h = torch.empty(n_head, dtype=torch.uint8, device=self.target_device)
                slot = slots[i]
                assert slot is not None and slot.numel() == n_payload
                p = torch.empty(n_payload, dtype=torch.uint8, device=self.target_device) if on_device else slot
            dist.broadcast(h, src=src, group=self.local_group)
            if n_payload:
                dist.broadcast(p, src=src, group=self.local_group)
            if src != me:
                if on_device:
                    slots[i].copy_(p)  # type: ignore[union-attr]
                on_received(json.loads(bytes(byte_view(h.cpu().contiguous()))), i)

    def replicate_packed(self, mine: Packed) -> list[Packed]:
        """``replicate`` without decoding: what the manager writes to files as is."""
        return self._exchange(mine)

    def replicate(self, local_ckpt: TensorAwareStateDict, id_: str) -> tuple[list[TensorAwareStateDict], list[str]]:
        got = self._exchange(pack(local_ckpt, id_))
        return [unpack(p, verify=False) for p in got], [p.id for p in got]

    def retrieve_plan(self, globally_available_ids: Mapping[int, Sequence[str]],
                      wanted: Sequence[str | None]) -> ExchangePlan:
        """WANTED[i]: the id the i-th member of this clique needs; GLOBALLY_AVAILABLE_IDS: global rank -> ids held."""
        return make_plan(self.group_ranks, globally_available_ids, wanted)

    def retrieve_execute(self, plan: ExchangePlan, load_local: Callable[[str], Packed]) -> Packed | None:
        """Run PLAN: members send what they hold (LOAD_LOCAL reads it), and this rank returns the packed checkpoint
        it wanted (own file or received), or None if it wanted nothing."""
        me = dist.get_rank()
        result, failure = None, None
        if me in plan.local:
            try:
                result = load_local(plan.local[me])
            except LocalCheckpointError as exc:
                failure = exc  # raised after the transfers, so no peer waits for this rank forever
        for sender, receiver, id_ in plan.transfers:  # every member takes part in every broadcast, in order
            try:
                got = _send_or_receive(_load_or_error(load_local, id_) if me == sender else None, sender,
                                       self.local_group, self.target_device, verify=False)
            except LocalCheckpointError as exc:
                got, failure = None, failure or exc
            if me == receiver:
                result = got
        if failure is not None:
            raise failure
        return result


EagerT = TypeVar("EagerT", bound=ReplicationStrategy)


class LazyReplicationStrategyBuilder(ReplicationStrategy, ABC, Generic[EagerT]):
    """A replication strategy whose process groups are made on first use (they cannot be made before
    ``init_process_group``, which may come after the strategy is configured)."""

    def __init__(self) -> None:
        self._strategy: EagerT | None = None

    @abstractmethod
    def _eager_build(self) -> EagerT:
        """Make the real strategy (collective: every rank gets here at the same point)."""

    @property
    def replication_strategy(self) -> EagerT:
        if self._strategy is None:
            self._strategy = self._eager_build()
        return self._strategy

    def replicate(self, local_ckpt: TensorAwareStateDict, id_: str) -> tuple[list[TensorAwareStateDict], list[str]]:
        return self.replication_strategy.replicate(local_ckpt, id_)

    def retrieve_plan(self, globally_available_ids: Mapping[int, Sequence[str]],
                      wanted: Sequence[str | None]) -> ExchangePlan:
        return self.replication_strategy.retrieve_plan(globally_available_ids, wanted)

    def retrieve_execute(self, *args: Any, **kwargs: Any) -> Any:
        return self.replication_strategy.retrieve_execute(*args, **kwargs)


class LazyCliqueReplicationStrategy(LazyReplicationStrategyBuilder[CliqueReplicationStrategy]):
    """``CliqueReplicationStrategy.from_replication_params`` deferred to first use."""

    def __init__(self, replication_jump: int = 0, replication_factor: int = 2, target_device: str = "cpu") -> None:
        super().__init__()
        self.replication_jump = replication_jump
        self.replication_factor = replication_factor
        self.target_device = target_device

    def _eager_build(self) -> CliqueReplicationStrategy:
        return CliqueReplicationStrategy.from_replication_params(self.replication_jump, self.replication_factor,
                                                                 self.target_device)
