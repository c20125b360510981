"""Asynchronous checkpointing in the torch.distributed.checkpoint (DCP) format.

User API (module-level functions act on one process-wide ``AsyncCheckpointer``)::

    nvrx.ckpt.async_save(state_dict, "ckpts/step_100")   # returns after the copy; writes in the background
    nvrx.ckpt.maybe_finalize()                           # each step: publish saves that are durable on all ranks
    nvrx.ckpt.wait()                                     # block until every pending save is published
    nvrx.ckpt.async_torch_save(obj, "rng_rank0.pt")      # torch.save-style, for non-distributed state
    nvrx.ckpt.resume("ckpts", state_dict)                # load the newest complete, verified checkpoint
    nvrx.ckpt.prepare(state_dict)                        # (resume does it) reserve staging: the first save is warm
    nvrx.ckpt.finalize_before_exit()                     # graceful stop: publish pending saves, stop the writer
    nvrx.ckpt.save_on_failure("ckpts", optimizer=opt, state_fn=fn, steps_done=start)  # nvrx launch --jit-ckpt

    saver = ckpt.PeriodicCheckpointer("ckpts", model=model, optimizer=opt, every_steps=10)
    start = saver.resume()                          # the newest complete checkpoint (0: fresh start)
    saver.step(step)                                # once per step: saves when due, publishes in the background

The spec's layers are in ``nvrx.ckpt.async_ckpt`` (``state_dict_saver``, ``filesystem_async``, ``core``).
Names are imported lazily: importing ``nvrx.ckpt`` (as the rank bootstrap does) does not import torch.
"""

from __future__ import annotations

from nvrx.common.lazy import lazy_getattr

_EXPORTS = {
    "AsyncCheckpointer": "nvrx.ckpt.api", "configure": "nvrx.ckpt.api", "checkpointer": "nvrx.ckpt.api", "async_save": "nvrx.ckpt.api",
    "async_torch_save": "nvrx.ckpt.api", "maybe_finalize": "nvrx.ckpt.api", "wait": "nvrx.ckpt.api", "resume": "nvrx.ckpt.api",
    "finalize_before_exit": "nvrx.ckpt.api", "prepare": "nvrx.ckpt.api", "PeriodicCheckpointer": "nvrx.ckpt.periodic",
    "CheckpointInfo": "nvrx.ckpt.loader", "list_checkpoints": "nvrx.ckpt.loader", "find_latest_checkpoint": "nvrx.ckpt.loader",
    "verify_checkpoint": "nvrx.ckpt.loader", "load_latest": "nvrx.ckpt.loader", "load_metadata": "nvrx.ckpt.loader",
    "CheckpointError": "nvrx.ckpt.errors", "CheckpointWriteError": "nvrx.ckpt.errors", "CheckpointCleanupError": "nvrx.ckpt.errors",
    "start_persistent_writer": "nvrx.ckpt.async_ckpt.writer_process",
    "report_checkpoint": "nvrx.common.checkpoint_report", "save_on_failure": "nvrx.ckpt.jit",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
