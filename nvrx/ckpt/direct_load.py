"""Load one of our DCP checkpoints straight into the target tensors, checking checksums as the bytes arrive.

A resume used to read every file twice and copy every tensor twice: a verification pass over all files,
then ``torch.distributed.checkpoint.load`` (a plan exchange, a ``torch.load`` per item into a new tensor,
a parallel ``copy_`` into the target: torch's intra-op thread pool starts there, hundreds of ms on a busy
machine). Our writer stores each tensor as a ``torch.save`` blob whose single data member holds the raw,
contiguous bytes and records its CRC-32 in the manifest, so a rank can ``preadv`` that member into the
target's memory and CRC it there: one read, no copy, no collective.

Used only when the whole state qualifies (plain contiguous CPU tensors whose saved chunk is the whole
tensor with the same dtype and shape, other values saved as bytes); anything else answers ``INELIGIBLE``
and the caller uses DCP for that checkpoint. Values are written in place as they are read: a damaged
checkpoint leaves the state partly overwritten, so the caller loads an older one over it or fails.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

from nvrx.ckpt.async_ckpt.file_writer import FileSlice, _is_data_member
from nvrx.common.errors import NvrxError

log = logging.getLogger("nvrx.ckpt.direct_load")

LOADED, INELIGIBLE, DAMAGED = 0, 1, 2  # ordered: the ranks agree on the worst answer (MAX)
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature ... name length, extra length


class Damaged(NvrxError):
    """The bytes of an item differ from what the manifest recorded."""


class _Ineligible(NvrxError):
    """The state (or this checkpoint) needs DCP's general loader."""


def load_direct(path: Path, manifest: dict[str, Any], metadata: Any, state_dict: dict[str, Any],
                check_crc: bool) -> tuple[int, str]:
    """Load checkpoint PATH into STATE_DICT in place; (LOADED | INELIGIBLE | DAMAGED, why). Not collective."""
    try:
        items = _plan(path, manifest, metadata, state_dict)
    except _Ineligible as exc:
        return INELIGIBLE, str(exc)
    fds: dict[str, int] = {}
    try:
        for item in items:
            if item[0] not in fds:
                fds[item[0]] = os.open(path / item[0], os.O_RDONLY | os.O_CLOEXEC)
        for name, offset, length, crc, target, setter in items:
            if setter is None:
                _read_tensor(fds[name], offset, length, crc if check_crc else None, target)
            else:
                setter(_read_value(fds[name], offset, length, crc if check_crc else None))
    except Damaged as exc:
        return DAMAGED, str(exc)
    except _Ineligible as exc:
        return INELIGIBLE, str(exc)
    except OSError as exc:
        return DAMAGED, f"cannot read it ({exc})"
    finally:
        for fd in fds.values():
            os.close(fd)
    return LOADED, ""


def _plan(path: Path, manifest: dict[str, Any], metadata: Any, state_dict: dict[str, Any]) -> list[tuple]:
    """(file, blob offset, blob length, recorded CRC, target tensor or None, value setter or None) per value."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    flat, mappings = flatten_state_dict(state_dict)
    recorded = {(name, item["offset"]): item for name, entry in manifest.get("files", {}).items()
                for item in entry.get("items", [])}
    plan = []
    for fqn, value in flat.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise _Ineligible(f"{fqn!r} is not in the checkpoint")
        if isinstance(value, torch.Tensor):
            _check_tensor(fqn, value, md, TensorStorageMetadata)
            index = MetadataIndex(fqn, [0] * value.dim())
            target, setter = value, None
        elif isinstance(md, BytesStorageMetadata) and not hasattr(value, "state_dict"):
            index = MetadataIndex(fqn)
            target, setter = None, _setter(set_element, state_dict, mappings[fqn])
        else:
            raise _Ineligible(f"{fqn!r} is not a value the direct loader reads")
        info = metadata.storage_data.get(index)
        if info is None or getattr(info, "transform_descriptors", None):
            raise _Ineligible(f"{fqn!r} is stored in a form the direct loader does not read")
        item = recorded.get((info.relative_path, info.offset))
        if item is None or item["length"] != info.length:
            raise Damaged(f"{info.relative_path} at {info.offset}: not in the manifest")
        plan.append((info.relative_path, info.offset, info.length, item["crc32"], target, setter))
    return plan


def _check_tensor(fqn: str, value: Any, md: Any, tensor_md: type) -> None:
    import torch

    if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.device.type != "cpu" \
            or value.layout != torch.strided or value.is_quantized or value.is_conj() or value.is_neg() \
            or not value.is_contiguous() or not isinstance(md, tensor_md):
        raise _Ineligible(f"{fqn!r} is not a plain contiguous CPU tensor saved whole")
    chunks = md.chunks
    if md.properties.dtype != value.dtype or tuple(md.size) != tuple(value.shape) or len(chunks) != 1 \
            or any(chunks[0].offsets) or tuple(chunks[0].sizes) != tuple(value.shape):
        raise _Ineligible(f"{fqn!r} was saved with another dtype, shape or split")


def _setter(set_element: Any, state_dict: dict[str, Any], path: Any) -> Any:
    return lambda obj: set_element(state_dict, path, obj)


def _read_tensor(fd: int, offset: int, length: int, crc: int | None, target: Any) -> None:
    """Read the data member of the torch.save blob at OFFSET into TARGET's memory; check its CRC-32."""
    nbytes = target.numel() * target.element_size()
    try:
        with zipfile.ZipFile(FileSlice(fd, offset, length)) as zf:
            members = [i for i in zf.infolist() if _is_data_member(i.filename)]
            if crc is not None:  # the small members too (pickle, version, ...): all of the blob is as written
                for info in zf.infolist():
                    if not _is_data_member(info.filename):
                        with zf.open(info) as member:  # zipfile checks the local header and, at EOF, the CRC
                            member.read()
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise Damaged(f"at {offset}: damaged data ({exc})") from None
    if len(members) != 1 or members[0].compress_type != zipfile.ZIP_STORED:
        raise _Ineligible(f"the blob at {offset} does not hold one stored data member")
    member = members[0]
    if member.file_size != nbytes:
        raise Damaged(f"at {offset}: {member.file_size} data bytes, the tensor has {nbytes}")
    header = os.pread(fd, _LOCAL_HEADER.size, offset + member.header_offset)
    if len(header) != _LOCAL_HEADER.size:
        raise Damaged(f"at {offset}: file is shorter than recorded")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise Damaged(f"at {offset}: damaged data (bad local header)")
    start = offset + member.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + nbytes > offset + length:
        raise Damaged(f"at {offset}: data member runs past its blob")
    if nbytes == 0:
        return
    view = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], start + done)
        if n == 0:
            raise Damaged(f"at {offset}: file is shorter than recorded")
        done += n
    if crc is not None:
        found = zlib.crc32(view)
        if found != crc or member.CRC != crc:
            raise Damaged(f"at {offset}: checksum {found:#010x} differs from the recorded {crc:#010x}")


def _read_value(fd: int, offset: int, length: int, crc: int | None) -> Any:
    """A non-tensor value: its bytes (CRC-checked), unpickled with torch's weights-only loader."""
    import pickle

    import torch

    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise Damaged(f"at {offset}: file is shorter than recorded")
    if crc is not None and zlib.crc32(data) != crc:
        raise Damaged(f"at {offset}: checksum {zlib.crc32(data):#010x} differs from the recorded {crc:#010x}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:  # a type weights_only refuses: DCP's loader decides
        raise _Ineligible(f"the value at {offset} needs the general loader ({exc})") from None
