"""JSON encoding of DCP save plans and write results, so ranks exchange them without pickle.

Covers what the default planner and our storage writer put in a plan: write items (tensor,
shard, bytes), the storage prefix, and the flattening map (fqn -> key path). Anything else
(a custom planner's own ``planner_data``) is refused with a clear error instead of pickled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from nvrx.ckpt.errors import CheckpointError


def _name(obj: Any) -> str:
    return str(obj).removeprefix("torch.")


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise CheckpointError(f"unknown {kind.__name__} {name!r} in a checkpoint plan")
    return value


def encode_index(index: MetadataIndex) -> list[Any]:
    return [index.fqn, None if index.offset is None else list(index.offset), index.index]


def decode_index(data: list[Any]) -> MetadataIndex:
    fqn, offset, idx = data
    return MetadataIndex(fqn, None if offset is None else torch.Size(offset), idx)


def _encode_tensor_data(td: TensorWriteData) -> dict[str, Any]:
    p = td.properties
    return {"offsets": list(td.chunk.offsets), "sizes": list(td.chunk.sizes), "size": list(td.size),
            "dtype": _name(p.dtype), "layout": _name(p.layout), "requires_grad": p.requires_grad,
            "memory_format": _name(p.memory_format), "pin_memory": p.pin_memory}


def _decode_tensor_data(d: dict[str, Any]) -> TensorWriteData:
    props = TensorProperties(dtype=_torch_attr(d["dtype"], torch.dtype), layout=_torch_attr(d["layout"], torch.layout),
                             requires_grad=d["requires_grad"],
                             memory_format=_torch_attr(d["memory_format"], torch.memory_format),
                             pin_memory=d["pin_memory"])
    chunk = ChunkStorageMetadata(offsets=torch.Size(d["offsets"]), sizes=torch.Size(d["sizes"]))
    return TensorWriteData(chunk=chunk, properties=props, size=torch.Size(d["size"]))


def encode_item(item: WriteItem) -> dict[str, Any]:
    return {"index": encode_index(item.index), "type": item.type.name,
            "nbytes": None if item.bytes_io_data is None else item.bytes_io_data.nbytes,
            "tensor": None if item.tensor_data is None else _encode_tensor_data(item.tensor_data)}


def decode_item(d: dict[str, Any]) -> WriteItem:
    return WriteItem(index=decode_index(d["index"]), type=WriteItemType[d["type"]],
                     bytes_io_data=None if d["nbytes"] is None else BytesIOWriteData(d["nbytes"]),
                     tensor_data=None if d["tensor"] is None else _decode_tensor_data(d["tensor"]))


def _encode_planner_data(data: Any) -> Any:
    if data is None:
        return None
    if isinstance(data, dict) and all(isinstance(k, str) and isinstance(v, tuple) for k, v in data.items()):
        if all(isinstance(p, (str, int)) and not isinstance(p, bool) for v in data.values() for p in v):
            return {k: list(v) for k, v in data.items()}
    raise CheckpointError(f"the save planner's planner_data ({type(data).__name__}) cannot be exchanged between ranks "
                          "without pickle; use the default planner or keep planner_data a {fqn: key-path} map")


def _encode_storage_data(data: Any) -> Any:
    if data is None:
        return None
    if isinstance(data, _StoragePrefix):
        return {"prefix": data.prefix}
    raise CheckpointError(f"unsupported storage_data {type(data).__name__} in a save plan")


def encode_plan(plan: SavePlan) -> dict[str, Any]:
    return {"items": [encode_item(i) for i in plan.items], "storage_data": _encode_storage_data(plan.storage_data),
            "planner_data": _encode_planner_data(plan.planner_data), "usable": plan.usable}


def decode_plan(d: dict[str, Any]) -> SavePlan:
    pd = d["planner_data"]
    sd = d["storage_data"]
    return SavePlan(items=[decode_item(i) for i in d["items"]],
                    storage_data=None if sd is None else _StoragePrefix(sd["prefix"]),
                    planner_data=None if pd is None else {k: tuple(v) for k, v in pd.items()},
                    usable=d.get("usable", True))


def encode_write_result(result: WriteResult, crc32: int, kind: str) -> dict[str, Any]:
    info = result.storage_data
    return {"index": encode_index(result.index), "size": result.size_in_bytes, "file": info.relative_path,
            "offset": info.offset, "length": info.length, "crc32": crc32, "kind": kind}


def decode_write_result(d: dict[str, Any]) -> WriteResult:
    return WriteResult(index=decode_index(d["index"]), size_in_bytes=d["size"],
                       storage_data=_StorageInfo(d["file"], d["offset"], d["length"]))
