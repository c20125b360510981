"""``FileSystemWriterAsync``: a DCP storage writer whose writes happen in the persistent writer process.

The training process only copies the data it must save into a staging buffer (``prepare_write_data``);
the writer process turns the buffer into ``.distcp`` files (``files_per_rank`` per rank, written in
parallel, fsynced) and reports offsets, sizes and checksums. The coordinator's ``finish`` writes
the DCP ``.metadata`` and the manifest, and publishes the directory (see ``nvrx.ckpt.publish``): the
files are plain DCP, readable by ``torch.distributed.checkpoint.load`` into any world size.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import pickle
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from nvrx.ckpt import manifest as manifest_mod
from nvrx.ckpt import fence, publish
from nvrx.ckpt.async_ckpt import plan_codec
from nvrx.ckpt.async_ckpt.staging import StagingBuffer, StagingPool, align, default_pool
from nvrx.ckpt.errors import CheckpointError

log = logging.getLogger("nvrx.ckpt.writer")

DCP_VERSION = "1.0.0"
_METADATA = ".metadata"
_PROGRESS_STEP = 32 << 20  # staged bytes between progress messages to the writer
_SUFFIX = ".distcp"


def _item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    numel = 1
    for s in td.chunk.sizes:
        numel *= s
    return numel * torch._utils._element_size(td.properties.dtype)


def _split(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over BINS files: byte items round-robin, tensors (largest first) to the lightest file."""
    bins = max(1, min(bins, len(items)))
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    loads = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True)
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in tensors:
        k = loads.index(min(loads))
        buckets[k].append(item)
        loads[k] += _item_nbytes(item)
    return [b for b in buckets if b]


# torch FileSystemWriter's positional parameters after PATH, in its order (NVRx passes *args on to it)
_TORCH_WRITER_PARAMS = ("single_file_per_rank", "sync_files", "thread_count", "per_thread_copy_ahead",
                        "cache_staged_state_dict", "overwrite")


class FileSystemWriterAsync(StorageWriter):
    """Write a DCP checkpoint directory through the writer process; publish it crash-safely.

    PATH is the checkpoint directory (its parent holds ``latest`` and older checkpoints).
    FILES_PER_RANK: files each rank writes, in parallel (default 2; NVRx's THREAD_COUNT, default 1, sets it
    when given). SYNC_FILES: fsync every file (the default). OVERWRITE=False refuses an existing PATH.
    KEEP_LAST: after a successful publish, delete older complete checkpoints in the same parent beyond this
    many (None keeps all). UPDATE_LATEST: point ``<parent>/latest`` at this one.
    WRITER_PROCESS (optional): submit the job before copying, so the writer starts on the first items
    while later ones are still being copied (the queue must use that same writer process).

    NVRx's other options are accepted so its calls work: SINGLE_FILE_PER_RANK must stay True (as in NVRx);
    USE_MSC (object storage) is refused with the reason; SEPARATION_HINT, IS_MULTIPROC_IO,
    USE_CACHED_DATA_STRUCTURE, PER_THREAD_COPY_AHEAD, CACHE_STAGED_STATE_DICT and USE_CPU_SHM_FOR_GPU_TENSORS
    tune NVRx's own worker and GPU staging; here the writer process, its threads and the memfd staging
    always work one way (docs/porting.md lists the differences).
    """

    can_run_decentralized_global_plan: bool = False  # plans are gathered as JSON by the coordinator

    def __init__(self, path: str | os.PathLike, *args: Any, separation_hint: str | None = None, use_msc: bool = False,
                 is_multiproc_io: bool = False, use_cached_data_structure: bool = False,
                 use_cpu_shm_for_gpu_tensors: bool = False, files_per_rank: int | None = None,
                 keep_last: int | None = None, update_latest: bool = True, staging_pool: StagingPool | None = None,
                 writer_process: Any = None, **kwargs: Any) -> None:
        super().__init__()
        torch_args = _torch_writer_args(args, kwargs)
        if not torch_args.get("single_file_per_rank", True):
            raise NotImplementedError("FileSystemWriterAsync writes per rank (single_file_per_rank=True); "
                                      "for one file per tensor use torch.distributed.checkpoint.FileSystemWriter")
        if use_msc:
            raise CheckpointError("use_msc (multi-storage client, object storage) is not supported: save to a "
                                  "mounted file system path")
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least the checkpoint just written (1 or more), or None")
        thread_count = torch_args.get("thread_count")
        if files_per_rank is None:
            files_per_rank = 2 if thread_count is None else int(thread_count)
        if separation_hint is not None:
            log.info("separation_hint=%r: items are spread over the %d file(s) per rank by size, not by key",
                     separation_hint, files_per_rank)
        if use_cpu_shm_for_gpu_tensors:
            log.info("use_cpu_shm_for_gpu_tensors: staging is always in shared memory; the GPU part needs a GPU")
        self.path = Path(os.path.abspath(path))
        self.files_per_rank = max(1, int(files_per_rank))
        self.thread_count = self.files_per_rank
        self.sync_files = bool(torch_args.get("sync_files", True))
        self.overwrite = bool(torch_args.get("overwrite", True))
        self.separation_hint = separation_hint
        self.is_multiproc_io = is_multiproc_io
        self.use_cached_data_structure = use_cached_data_structure
        self.keep_last = keep_last
        self.update_latest = update_latest
        self.pool = staging_pool or default_pool()
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.dist_wrapper: Any = None  # set by save_state_dict_async_plan: the ranks that save together
        self._objects: dict[str, bytes] = {}
        self._buffer: StagingBuffer | None = None
        self._job: dict[str, Any] | None = None
        self._layout: list[list[tuple[WriteItem, str]]] = []
        self._reply: dict[str, Any] | None = None
        self._failure: str | None = None
        self.write_seconds = 0.0  # how long the writer process took for this rank's files
        # Given a WriterProcess, the job is submitted before the copy and writing overlaps staging (the
        # AsyncCallsQueue using this writer then must use the same process); without one, at schedule time.
        self.writer_process = writer_process
        self._job_id = 0
        # A staging buffer already holding the tensors to save (``nvrx.ckpt.snapshot``): items found in it are written
        # from where they lie; STAGED_USED: where its tensors end (serialized values go behind them).
        self.staged_in: StagingBuffer | None = None
        self.staged_used = 0
        self.staging_error: str | None = None  # staging failed before this save started (the capture): say so

    # ------------------------------------------------------------ StorageWriter interface

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(os.path.abspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex
        self._objects.clear()
        self._reply = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    @property
    def partial_path(self) -> Path:
        return publish.partial_path(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        publish.check_destination(self.path)
        if not self.overwrite and self.path.exists():
            raise CheckpointError(f"cannot save checkpoint {self.path}: it exists and overwrite=False")
        try:
            self.partial_path.mkdir(mode=0o700, exist_ok=True)  # private: loads unpickle from it
        except OSError as exc:
            raise CheckpointError(f"cannot save checkpoint {self.path}: cannot create {self.partial_path} "
                                  f"({exc.strerror})") from None
        if self.is_coordinator:
            publish.write_owner(self.partial_path)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        import dataclasses

        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        raise CheckpointError("FileSystemWriterAsync writes through ckpt.async_save or save_state_dict_async_plan; "
                              "for a blocking save use torch.distributed.checkpoint.FileSystemWriter")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        raise CheckpointError("FileSystemWriterAsync is finalized by save_state_dict_async_finalize")

    # ------------------------------------------------------------ staging (blocks the caller)

    def serialize_objects(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Serialize every non-tensor value now: the checkpoint keeps the values of the save call."""
        self._objects.clear()
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                self._serialize(item, planner)

    def _serialize(self, item: WriteItem, planner: SavePlanner) -> None:
        try:
            data = planner.resolve_data(item)
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        except Exception as exc:
            value = type(_lookup(planner, item)).__name__
            raise CheckpointError(f"cannot save {item.index.fqn!r}: its {value} value cannot be serialised "
                                  f"({exc}); store tensors or plain Python values, or leave it out of the state dict") from None
        self._objects[item.index.fqn] = raw

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Copy this rank's share of the checkpoint into a staging buffer and describe the files to write."""
        if plan.storage_data is None:
            raise CheckpointError("the final save plan has no storage prefix; plan with save_state_dict_async_plan")
        prefix = plan.storage_data.prefix
        buckets = _split(plan.items, self.files_per_rank)
        files: list[dict[str, Any]] = [{"name": f"{prefix}{n}{_SUFFIX}", "items": []} for n in range(len(buckets))]
        layout: list[list[tuple[WriteItem, str]]] = [[] for _ in buckets]
        order: list[tuple[dict[str, Any], WriteItem, str]] = []  # staging order = offset order
        offset = 0
        for rank_in_file in range(max((len(b) for b in buckets), default=0)):
            for n, bucket in enumerate(buckets):  # interleaved: every file can be written while later items are copied
                if rank_in_file >= len(bucket):
                    continue
                item = bucket[rank_in_file]
                if item.type == WriteItemType.BYTE_IO:
                    if item.index.fqn not in self._objects:
                        self._serialize(item, planner)
                    nbytes = len(self._objects[item.index.fqn])
                    entry: dict[str, Any] = {"kind": "bytes", "off": offset, "nbytes": nbytes}
                    kind = "bytes"
                else:
                    nbytes = _item_nbytes(item)
                    props = item.tensor_data.properties  # type: ignore[union-attr]
                    entry = {"kind": "tensor", "off": offset, "nbytes": nbytes, "dtype": plan_codec._name(props.dtype),
                             "shape": list(item.tensor_data.chunk.sizes)}  # type: ignore[union-attr]
                    kind = "tensor"
                files[n]["items"].append(entry)
                layout[n].append((item, kind))
                order.append((entry, item, kind))
                offset = align(offset + nbytes)
        if self.staging_error is not None:
            raise CheckpointError(self.staging_error)
        if self.staged_in is not None:
            if self._place_in_staged(order, planner):
                self._finish_in_place(files, layout, order)
                return
            log.debug("%s: the snapshot's layout does not hold; copying it once more", self.path)
        buffer = self.pool.acquire(offset, populate=False)  # (a new one is filled by fill(): pwrite + populating lanes)
        job = {"op": "write", "dir": str(self.partial_path), "files": files, "fsync": self.sync_files}
        job_id = self._submit_early(job, buffer)
        try:
            if job_id:  # the writer reads behind the copy: item by item, reporting progress
                job_id = self._copy_reporting(buffer, order, planner, job_id, offset)
            else:  # nobody reads the buffer before it is full: one fill (a new buffer by several threads)
                buffer.fill([(entry["off"], self._item_data(planner, item, kind)) for entry, item, kind in order])
        except BaseException as exc:
            self._abort_job(job_id, f"{type(exc).__name__}: {exc}")
            self.pool.release(buffer)
            self.drop_staged()
            raise
        self._objects.clear()
        self._buffer, self._layout, self._reply, self._job_id = buffer, layout, None, job_id
        self._job = job
        self.drop_staged()

    def _item_data(self, planner: SavePlanner, item: WriteItem, kind: str) -> Any:
        """What ITEM stages: its serialized bytes, or its tensor (checked against the plan)."""
        return self._objects[item.index.fqn] if kind == "bytes" else _resolved_tensor(planner, item)

    def _copy_reporting(self, buffer: Any, order: list[Any], planner: SavePlanner, job_id: int, total: int) -> int:
        """Copy ORDER's items into BUFFER while the writer already runs JOB_ID, telling it how far the copy got
        (every _PROGRESS_STEP bytes, then TOTAL); returns the job id (0 once the writer dropped the job)."""
        reported = 0
        for entry, item, kind in order:
            data = self._item_data(planner, item, kind)
            if kind == "bytes":
                buffer.copy_bytes(entry["off"], data)
            else:
                buffer.copy_tensor(entry["off"], data)
            end = entry["off"] + entry["nbytes"]
            if job_id and end - reported >= _PROGRESS_STEP:
                job_id = self._report(job_id, end)
                reported = end
        return self._report(job_id, total) if job_id else job_id

    def _offset_in_staged(self, tensor: Any) -> int | None:
        """Where TENSOR's bytes lie in the staged buffer, or None if it is not a contiguous CPU view of it."""
        buffer = self.staged_in
        assert buffer is not None
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        base = buffer.bytes_view().data_ptr()
        start = tensor.data_ptr() - base
        if start < 0 or start + tensor.numel() * tensor.element_size() > buffer.capacity:
            return None
        return start

    def _place_in_staged(self, order: list[tuple[dict[str, Any], WriteItem, str]], planner: SavePlanner) -> bool:
        """Point every item at its bytes in the staged buffer (values serialized behind the tensors); False if one is not there."""
        assert self.staged_in is not None
        offsets: list[int] = []
        tail = align(self.staged_used)
        for entry, item, kind in order:
            if kind == "bytes":
                offsets.append(tail)
                tail = align(tail + entry["nbytes"])
                continue
            tensor = planner.resolve_data(item)
            _check_tensor(item, tensor)
            where = self._offset_in_staged(tensor)
            if where is None:
                return False
            offsets.append(where)
        if tail > self.staged_in.capacity:
            return False
        for (entry, _, _), off in zip(order, offsets):
            entry["off"] = off
        return True

    def _finish_in_place(self, files: list[dict[str, Any]], layout: list[list[tuple[WriteItem, str]]],
                         order: list[tuple[dict[str, Any], WriteItem, str]]) -> None:
        """The tensors already lie in the staged buffer: copy the serialized values behind them; that buffer is this save's."""
        buffer = self.staged_in
        assert buffer is not None
        for entry, item, kind in order:
            if kind == "bytes":
                buffer.copy_bytes(entry["off"], self._objects[item.index.fqn])
        self._objects.clear()
        job = {"op": "write", "dir": str(self.partial_path), "files": files, "fsync": self.sync_files}
        self._buffer, self._layout, self._reply, self._job_id, self._job = buffer, layout, None, 0, job
        self.staged_in = None

    def drop_staged(self) -> None:
        """A staged buffer not used by this save (its layout did not hold, or the save failed) goes back to its pool."""
        if self.staged_in is not None:
            self.pool.release(self.staged_in)
            self.staged_in = None

    def _submit_early(self, job: dict[str, Any], buffer: StagingBuffer) -> int:
        """Hand the job to the writer before copying, so writing overlaps staging (0: submit later instead).

        Not into a fresh buffer: its first copy allocates memory page by page, and a writer filling the
        page cache at the same time makes that (the blocking part) slower still.
        """
        if self.writer_process is None or buffer.fresh:
            return 0
        try:
            return self.writer_process.submit(dict(job, progressive=True), buffer=buffer)
        except RuntimeError as exc:
            log.debug("early submission failed (%s); the job is submitted after staging", exc)
            return 0

    def _abort_job(self, job_id: int, reason: str) -> None:
        """Stop a job submitted before staging finished, and wait until the writer no longer writes its files."""
        if job_id and self.writer_process is not None:
            self.writer_process.abort(job_id, reason)

    def abandon_staging(self, reason: str) -> None:
        """Drop what this rank staged because the save is abandoned (staging failed on some rank).

        The job the writer may already be running (overlap_write) is stopped before this returns, so
        the coordinator can remove the unpublished directory once every rank has been through here.
        """
        self._abort_job(self._job_id, reason)
        self.release_staging()
        self.drop_staged()

    def _report(self, job_id: int, upto: int) -> int:
        try:
            self.writer_process.staged(job_id, upto)  # type: ignore[union-attr]
            return job_id
        except RuntimeError:  # the writer died: its job fails; the queue reports or retries it
            return job_id

    # ------------------------------------------------------------ the write stage (writer process)

    def write_job(self) -> tuple[dict[str, Any], StagingBuffer, int]:
        """The job for the writer process, the buffer it reads, and its id if already submitted (else 0)."""
        if self._job is None or self._buffer is None:
            raise CheckpointError("nothing staged: call save_state_dict_async_plan first")
        return self._job, self._buffer, self._job_id

    def get_save_function_and_args(self) -> tuple[Any, Any, list[Any]]:
        """``(save_fn, preload_fn, save_args)`` for ``AsyncRequest(save_fn, save_args, [finalize], preload_fn=...)``.

        SAVE_FN is a ``WriterJob``: the queue runs it on the persistent writer process (calling it writes now
        and waits). PRELOAD_FN returns the write plan (files, items, offsets) that takes the ``None`` in
        SAVE_ARGS = ``[rank, None]``: the data itself was already copied into staging memory by
        ``save_state_dict_async_plan``, so training may change the tensors as soon as that returns.
        """
        from nvrx.ckpt.async_ckpt.core import WriterJob

        job, buffer, job_id = self.write_job()
        save_fn = WriterJob(job=job, buffer=buffer, job_id=job_id, submitted_to=self.writer_process if job_id else None,
                            dist_wrapper=self.dist_wrapper, on_result=self.record_reply, on_failure=self.record_failure,
                            on_discard=self._discard, description=str(self.path), destination=str(self.path))
        return save_fn, self.preload_staged, [self.rank, None]

    def preload_staged(self) -> dict[str, Any]:
        """The staged write plan: the files this rank writes and where each item lies in the staging buffer."""
        return self.write_job()[0]

    def _discard(self, remove_files: bool) -> None:
        """The save is dropped: free the staging; the coordinator removes the unpublished directory."""
        self.release_staging()
        if remove_files and self.is_coordinator:
            self.discard_partial()

    def record_reply(self, reply: dict[str, Any]) -> None:
        """Keep the writer process's successful answer (file sizes, item offsets and checksums)."""
        self._reply, self._failure = reply, None
        self.write_seconds = float(reply.get("seconds", 0.0))

    def record_failure(self, error: str) -> None:
        """Keep why this rank's write failed; finalize reports it on every rank."""
        self._reply, self._failure = None, error

    def release_staging(self) -> None:
        """This save is over (published or dropped): free its staging buffer and forget its results."""
        if self._buffer is not None:
            self.pool.release(self._buffer)
        self._buffer, self._job, self._reply, self._layout, self._job_id = None, None, None, [], 0
        self._failure = None

    def local_results(self) -> dict[str, Any]:
        """This rank's write results as JSON (sent to the coordinator at finalize)."""
        if self._failure is not None:
            raise CheckpointError(f"rank {self.rank}: writing failed: {self._failure}")
        if self._reply is None:
            raise CheckpointError(f"checkpoint {self.path}: the write stage has not completed on rank {self.rank}")
        files, results = [], []
        for spec, placed in zip(self._reply["files"], self._layout):
            files.append({"name": spec["name"], "size": spec["size"]})
            for (item, kind), res in zip(placed, spec["items"]):
                wr = WriteResult(index=item.index, size_in_bytes=res["length"],
                                 storage_data=_storage_info(spec["name"], res["offset"], res["length"]))
                results.append(plan_codec.encode_write_result(wr, res["crc32"], kind))
        return {"files": files, "results": results}

    def retrieve_write_results(self) -> list[WriteResult] | Any:
        """This rank's ``WriteResult`` list; if the write failed or has not completed, the wrapped error instead.

        Like NVRx's, it returns rather than raises (torch's ``(exception, traceback)`` pair), so a finalize
        can gather every rank's outcome before one of them gives up.
        """
        from torch.distributed.checkpoint.utils import _wrap_exception

        try:
            results = self.local_results()["results"]
        except CheckpointError as exc:
            return _wrap_exception(exc)
        return [plan_codec.decode_write_result(r) for r in results]

    # ------------------------------------------------------------ finalize (coordinator)

    def finish_from_ranks(self, metadata: Metadata, per_rank: list[dict[str, Any]]) -> None:
        """Write .metadata and the manifest, publish the directory, move ``latest``, prune older ones."""
        md = copy.copy(metadata)
        md.version = DCP_VERSION
        md.storage_data = {}
        files: dict[str, dict[str, Any]] = {}
        for rank_data in per_rank:
            for f in rank_data["files"]:
                files[f["name"]] = {"size": f["size"], "items": []}
            for r in rank_data["results"]:
                wr = plan_codec.decode_write_result(r)
                md.storage_data[wr.index] = wr.storage_data
                files[r["file"]]["items"].append({"offset": r["offset"], "length": r["length"], "crc32": r["crc32"],
                                                  "kind": r["kind"]})
        md.storage_meta = self.storage_meta()
        partial = self.partial_path
        blob = pickle.dumps(md)  # the DCP metadata file format (read by torch's FileSystemReader)
        publish.write_durable(partial / _METADATA, blob)
        files[_METADATA] = {"size": len(blob), "items": [{"offset": 0, "length": len(blob), "crc32": zlib.crc32(blob),
                                                          "kind": "bytes"}]}
        for entry in os.listdir(partial):  # leftovers of an earlier, interrupted save to the same path
            if entry not in files and entry != manifest_mod.MANIFEST:
                (partial / entry).unlink(missing_ok=True)
        manifest = {"format": manifest_mod.FORMAT, "kind": "dcp", "name": self.path.name, "save_id": self.save_id,
                    "world_size": len(per_rank), "published_at_ns": time.time_ns(), "files": files, **fence.stamp()}
        publish.write_durable(partial / manifest_mod.MANIFEST, manifest_mod.encode(manifest))
        fence.check_publish(self.path.parent, self.path.name)  # a round the job has left publishes nothing
        publish.publish_dir(partial, self.path)
        fence.check_published(self.path.parent, self.path.name, manifest)  # (a new round looked during the rename)
        self._after_publish()

    def _after_publish(self) -> None:
        """Move ``latest`` and prune; a failure here leaves a complete checkpoint, and the error says so."""
        step = "updating the `latest` pointer"
        try:
            if self.update_latest:
                publish.update_latest(self.path.parent, self.path.name)
            step = f"removing checkpoints older than the last {self.keep_last}"
            if self.keep_last is not None:
                prune(self.path.parent, self.keep_last, keep=self.path)
        except (OSError, CheckpointError) as exc:
            raise publish.cleanup_error(self.path, step, exc) from None
        publish.sweep_leftovers(self.path.parent)

    def discard_partial(self) -> None:
        """Remove the unpublished directory of a failed save (coordinator, after every rank stopped writing)."""
        try:
            publish.discard(self.partial_path)
        except OSError as exc:
            log.debug("cannot remove %s: %s", self.partial_path, exc)


def _torch_writer_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch FileSystemWriter's arguments (positional in its order, or by name) as a dict; others are refused."""
    if len(args) > len(_TORCH_WRITER_PARAMS):
        raise TypeError(f"FileSystemWriterAsync takes at most {len(_TORCH_WRITER_PARAMS) + 1} positional arguments")
    named = dict(zip(_TORCH_WRITER_PARAMS, args))
    for key, value in kwargs.items():
        if key not in _TORCH_WRITER_PARAMS:
            raise TypeError(f"FileSystemWriterAsync got an unexpected keyword argument {key!r}")
        if key in named:
            raise TypeError(f"FileSystemWriterAsync got multiple values for argument {key!r}")
        named[key] = value
    return named


def _lookup(planner: SavePlanner, item: WriteItem) -> Any:
    try:
        return planner.lookup_object(item.index)  # type: ignore[attr-defined]
    except Exception:
        return None


def _check_tensor(item: WriteItem, tensor: Any) -> None:
    td = item.tensor_data
    if not isinstance(tensor, torch.Tensor) or td is None:
        raise CheckpointError(f"{item.index.fqn!r}: the planner resolved a {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != tuple(td.chunk.sizes) or tensor.dtype != td.properties.dtype:
        raise CheckpointError(f"{item.index.fqn!r} changed while it was being saved: planned {tuple(td.chunk.sizes)} "
                              f"{td.properties.dtype}, found {tuple(tensor.shape)} {tensor.dtype}")


def _resolved_tensor(planner: SavePlanner, item: WriteItem) -> Any:
    tensor = planner.resolve_data(item)
    _check_tensor(item, tensor)
    return tensor


def _storage_info(name: str, offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(name, offset, length)


def prune(root: Path, keep_last: int, keep: Path) -> None:
    """Delete complete checkpoints in ROOT beyond the KEEP_LAST newest (never KEEP)."""
    from nvrx.ckpt.loader import list_checkpoints

    for info in list_checkpoints(root)[keep_last:]:
        if info.path != keep:
            log.info("removing old checkpoint %s (keep_last=%d)", info.path, keep_last)
            publish.discard(info.path)


def describe_plans(local: list[SavePlan], central: list[SavePlan]) -> str:
    """The plans of every rank as JSON (stored in the metadata so a resumed job can reuse them)."""
    return json.dumps({"local": [plan_codec.encode_plan(p) for p in local],
                       "central": [plan_codec.encode_plan(p) for p in central]}, separators=(",", ":"))
