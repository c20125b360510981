"""An asynchronous ``torch.save`` for state that is not distributed (one process, one file).

The object is serialized with ``torch.save`` into a reusable memfd during the call (so the file
holds the values of that moment, and an object that cannot be serialized fails right there); the
writer process copies it to ``.NAME.partial`` and fsyncs it; finalize renames it to NAME, then
writes the sidecar manifest ``NAME.nvrx.json`` that marks it complete. ``torch.load(NAME)`` reads it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from nvrx.ckpt import manifest as manifest_mod
from nvrx.ckpt import fence, publish
from nvrx.ckpt.async_ckpt.core import AsyncRequest, WriterJob
from nvrx.ckpt.async_ckpt.staging import default_file_pool
from nvrx.ckpt.errors import CheckpointError, CheckpointWriteError


def torch_save_request(obj: Any, path: str | os.PathLike, *, update_latest: bool = False,
                       save_kwargs: dict[str, Any] | None = None) -> AsyncRequest:
    """Serialize OBJ now (``torch.save`` with SAVE_KWARGS) and return the request that writes and publishes it at PATH."""
    import torch

    final = Path(os.path.abspath(path))
    publish.check_destination(final)
    partial = publish.partial_path(final)
    pool = default_file_pool()
    staged = pool.acquire()
    try:
        torch.save(obj, staged, **(save_kwargs or {}))
    except Exception as exc:
        pool.release(staged)
        raise CheckpointError(f"cannot save {final}: the object cannot be serialised ({type(exc).__name__}: {exc}); "
                              "store tensors or plain Python values") from None
    reply: dict[str, Any] = {}
    sidecar = manifest_mod.sidecar_path(final)

    def record(result: dict[str, Any]) -> None:
        reply.update(result["files"][0])

    def finalize() -> None:
        try:
            fence.check_publish(final.parent, final.name)  # a round the job has left publishes nothing
            sidecar.unlink(missing_ok=True)  # an older sidecar must never vouch for the new data
            publish.publish_file(partial, final)
            entry = {"format": manifest_mod.FORMAT, "kind": "torch_save", "name": final.name, "size": reply["size"],
                     "digest": reply["digest"], "published_at_ns": time.time_ns(), **fence.stamp()}
            publish.atomic_write(sidecar, manifest_mod.encode(entry))
            fence.check_published(final.parent, final.name, entry, final, sidecar)  # (a new round looked meanwhile)
        except OSError as exc:
            raise CheckpointWriteError(f"checkpoint {final} was not published: {exc}") from None
        finally:
            pool.release(staged)
        if update_latest:
            try:
                publish.update_latest(final.parent, final.name)
            except OSError as exc:
                raise publish.cleanup_error(final, "updating the `latest` pointer", exc) from None

    def discard(remove_files: bool) -> None:
        pool.release(staged)
        if remove_files:
            partial.unlink(missing_ok=True)

    job = {"op": "copy", "path": str(partial), "nbytes": staged.pos, "fsync": True}
    save_fn = WriterJob(job=job, fd=staged.fd, on_result=record, on_discard=discard, description=str(final),
                        destination=str(final))
    return AsyncRequest(save_fn, (), [finalize])
