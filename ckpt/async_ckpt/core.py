"""``AsyncCallsQueue``: schedule checkpoint writes on the persistent writer process, finalize them in order.

``schedule_async_request`` hands a staged request to the writer (a message, no fork).
``maybe_finalize_async_calls`` is called regularly from the training loop on every rank: the
ranks agree (one small all-reduce per pending distributed save) whether every rank's writes are
durable, and only then run the finalize step. A failed write surfaces there, on every rank, as a
``CheckpointWriteError`` naming the rank and the reason - or, by choice, it is retried or skipped
with a warning so a storage hiccup does not end training.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from ckpt.async_ckpt.writer_process import WriterProcess, default_writer
from ckpt.errors import CheckpointCleanupError, CheckpointWriteError

log = logging.getLogger("nvrx.ckpt.queue")


@dataclass
class AsyncRequest:
    """A staged save: the writer-process job, what to run once it is durable, and how to clean up.

    JOB is JSON for the writer process. It reads BUFFER (a staging buffer, attached once) or
    the file descriptor FD (a staged file, sent with the job). DIST_WRAPPER, when set, makes the
    request collective: all ranks must schedule it and agree before FINALIZE_FNS run.
    """

    job: dict[str, Any]
    finalize_fns: list[Callable[[], None]]
    buffer: Any = None
    fd: int | None = None
    dist_wrapper: Any = None
    on_result: Callable[[dict[str, Any]], None] | None = None
    on_discard: Callable[[bool], None] | None = None  # free resources; True: also remove unpublished files
    description: str = "checkpoint"
    destination: str | None = None
    job_id: int = 0  # already submitted to the queue's writer (progressive staging); 0: submit at schedule


@dataclass
class _Call:
    idx: int
    request: AsyncRequest
    job_id: int = 0
    attempts: int = 1
    reply: dict[str, Any] | None = field(default=None)


_queues: "weakref.WeakSet[AsyncCallsQueue]" = weakref.WeakSet()


class AsyncCallsQueue:
    """Pending asynchronous saves of this process, in the order they were scheduled.

    RETRIES: how many times a failed write is tried again. SKIP_FAILED: when the write still
    fails (or publishing fails), log a warning and drop that save instead of raising.
    """

    def __init__(self, writer: WriterProcess | None = None, *, retries: int = 0, skip_failed: bool = False) -> None:
        if retries < 0:
            raise ValueError(f"retries={retries}: give 0 or more")
        self.writer = writer or default_writer()
        self.retries = retries
        self.skip_failed = skip_failed
        self._idx = itertools.count()
        self._collective: list[_Call] = []
        self._local: list[_Call] = []
        _queues.add(self)

    # ------------------------------------------------------------ scheduling

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Start writing REQUEST in the writer process; returns its call index."""
        if request.destination is not None and request.destination in self.pending_destinations():
            if request.on_discard:
                request.on_discard(False)  # the pending save owns the files at that path
            raise CheckpointWriteError(f"a save to {request.destination} is still pending; finalize it first "
                                       "(maybe_finalize_async_calls(blocking=True)) or save to another path")
        call = _Call(next(self._idx), request)
        if request.job_id:
            call.job_id = request.job_id
        else:
            self._submit(call)
        (self._collective if request.dist_wrapper is not None else self._local).append(call)
        return call.idx

    def _submit(self, call: _Call) -> None:
        request = call.request
        call.reply = None
        job = {k: v for k, v in request.job.items() if k != "progressive"}  # a retry reads a complete buffer
        try:
            call.job_id = self.writer.submit(job, buffer=request.buffer, fd=request.fd)
        except RuntimeError as exc:  # writer unreachable: the failure is reported at finalize, like a write error
            call.job_id = 0
            call.reply = {"ok": False, "error": str(exc)}

    def pending_destinations(self) -> set[str]:
        return {c.request.destination for c in self._collective + self._local if c.request.destination}

    def get_num_unfinalized_calls(self) -> int:
        return len(self._collective) + len(self._local)

    # ------------------------------------------------------------ finalizing

    def _poll(self, call: _Call, block: bool) -> dict[str, Any] | None:
        if call.reply is None and call.job_id:
            call.reply = self.writer.result(call.job_id, block=block)
        return call.reply

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the saves whose writes are durable on every rank; returns their call indices.

        Call it on every rank the same number of times (it is collective while a distributed save
        is pending). BLOCKING waits until all pending saves are finalized. With nothing pending it
        returns [] at once, without communicating. NO_DIST skips the agreement (single process).
        """
        done = self._finalize_local(blocking)
        while self._collective:
            call = self._collective[0]
            reply = self._poll(call, blocking)
            dw = call.request.dist_wrapper
            written = reply is not None
            ok = written and bool(reply.get("ok"))  # type: ignore[union-attr]
            if no_dist:
                all_written, all_ok = written, ok
            else:
                all_written, all_ok = (bool(v) for v in dw.all_min([int(written), int(ok or not written)]))
            if not all_written:
                break  # (blocking: cannot happen, every rank waited for its own writes)
            if not all_ok:
                errors = [reply.get("error")] if no_dist else dw.all_gather_json(None if ok else reply.get("error"))  # type: ignore[union-attr]
                if self._retry_or_drop(call, self._collective, errors):
                    if blocking:
                        continue
                    break
                continue
            self._collective.pop(0)
            if self._finish(call):
                done.append(call.idx)
        return done

    def _finalize_local(self, blocking: bool) -> list[int]:
        done = []
        for call in list(self._local):
            reply = self._poll(call, blocking)
            while reply is not None and not reply.get("ok"):
                if not self._retry_or_drop(call, self._local, [reply.get("error")]):
                    reply = None
                    break
                reply = self._poll(call, blocking)
            if reply is None or call not in self._local:
                continue
            self._local.remove(call)
            if self._finish(call):
                done.append(call.idx)
        return done

    def _retry_or_drop(self, call: _Call, pending: list[_Call], errors: list[Any]) -> bool:
        """After a failed write: True if it was submitted again; otherwise drop it (warn) or raise."""
        where = "; ".join(f"rank {r}: {e}" if len(errors) > 1 else str(e) for r, e in enumerate(errors) if e)
        if call.attempts <= self.retries:
            log.warning("writing checkpoint %s failed (%s); trying again (%d of %d)", call.request.description, where,
                        call.attempts, self.retries)
            call.attempts += 1
            if call.reply is not None and not call.reply.get("ok"):
                self._submit(call)
            return True
        pending.remove(call)
        if call.request.on_discard:
            call.request.on_discard(True)
        message = f"checkpoint {call.request.description} was not saved: {where}; the previous checkpoint is intact"
        if self.skip_failed:
            log.warning("%s (skipped; training continues)", message)
            return False
        raise CheckpointWriteError(message)

    def _finish(self, call: _Call) -> bool:
        """Run the finalize functions of a durable save; False if it failed and was skipped."""
        request = call.request
        try:
            if request.on_result:
                request.on_result(call.reply)  # type: ignore[arg-type]
            for fn in request.finalize_fns:
                fn()
        except CheckpointCleanupError as exc:  # published: nothing to remove, only `latest`/pruning failed
            if self.skip_failed:
                log.warning("%s (training continues)", exc)
                return True
            raise
        except CheckpointWriteError as exc:
            if request.on_discard:
                request.on_discard(True)
            if self.skip_failed:
                log.warning("%s (skipped; training continues)", exc)
                return False
            raise
        return True

    # ------------------------------------------------------------ shutting down

    def close(self, abort: bool = False, stop_writer: bool = False) -> None:
        """Finalize every pending save (blocking, collective) - or with ABORT drop them unpublished."""
        try:
            if abort:
                self._abort()
            else:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            if stop_writer:
                self.writer.stop()
            _queues.discard(self)

    def _abort(self) -> None:
        for call in self._collective + self._local:
            if call.request.on_discard:
                try:
                    call.request.on_discard(True)
                except Exception as exc:
                    log.debug("cleanup of %s failed: %s", call.request.description, exc)
        self._collective.clear()
        self._local.clear()


def _warn_unfinalized_at_exit() -> None:
    for queue in list(_queues):
        pending = queue.get_num_unfinalized_calls()
        if pending:
            log.warning("%d checkpoint save(s) were never finalized and are not published (call ckpt.wait() or "
                        "ckpt.finalize_before_exit() before the process ends)", pending)


atexit.register(_warn_unfinalized_at_exit)
