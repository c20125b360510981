"""Our own local checkpoint format: a JSON header (hollow structure + tensor table) and one flat payload.

No pickle anywhere: the hollow structure is JSON with a few tags (dict with non-string keys, list, tuple,
tensor slot), and tensors are raw bytes at 64-byte aligned offsets of one payload. The same (header,
payload) pair goes to a file and over the wire to the ranks holding replicas, so a replica is written
without being decoded again.

File layout: ``MAGIC | u64 header length | header JSON | u32 CRC-32 of header | payload``; the header
holds the payload's size and CRC-32, so any torn, truncated or flipped file is detected on read.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from nvrx.ckpt.local._buffers import as_bytes, byte_view
from nvrx.ckpt.local.basic_state_dict import BasicTensorAwareStateDict, TensorPlaceholder
from nvrx.ckpt.local.errors import LocalCheckpointCorruptError, LocalCheckpointError
from nvrx.common.files import atomic_write

FORMAT = "nvrx-local-1"
MAGIC = b"NVRXLCK1"
ALIGN = 64
_CHUNK = 8 << 20
_PLAIN = (str, int, float, bool, type(None))


@dataclass
class Packed:
    """One rank's checkpoint, ready for a file or the wire: header (a dict) and the payload (flat uint8 tensor)."""

    header: dict[str, Any]
    payload: torch.Tensor
    buffer: torch.Tensor | None = None  # the allocation PAYLOAD is a view of (reusable once the save is done)

    @property
    def id(self) -> str:
        return self.header["id"]

    def header_bytes(self) -> bytes:
        return json.dumps(self.header, separators=(",", ":")).encode()


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of T: a DTensor's local shard, a ShardedTensor's (single) local shard, else T itself.
    A local checkpoint is per rank, so it keeps exactly that (resharding is the global tier's job)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local()
    if isinstance(t, ShardedTensor):
        shards = t.local_shards()
        if len(shards) != 1:
            raise LocalCheckpointError(f"a ShardedTensor with {len(shards)} local shards on this rank; a local "
                                       "checkpoint keeps one shard per rank (use one shard per rank, or a DTensor)")
        return shards[0].tensor
    return t


def _is_distributed(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and type(t).__name__ in ("DTensor", "ShardedTensor")


def _encode(node: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(node, torch.Tensor):
        tensors.append(local_part(node) if _is_distributed(node) else node)
        return {"s": len(tensors) - 1}
    if isinstance(node, TensorPlaceholder):
        raise LocalCheckpointError(f"{path} is a popped tensor: insert_tensors() before saving")
    if isinstance(node, dict):
        items = []
        for key, value in node.items():
            if not isinstance(key, _PLAIN):
                raise LocalCheckpointError(f"{path} has a key of type {type(key).__name__}; "
                                           "a local checkpoint keeps str/int/float/bool/None keys")
            items.append([key, _encode(value, tensors, f"{path}[{key!r}]")])
        return {"d": items}
    if isinstance(node, (list, tuple)):
        tag = "l" if isinstance(node, list) else "t"
        return {tag: [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(node)]}
    if isinstance(node, _PLAIN):
        return node
    raise LocalCheckpointError(f"{path} is a {type(node).__name__}: a local checkpoint holds tensors and plain values "
                               "(str, int, float, bool, None) in dicts, lists and tuples; convert it (e.g. to a dict)")


def _decode(node: Any, slots: list[TensorPlaceholder]) -> Any:
    if not isinstance(node, dict):
        return node
    if "s" in node:
        return slots[node["s"]]
    if "d" in node:
        return {k: _decode(v, slots) for k, v in node["d"]}
    if "l" in node:
        return [_decode(v, slots) for v in node["l"]]
    return tuple(_decode(v, slots) for v in node["t"])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise LocalCheckpointCorruptError(f"unknown dtype {name!r} in a local checkpoint header")
    return dtype


def layout(state: BasicTensorAwareStateDict | dict[str, Any], id_: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The header of STATE (without the payload's CRC-32) and its tensors in payload order, nothing copied yet:
    ``header["payload_nbytes"]`` says how much memory the snapshot needs before it is taken."""
    sd = state.to_state_dict() if isinstance(state, BasicTensorAwareStateDict) else state
    if not isinstance(sd, dict):
        raise LocalCheckpointError(f"a local checkpoint saves a dict or a BasicTensorAwareStateDict, got "
                                   f"{type(state).__name__}")
    tensors: list[torch.Tensor] = []
    hollow = _encode(sd, tensors, "state_dict")
    table, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        table.append({"dtype": str(t.dtype), "shape": list(t.shape), "device": str(t.device), "offset": offset,
                      "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    header = {"format": FORMAT, "id": id_, "hollow": hollow, "tensors": table, "payload_nbytes": offset,
              "payload_crc32": None}
    return header, tensors


def fill(header: dict[str, Any], tensors: list[torch.Tensor], payload: torch.Tensor) -> None:
    """Copy TENSORS into PAYLOAD (a uint8 tensor of ``header["payload_nbytes"]`` bytes) where HEADER puts them."""
    for t, entry in zip(tensors, header["tensors"]):
        payload[entry["offset"]: entry["offset"] + entry["nbytes"]].copy_(as_bytes(t))


def pack(state: BasicTensorAwareStateDict | dict[str, Any], id_: str, *, out: torch.Tensor | None = None,
         checksum: bool = True) -> Packed:
    """Encode STATE as header + payload. The payload is a copy of the tensors taken now (a snapshot), into OUT
    (a uint8 buffer from an earlier save, reused when large enough: no page faults) else a new buffer.
    CHECKSUM=False leaves the CRC-32 to ``seal`` (off the training thread)."""
    header, tensors = layout(state, id_)
    offset = header["payload_nbytes"]
    buffer = out if out is not None and out.numel() >= offset else torch.empty(offset, dtype=torch.uint8)
    payload = buffer[:offset]
    fill(header, tensors, payload)
    packed = Packed(header, payload, buffer)
    return seal(packed) if checksum else packed


def seal(packed: Packed) -> Packed:
    """Record the payload's CRC-32 in the header (before it is written or sent)."""
    if packed.header["payload_crc32"] is None:
        packed.header["payload_crc32"] = zlib.crc32(byte_view(packed.payload))
    return packed


def unpack(packed: Packed, verify: bool = True) -> BasicTensorAwareStateDict:
    """The state dict of PACKED, tensors on CPU as views of its payload (devices remembered for restoring)."""
    header, payload = packed.header, packed.payload
    if verify:
        check_payload(header, payload, header.get("id", "?"))
    slots = [TensorPlaceholder(i, _dtype(e["dtype"]), tuple(e["shape"]), e["device"])
             for i, e in enumerate(header["tensors"])]
    sd = _decode(header["hollow"], slots)
    out = BasicTensorAwareStateDict(sd)
    out._hollow = True
    out.insert_tensors(_tensor_at(payload, e, s) for e, s in zip(header["tensors"], slots))
    out.remember_devices([e["device"] for e in header["tensors"]])
    return out


def _tensor_at(payload: torch.Tensor, entry: dict[str, Any], slot: TensorPlaceholder) -> torch.Tensor:
    if entry["nbytes"] == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    raw = payload[entry["offset"]: entry["offset"] + entry["nbytes"]]
    return raw.view(slot.dtype).reshape(slot.shape)


def check_payload(header: dict[str, Any], payload: torch.Tensor, where: str) -> None:
    """Raise LocalCheckpointCorruptError unless PAYLOAD has the size and CRC-32 HEADER promises."""
    if payload.numel() != header["payload_nbytes"]:
        raise LocalCheckpointCorruptError(f"{where}: payload is {payload.numel()} bytes, header says "
                                          f"{header['payload_nbytes']}")
    if zlib.crc32(byte_view(payload.cpu().contiguous())) != header["payload_crc32"]:
        raise LocalCheckpointCorruptError(f"{where}: payload CRC-32 mismatch (the data changed after it was written)")


# --- files -------------------------------------------------------------------------------------------------


def write_file(path: Path, packed: Packed) -> None:
    """Write PACKED to PATH atomically and durably (``write_raw``)."""
    write_raw(path, packed.header_bytes(), byte_view(packed.payload))


def write_raw(path: Path, head: bytes, payload: memoryview) -> None:
    """Write header bytes HEAD and PAYLOAD to PATH atomically and durably (``nvrx.common.files.atomic_write``: a 0600
    temporary file in the same directory, fsync, rename, fsync the directory). A crash leaves either the old state
    or the complete new file (plus a temporary ``.<name>.tmp-...`` the next scan removes). Also run by the
    checkpoint writer process (``writer_job``)."""
    def write(f: BinaryIO) -> None:
        f.write(MAGIC + struct.pack("<Q", len(head)) + head + struct.pack("<I", zlib.crc32(head)))
        f.write(payload)

    atomic_write(path, write, mode=0o600)


def _read_header(f: BinaryIO, path: Path) -> dict[str, Any]:
    start = f.read(len(MAGIC) + 8)
    if len(start) < len(MAGIC) + 8 or start[: len(MAGIC)] != MAGIC:
        raise LocalCheckpointCorruptError(f"{path}: not a local checkpoint file (bad magic or truncated)")
    (length,) = struct.unpack("<Q", start[len(MAGIC):])
    if length > 1 << 30:
        raise LocalCheckpointCorruptError(f"{path}: header length {length} is implausible")
    head = f.read(length)
    crc = f.read(4)
    if len(head) != length or len(crc) != 4 or struct.unpack("<I", crc)[0] != zlib.crc32(head):
        raise LocalCheckpointCorruptError(f"{path}: header CRC-32 mismatch or truncated header")
    header = json.loads(head)
    if header.get("format") != FORMAT:
        raise LocalCheckpointCorruptError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    return header


def file_identity(fd_or_path: int | Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime_ns): a file that kept these since its payload was checked need not be checked again."""
    st = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_file(path: Path, trusted: tuple[int, int, int, int] | None = None) -> Packed:
    """The verified contents of PATH (LocalCheckpointCorruptError if any check fails). The payload's CRC-32 is
    skipped when the open file still has the identity TRUSTED (``file_identity`` taken when it was verified);
    header, sizes and CRC of the header are always checked."""
    with open(path, "rb") as f:
        unchanged = trusted is not None and file_identity(f.fileno()) == trusted
        header = _read_header(f, path)
        payload = torch.empty(header["payload_nbytes"], dtype=torch.uint8)
        got = f.readinto(byte_view(payload)) if payload.numel() else 0
        if got != payload.numel() or f.read(1):
            raise LocalCheckpointCorruptError(f"{path}: payload is not {payload.numel()} bytes (truncated or padded)")
    if not unchanged:
        check_payload(header, payload, str(path))
    return Packed(header, payload)


def check_file(path: Path) -> dict[str, Any]:
    """PATH's header, after the cheap checks: magic, header CRC-32, and a file size that matches the header (a torn
    or truncated file fails here). The payload's CRC-32 is checked when the payload is read (``read_file``)."""
    with open(path, "rb") as f:
        header = _read_header(f, path)
        end = f.tell() + header["payload_nbytes"]
        if os.fstat(f.fileno()).st_size != end:
            raise LocalCheckpointCorruptError(f"{path}: file size does not match its header (truncated or padded)")
    return header


def verify_file(path: Path) -> tuple[dict[str, Any], tuple[int, int, int, int]]:
    """Check PATH whole (header and payload CRC-32, size) reading it in chunks; its header and ``file_identity``."""
    with open(path, "rb") as f:
        identity = file_identity(f.fileno())
        header = _read_header(f, path)
        crc, size = 0, 0
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    if size != header["payload_nbytes"] or crc != header["payload_crc32"]:
        raise LocalCheckpointCorruptError(f"{path}: payload size/CRC-32 mismatch (corrupted or truncated)")
    return header, identity
