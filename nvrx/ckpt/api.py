"""The short user API: ``async_save`` / ``maybe_finalize`` / ``wait`` on top of the three-stage save.

A typical training loop (every rank runs the same calls)::

    from nvrx import ckpt
    from nvrx.launcher.rank import job_control
    info = ckpt.resume("ckpts", state)            # newest complete checkpoint, verified (None: fresh start);
                                                 # also reserves staging memory, so even the first save is warm,
                                                 # and removes unfinished checkpoints of crashed saves
    # (no resume? nvrx.ckpt.configure(state_dict=state) or nvrx.ckpt.prepare(state) reserves the staging memory)
    for step in range(start, total):
        train_step()
        ckpt.maybe_finalize()                    # cheap; publishes saves whose writes are durable
        if step % 100 == 0:
            ckpt.async_save(state, f"ckpts/step_{step:07d}")   # blocks only for the copy
        if job_control.should_stop(step):        # SIGTERM / preemption: the step all ranks agreed on
            ckpt.async_save(state, f"ckpts/step_{step:07d}")
            ckpt.finalize_before_exit()          # every pending save published, writer stopped
            break
    ckpt.finalize_before_exit()
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from nvrx.common.checkpoint_report import report_checkpoint
from nvrx.ckpt import auto_reserve, publish
from nvrx.ckpt.async_ckpt.core import AsyncCallsQueue
from nvrx.ckpt.async_ckpt.dist_wrapper import DistWrapper
from nvrx.ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvrx.ckpt.async_ckpt.state_dict_saver import CheckpointMetadataCache, async_request, save_state_dict_async_plan
from nvrx.ckpt.async_ckpt.staging import align, default_pool
from nvrx.ckpt.async_ckpt.writer_process import WriterProcess
from nvrx.ckpt.errors import CheckpointWriteError
from nvrx.ckpt.loader import CheckpointInfo, load_latest, load_metadata
from nvrx.ckpt.snapshot import Snapshot
from nvrx.ckpt.torch_save_async import torch_save_request

log = logging.getLogger("nvrx.ckpt")


class AsyncCheckpointer:
    """Asynchronous checkpoints of one training process: a queue on the persistent writer and a plan cache.

    PROCESS_GROUP: the (CPU/gloo) group that saves together (default: the world). FILES_PER_RANK:
    files each rank writes in parallel. KEEP_LAST: older complete checkpoints kept next to a new one
    (None keeps all). RETRIES / SKIP_FAILED: what a failed write does (see ``AsyncCallsQueue``).
    OVERLAP_WRITE: let the writer start on the first items while later ones are still being copied
    (time to durable ~ max(copy, write) instead of their sum). Off by default: without a spare core the
    writer slows the copy, which is the part that blocks training (measured in bench/README.md).
    STATE_DICT: the state that will be saved, if known now: its staging memory is reserved and faulted in
    on a background thread at once (see ``prepare``), so the first save costs what later ones do.
    STALE_PARTIAL_SECONDS: on ``resume`` and on the first save into a directory, unfinished checkpoints
    (``.NAME.partial``) left by crashed saves are removed: at once when the process that wrote one is
    known to be gone, else after this long without a change (None: never).
    RESERVE_AFTER_FIRST_STEP: for a state nobody announced (no STATE_DICT, ``prepare`` or ``resume``): after the
    first step of each optimizer in the process, reserve staging memory for its parameters and state (plus a
    small slack) in the background, so the first save is warm too (``nvrx.ckpt.auto_reserve``; once per process).
    False: never in this process (for a caller that reserves staging itself, e.g. at its first step).
    """

    def __init__(self, *, process_group: Any = None, files_per_rank: int = 2, keep_last: int | None = None,
                 enable_cache: bool = True, retries: int = 0, skip_failed: bool = False, overlap_write: bool = False,
                 writer: WriterProcess | None = None, state_dict: dict[str, Any] | None = None,
                 stale_partial_seconds: float | None = publish.STALE_PARTIAL_SECONDS,
                 reserve_after_first_step: bool = True) -> None:
        self.process_group = process_group
        self.files_per_rank = files_per_rank
        self.keep_last = keep_last
        self.enable_cache = enable_cache
        self.overlap_write = overlap_write
        self.stale_partial_seconds = stale_partial_seconds
        self.cache = CheckpointMetadataCache()
        self.queue = AsyncCallsQueue(writer=writer, retries=retries, skip_failed=skip_failed)
        self._swept: set[Path] = set()  # checkpoint roots already cleared of crashed saves' partials
        if state_dict is not None:
            self.prepare(state_dict)
        elif reserve_after_first_step:
            auto_reserve.arm()
        else:
            auto_reserve.disarm()

    def async_save(self, state_dict: dict[str, Any], path: str | os.PathLike, *, update_latest: bool = True,
                   snapshot: Snapshot | None = None, staging_error: str | None = None, step: int | None = None,
                   taken: float | None = None) -> int:
        """Save STATE_DICT as a DCP checkpoint directory PATH; returns once the values are copied (collective).

        SNAPSHOT: STATE_DICT was captured by ``nvrx.ckpt.snapshot.capture`` (its tensors already lie in staging memory,
        which this save takes over: nothing is copied again). STAGING_ERROR: the capture failed on this rank;
        every rank abandons this save and raises the reason. STEP: the training step the state holds (default: the
        number ending PATH's name, e.g. ``step_0000100``), TAKEN: when the state was taken (default now); once the
        checkpoint is published both go to the rank's monitor (``report_checkpoint``), for `nvrx inspect`'s goodput.
        """
        taken = time.time() if taken is None else taken
        auto_reserve.settle()  # (the pool now holds what this save takes: no later reservation helps)
        if snapshot is None and not default_pool().buffers:
            log.info("first save without reserved staging memory: this save faults it in while training "
                     "waits (several times a later save); ckpt.resume(root, state) or ckpt.prepare(state) at "
                     "start reserves it in the background")
        try:
            self._refuse_pending(path)
            final = Path(os.path.abspath(path))
            if final.parent not in self._swept:  # once per directory: later partials there are this checkpointer's own
                self._sweep(final.parent, saving=final)
            writer = FileSystemWriterAsync(path, files_per_rank=self.files_per_rank, keep_last=self.keep_last,
                                           update_latest=update_latest,
                                           writer_process=self.queue.writer if self.overlap_write else None,
                                           staging_pool=snapshot.pool if snapshot else None)
        except BaseException:
            if snapshot is not None:
                snapshot.release()
            raise
        if snapshot is not None:
            writer.staged_in, writer.staged_used = snapshot.buffer, snapshot.used
        writer.staging_error = staging_error
        try:
            planned = save_state_dict_async_plan(state_dict, writer, self.process_group,
                                                 enable_cache=self.enable_cache, metadata_cache=self.cache)
        finally:
            writer.drop_staged()  # planning failed before staging took the snapshot's buffer: give it back
        request = async_request(*planned)
        # after the save's own finalize, which raises unless the checkpoint was published: complete on every rank
        request.add_finalize_fn(functools.partial(report_checkpoint, step_of(final) if step is None else step,
                                                  "global", taken=taken, path=str(final)))
        return self.queue.schedule_async_request(request)

    def async_torch_save(self, obj: Any, path: str | os.PathLike, *, update_latest: bool = False) -> int:
        """``torch.save(obj, path)`` in the background, for state of this process only (not collective)."""
        self._refuse_pending(path)
        return self.queue.schedule_async_request(torch_save_request(obj, path, update_latest=update_latest))

    def _refuse_pending(self, path: str | os.PathLike) -> None:
        if os.path.abspath(path) in self.queue.pending_destinations():
            raise CheckpointWriteError(f"a save to {os.path.abspath(path)} is still pending; call wait() first "
                                       "or save to another path")

    def maybe_finalize(self) -> list[int]:
        """Publish the saves that are durable on every rank, without waiting (collective while saves are pending)."""
        return self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> list[int]:
        """Wait until every pending save is published (or raise the reason it was not)."""
        return self.queue.maybe_finalize_async_calls(blocking=True)

    @property
    def pending(self) -> int:
        return self.queue.get_num_unfinalized_calls()

    def prepare(self, state_dict: dict[str, Any]) -> int:
        """Reserve staging memory for saves of STATE_DICT now, faulted in on a background thread (not collective).

        Without it the first save pays for fresh memory (page faults: about as long as a clone of
        the state); after it the first save is a plain copy like every later one. Returns the bytes reserved.
        """
        nbytes = staging_bytes(state_dict)
        default_pool().reserve(nbytes)
        return nbytes

    def resume(self, root: str | os.PathLike, state_dict: dict[str, Any], verify: str | None = "full") -> CheckpointInfo | None:
        """Load the newest complete checkpoint under ROOT into STATE_DICT, seed the plan cache, prepare staging."""
        info = load_latest(root, state_dict, process_group=self.process_group, verify=verify)
        self.sweep(root)
        if info is not None and self.enable_cache:
            self.cache.set_cached_global_metadata(load_metadata(info.path))
        self.prepare(state_dict)
        return info

    def sweep(self, root: str | os.PathLike) -> list[str]:
        """Remove unfinished checkpoints of crashed saves under ROOT (coordinator only; see STALE_PARTIAL_SECONDS).

        Saves still pending in this checkpointer are kept; returns the names removed (empty on other ranks).
        """
        return self._sweep(Path(os.path.abspath(root)))

    def _sweep(self, root: Path, saving: Path | None = None) -> list[str]:
        """``sweep`` of ROOT (absolute); SAVING: a save starting now, whose partial other ranks may already use."""
        self._swept.add(root)
        if self.stale_partial_seconds is None or not DistWrapper(self.process_group).is_coordinator:
            return []
        mine = {Path(d) for d in self.queue.pending_destinations()} | ({saving} if saving else set())
        keep = {publish.partial_path(d).name for d in mine if d.parent == root}
        return publish.sweep_stale_partials(root, keep=keep, idle_seconds=self.stale_partial_seconds)

    def finalize_before_exit(self) -> None:
        """Publish every pending save, then stop the writer process. Call it before the process exits."""
        self.queue.close(stop_writer=True)

    def close(self) -> None:
        self.queue.close()


_TRAILING_NUMBER = re.compile(r"(\d+)$")


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory's name ends with (``step_0000100`` -> 100; ``final`` -> None)."""
    m = _TRAILING_NUMBER.search(path.name)
    return int(m.group(1)) if m else None


def staging_bytes(obj: Any) -> int:
    """An upper bound of the staging memory one rank needs to save OBJ (its local tensor data, aligned)."""
    import torch

    if isinstance(obj, dict):
        return sum(staging_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(staging_bytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        if hasattr(local, "local_shards"):
            return sum(align(s.tensor.numel() * s.tensor.element_size()) for s in local.local_shards())
        return align(local.numel() * local.element_size())
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        return staging_bytes(obj.state_dict())
    return 4096  # a non-tensor value: serialized, usually small


_default: AsyncCheckpointer | None = None


def configure(**options: Any) -> AsyncCheckpointer:
    """Replace the process-wide checkpointer (options of ``AsyncCheckpointer``); pending saves are finalized first."""
    global _default
    if _default is not None and _default.pending:
        _default.wait()
    _default = AsyncCheckpointer(**options)
    return _default


def checkpointer() -> AsyncCheckpointer:
    """The process-wide checkpointer used by the module-level functions."""
    global _default
    if _default is None:
        _default = AsyncCheckpointer()
    return _default


def async_save(state_dict: dict[str, Any], path: str | os.PathLike, **kw: Any) -> int:
    return checkpointer().async_save(state_dict, path, **kw)


def async_torch_save(obj: Any, path: str | os.PathLike, **kw: Any) -> int:
    return checkpointer().async_torch_save(obj, path, **kw)


def maybe_finalize() -> list[int]:
    return [] if _default is None else _default.maybe_finalize()


def wait() -> list[int]:
    return [] if _default is None else _default.wait()


def prepare(state_dict: dict[str, Any]) -> int:
    return checkpointer().prepare(state_dict)


def resume(root: str | os.PathLike, state_dict: dict[str, Any], verify: str | None = "full") -> CheckpointInfo | None:
    return checkpointer().resume(root, state_dict, verify=verify)


def finalize_before_exit() -> None:
    """Graceful stop: publish pending saves and stop the writer (no-op when nothing was saved)."""
    global _default
    from nvrx.ckpt import jit

    jit.disarm_module_level()  # training is over: nothing to save on a failure from here on
    if _default is not None:
        try:
            _default.finalize_before_exit()
        finally:
            _default = None
