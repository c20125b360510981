"""An asynchronous local save (``LocalCheckpointManager.save(is_async=True)``) after its snapshot.

Its files are written by this process's persistent checkpoint writer (the one DCP async saves use; job op
``local``, ``nvrx.ckpt.local.writer_job``) from one staging memfd holding this rank's shard at offset 0 and room for
the clique's replicas. The replication exchange runs on a thread: replicas are received in place into the memfd
and announced to the writer on a pipe sent with the job. Nothing here is collective over the world group: the
manager finalizes (``_finish_async``), or an ``AsyncCallsQueue`` the caller scheduled the request on.
"""

from __future__ import annotations

import json
import os
import select
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from nvrx.ckpt.async_ckpt.staging import StagingBuffer
from nvrx.ckpt.local.codec import ALIGN

if TYPE_CHECKING:
    from nvrx.ckpt.async_ckpt.core import WriterJob
    from nvrx.ckpt.async_ckpt.writer_process import WriterProcess
    from nvrx.ckpt.local.replication.strategies import CliqueReplicationStrategy


_SLICE = 0.2  # seconds: waits are cut into slices so the training thread keeps running Python (automatic heartbeat)


def staging_layout(nbytes: Sequence[int], me: int) -> tuple[list[int], int]:
    """Offsets of items of NBYTES in one staging buffer, item ME (this rank's shard) first at 0; and the total."""
    offsets, total = [0] * len(nbytes), 0
    for i in [me] + [i for i in range(len(nbytes)) if i != me]:
        offsets[i], total = total, total + -(-nbytes[i] // ALIGN) * ALIGN
    return offsets, total


def announce(pipe: Any, item: dict[str, Any]) -> None:
    """One JSON line to the writer's job; a writer that stopped reading (its job failed) is not an error here."""
    try:
        pipe.write(json.dumps(item, separators=(",", ":")).encode() + b"\n")
    except OSError:
        pass


@dataclass
class AsyncLocalSave:
    """One asynchronous local save: its staging buffer, writer job, exchange thread and outcome on this rank."""

    iteration: int
    staging: StagingBuffer
    job: "WriterJob | None" = None
    thread: threading.Thread | None = field(default=None, repr=False)
    files: list[str] = field(default_factory=list)
    error: str | None = None
    scheduled: bool = False  # taken by an AsyncCallsQueue (its preload hook ran) or by the manager
    finalized: bool = False
    reply: dict[str, Any] | None = None  # the writer's answer, once taken (by ``poll``)

    def mark_scheduled(self) -> None:
        self.scheduled = True

    def record(self, reply: dict[str, Any]) -> None:
        self.files = [f["name"] for f in reply.get("files", [])]

    def fail(self, reason: str) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.error = self.error or f"rank {rank}: {reason}"

    def submit(self, writer: "WriterProcess", job: dict[str, Any]) -> tuple[int, Any]:
        """Hand JOB to WRITER with the read end of a fresh pipe; (job id or 0 if the writer is unreachable, the
        pipe's write end as a file for ``announce``)."""
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        job_id = 0
        try:
            job_id = writer.submit(dict(job, pipe=True), buffer=self.staging, fd=read_end)
        except (RuntimeError, OSError) as exc:
            self.fail(f"checkpoint writer unreachable: {exc}")
        finally:
            os.close(read_end)
        return job_id, os.fdopen(write_end, "wb", buffering=0)

    def start_exchange(self, strategy: "CliqueReplicationStrategy | None", head: bytes,
                       sizes: list[tuple[int, int]], offsets: list[int], me: int, pipe: Any) -> None:
        """Run the replication exchange on a thread (every clique member does, at the same save)."""
        self.thread = threading.Thread(target=self._exchange, args=(strategy, head, sizes, offsets, me, pipe),
                                       name="nvrx-local-ckpt-exchange", daemon=True)
        self.thread.start()

    def _exchange(self, strategy: "CliqueReplicationStrategy | None", head: bytes, sizes: list[tuple[int, int]],
                  offsets: list[int], me: int, pipe: Any) -> None:
        """Receive the clique's shards into the staging buffer, announcing each to the writer. Runs to the end
        whatever the writer does: the peers take part in every broadcast."""
        view: torch.Tensor = self.staging.bytes_view()
        try:
            if strategy is not None:
                slots = [None if i == me else view[offsets[i]: offsets[i] + n] for i, (_, n) in enumerate(sizes)]
                strategy.exchange_into(head, view[: sizes[me][1]], slots, sizes, lambda h, i: announce(
                    pipe, {"header": h, "off": offsets[i], "nbytes": sizes[i][1]}))
        except Exception as exc:  # noqa: BLE001 - handed to the writer (the job fails) and to the agreement
            self.fail(f"replication exchange: {type(exc).__name__}: {exc}")
            announce(pipe, {"error": str(exc)})
        finally:
            pipe.close()

    def poll(self, block: bool) -> dict[str, Any] | None:
        """The writer's answer for this save, None while it writes (BLOCK: wait for it, in short slices so the
        training thread keeps its automatic heartbeat while a busy machine starves the writer)."""
        if self.reply is None:
            job = self.job
            writer = job.submitted_to if job is not None and job.job_id else None
            if writer is None:
                self.reply = {"ok": False, "error": self.error or "the save was never handed to the writer"}
                return self.reply
            try:
                while (reply := writer.result(job.job_id, block=False)) is None and block:  # type: ignore[union-attr]
                    select.select([writer.channel] if writer.channel is not None else [], [], [], _SLICE)
                self.reply = reply
            except (RuntimeError, KeyError) as exc:
                self.reply = {"ok": False, "error": str(exc)}
        return self.reply

    def done(self) -> bool:
        """Written (or failed) on this rank, without waiting."""
        return (self.thread is None or not self.thread.is_alive()) and self.poll(block=False) is not None

    def join(self) -> None:
        while self.thread is not None and self.thread.is_alive():
            self.thread.join(_SLICE)
