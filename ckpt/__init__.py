"""Asynchronous checkpointing in the torch.distributed.checkpoint (DCP) format.

User API (module-level functions act on one process-wide ``AsyncCheckpointer``)::

    ckpt.async_save(state_dict, "ckpts/step_100")   # returns after the copy; writes in the background
    ckpt.maybe_finalize()                           # each step: publish saves that are durable on all ranks
    ckpt.wait()                                     # block until every pending save is published
    ckpt.async_torch_save(obj, "rng_rank0.pt")      # torch.save-style, for non-distributed state
    ckpt.resume("ckpts", state_dict)                # load the newest complete, verified checkpoint
    ckpt.prepare(state_dict)                        # (resume does it) reserve staging: the first save is warm
    ckpt.finalize_before_exit()                     # graceful stop: publish pending saves, stop the writer

    saver = ckpt.PeriodicCheckpointer("ckpts", model=model, optimizer=opt, every_steps=10)
    start = saver.resume()                          # the newest complete checkpoint (0: fresh start)
    saver.step(step)                                # once per step: saves when due, publishes in the background

The spec's layers are in ``ckpt.async_ckpt`` (``state_dict_saver``, ``filesystem_async``, ``core``).
Names are imported lazily: importing ``ckpt`` (as the rank bootstrap does) does not import torch.
"""

from __future__ import annotations

from nvrx_common.lazy import lazy_getattr

_EXPORTS = {
    "AsyncCheckpointer": "ckpt.api", "configure": "ckpt.api", "checkpointer": "ckpt.api", "async_save": "ckpt.api",
    "async_torch_save": "ckpt.api", "maybe_finalize": "ckpt.api", "wait": "ckpt.api", "resume": "ckpt.api",
    "finalize_before_exit": "ckpt.api", "prepare": "ckpt.api", "PeriodicCheckpointer": "ckpt.periodic",
    "CheckpointInfo": "ckpt.loader", "list_checkpoints": "ckpt.loader", "find_latest_checkpoint": "ckpt.loader",
    "verify_checkpoint": "ckpt.loader", "load_latest": "ckpt.loader", "load_metadata": "ckpt.loader",
    "CheckpointError": "ckpt.errors", "CheckpointWriteError": "ckpt.errors", "CheckpointCleanupError": "ckpt.errors",
    "start_persistent_writer": "ckpt.async_ckpt.writer_process",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
