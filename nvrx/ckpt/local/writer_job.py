"""The local tier's job kind for the persistent checkpoint writer process (``nvrx.ckpt.async_ckpt.writer_main``, op
``local``): write one rank's local checkpoint files from a staging memfd.

The training process has copied its own shard into the staging buffer before the job is submitted; the replicas
of its clique arrive in the same buffer while the replication exchange runs on a thread of the training process,
which announces each one on a pipe handed over with the job (one JSON line: header, offset, size; or the
exchange's error). The writer computes each payload's CRC-32 (off the training process), puts it in the header and
writes the file atomically and durably (``codec.write_raw``). It answers with the names it wrote; it publishes
nothing: the training processes agree a save is complete everywhere before older iterations are removed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

from nvrx.ckpt.local.codec import write_raw
from nvrx.ckpt.local.naming import SUFFIX, parse_id


def _write_item(directory: Path, item: dict[str, Any], view: memoryview) -> dict[str, Any]:
    header = item["header"]
    if not isinstance(header, dict) or parse_id(str(header.get("id"))) is None:
        raise ValueError(f"a local checkpoint item has no valid id: {str(header.get('id'))[:80]!r}")
    off, nbytes = int(item["off"]), int(item["nbytes"])
    if off < 0 or off + nbytes > len(view) or nbytes != header.get("payload_nbytes"):
        raise ValueError(f"local checkpoint {header['id']}: bytes [{off}, {off + nbytes}) do not fit the staging "
                         f"buffer or the header's payload size")
    payload = view[off: off + nbytes]
    header["payload_crc32"] = zlib.crc32(payload)
    path = directory / f"{header['id']}{SUFFIX}"
    write_raw(path, json.dumps(header, separators=(",", ":")).encode(), payload)
    return {"name": path.name, "nbytes": nbytes}


def _announced(pipe_fd: int, count: int):
    """The COUNT replica items the training process announces on PIPE_FD, as they arrive."""
    with os.fdopen(pipe_fd, "rb", closefd=False) as pipe:
        for _ in range(count):
            line = pipe.readline()
            if not line:
                raise RuntimeError("the training process stopped announcing replicas (replication exchange interrupted)")
            item = json.loads(line)
            if "error" in item:
                raise RuntimeError(f"replication exchange failed: {item['error']}")
            yield item


def run(job: dict[str, Any], view: memoryview, pipe_fd: int | None) -> list[dict[str, Any]]:
    """Check free space for the whole save, write the own shard, then each replica as it is announced."""
    directory = Path(job["dir"])
    need = int(job["need"])
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(errno.ENOSPC, f"not enough space: need {need} bytes, {free} free")
    files = [_write_item(directory, job["own"], view)]
    replicas = int(job.get("replicas", 0))
    if replicas:
        if pipe_fd is None:
            raise RuntimeError("a local checkpoint save cannot be retried (its replicas were announced once); "
                               "the next save replaces it")
        files += [_write_item(directory, item, view) for item in _announced(pipe_fd, replicas)]
    return files
