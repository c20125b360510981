"""``AsyncCallsQueue`` and ``AsyncRequest``: schedule checkpoint writes, finalize them in order (NVRx's API).

``schedule_async_request`` starts a request's write; ``maybe_finalize_async_calls`` is called regularly
from the training loop on every rank: the ranks agree (one small all-reduce per pending distributed
call) whether every rank's write is done, and only then run the request's finalize functions. A
failed write surfaces there, on every rank, as ``CheckpointWriteFailed`` (both our
``CheckpointWriteError`` and torch's ``CheckpointException``, which NVRx raises) naming the rank and
the reason - or, by choice, it is retried or skipped with a warning so a storage hiccup does not end
training.

Where a request's write runs (``AsyncRequest.async_fn``):

- a ``WriterJob`` (what ``FileSystemWriterAsync.get_save_function_and_args`` and our own save paths
  return): on this process's persistent writer process. The job is a small JSON message on the
  writer's private socketpair and the data is already in a staging memfd; nothing is pickled and
  nothing reaches another process by a name another user could open. NVRx instead pickles the whole
  request to a spawned worker; code that passes the save function it got from the writer through
  unchanged gets ours, so Megatron-Core's and NeMo's call sequence works as it is.
- any other callable (a user's own function): in a forked child of this process, as NVRx's
  non-persistent caller does. The child sees the arguments as they were at the call (copy-on-write),
  reports success or the exception through a pipe, and dies with this process.
- None: nothing to write; the finalize functions run at the next finalize call.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import os
import select
import signal
import weakref
from typing import Any, Callable, NamedTuple

from nvrx.ckpt.async_ckpt.writer_process import WriterProcess, default_writer
from nvrx.ckpt.errors import CheckpointCleanupError, CheckpointError, CheckpointWriteError

log = logging.getLogger("nvrx.ckpt.queue")

_ERROR_CHARS = 4000  # of a forked call's error message
_DEFAULT_IN_CHILD = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class AsyncRequest(NamedTuple):
    """One asynchronous call: ``async_fn(*async_fn_args, **async_fn_kwargs)``, then ``finalize_fns`` on every rank.

    Field order and defaults are NVRx's, so ``AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=...)``
    binds as there. PRELOAD_FN, when given, is called at scheduling time (in the training process) and its
    result replaces ``async_fn_args[1]``. IS_FROZEN / CALL_IDX are set by the queue when it takes the request.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict[str, Any] | None = None
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run FN after the finalize functions already added (refused once the request was scheduled)."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> "AsyncRequest":
        """A copy that refuses further finalize functions (the queue keeps this one)."""
        return self._replace(is_frozen=True)

    def resolved_args(self) -> list[Any]:
        """The call's arguments, with ``preload_fn``'s result in place of the second one."""
        args = list(self.async_fn_args)
        if self.preload_fn is not None:
            if len(args) < 2:
                raise CheckpointError("preload_fn replaces async_fn_args[1], but async_fn_args has fewer than 2 items")
            args[1] = self.preload_fn()
        return args

    def execute_sync(self) -> None:
        """Do the whole request now, in this process: preload, the call, a barrier, the finalize functions."""
        args = self.resolved_args()
        if self.async_fn is not None:
            self.async_fn(*args, **dict(self.async_fn_kwargs or {}))
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self.execute_finalize_fns(validate_matching_call_idx=False)

    def execute_finalize_fns(self, validate_matching_call_idx: bool = True) -> int:
        """Run the finalize functions in order; with validation, check every rank finalizes the same call."""
        for fn in self.finalize_fns:
            fn()
        if validate_matching_call_idx:
            dw = _default_dist()
            if dw is not None:
                highest = -dw.all_min([-self.call_idx])[0]
                if highest != self.call_idx:
                    raise AssertionError(f"Unmatched async calls: this rank finalizes call {self.call_idx}, another "
                                         f"rank call {highest}; every rank must schedule and finalize the same calls")
        return self.call_idx


@dataclasses.dataclass
class WriterJob:
    """A save function that runs on the persistent writer process (``AsyncRequest.async_fn``).

    JOB is the JSON the writer runs; it reads BUFFER (a staging buffer, attached once) or FD (a staged
    file, sent with the job). JOB_ID: already submitted to SUBMITTED_TO (writing overlaps staging).
    DIST_WRAPPER, when set, makes the request collective: all ranks agree before the finalize functions
    run. ON_RESULT gets the writer's successful answer; ON_FAILURE, when set, gets a failed write's reason
    instead of an exception (a distributed save reports it from its finalize, on every rank at once);
    ON_DISCARD frees the staging (True: also remove the unpublished files).

    Calling it (``AsyncRequest.execute_sync``) writes now and waits; the queue instead submits the job
    and polls for the answer.
    """

    job: dict[str, Any] = dataclasses.field(repr=False)
    buffer: Any = dataclasses.field(default=None, repr=False)
    fd: int | None = None
    job_id: int = 0
    submitted_to: WriterProcess | None = dataclasses.field(default=None, repr=False)
    dist_wrapper: Any = dataclasses.field(default=None, repr=False)
    on_result: Callable[[dict[str, Any]], None] | None = dataclasses.field(default=None, repr=False)
    on_failure: Callable[[str], None] | None = dataclasses.field(default=None, repr=False)
    on_discard: Callable[[bool], None] | None = dataclasses.field(default=None, repr=False)
    description: str = "checkpoint"
    destination: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        writer = self.submitted_to or default_writer()
        try:
            job_id = self.job_id or writer.submit(self.job, buffer=self.buffer, fd=self.fd)
            reply = writer.result(job_id, block=True)
        except RuntimeError as exc:
            reply = {"ok": False, "error": str(exc)}
        self.job_id, self.submitted_to = 0, None
        self.deliver(reply)

    def deliver(self, reply: dict[str, Any]) -> None:
        """Hand the writer's answer on; a failure without ON_FAILURE raises here (after freeing the staging)."""
        if reply.get("ok"):
            if self.on_result:
                self.on_result(reply)
            return
        if self.on_failure:
            self.on_failure(str(reply.get("error")))
            return
        if self.on_discard:
            self.on_discard(True)
        raise _write_failed(f"checkpoint {self.description} was not saved: {reply.get('error')}; the previous "
                            "checkpoint is intact", [reply.get("error")])  # the write failed: nothing was published


class _ForkedCall:
    """A user's callable running in a forked child; its outcome comes back as one JSON message on a pipe."""

    def __init__(self, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> None:
        from nvrx.common.process import die_with_parent

        parent = os.getpid()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: run, report, leave without running the parent's exit handlers
            os.close(read_end)
            die_with_parent(parent)
            for sig in _DEFAULT_IN_CHILD:  # the parent's handlers (graceful stop, ...) are not the child's
                signal.signal(sig, signal.SIG_DFL)
            try:
                fn(*args, **kwargs)
                outcome: dict[str, Any] = {"ok": True}
            except BaseException as exc:  # reported to the parent, which raises it at finalize
                outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]}
            try:
                os.write(write_end, json.dumps(outcome).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        self.pid, self.fd = pid, read_end
        self.name = getattr(fn, "__qualname__", type(fn).__name__)

    def poll(self, block: bool) -> dict[str, Any] | None:
        """The outcome, or None while the child runs (BLOCK: wait for it)."""
        done, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        if done == 0:
            return None
        with os.fdopen(self.fd, "rb") as pipe:  # complete: the child wrote before it exited
            data = pipe.read()
        if data:
            return json.loads(data)
        if os.WIFSIGNALED(status):
            return {"ok": False, "error": f"{self.name} (pid {self.pid}) was killed by "
                                          f"{signal.Signals(os.WTERMSIG(status)).name}"}
        return {"ok": False, "error": f"{self.name} (pid {self.pid}) exited with code {os.WEXITSTATUS(status)}"}

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after TIMEOUT seconds; reaps the child."""
        try:
            os.kill(self.pid, signal.SIGTERM)
            if not select.select([self.fd], [], [], timeout)[0]:  # end of file: the child is gone
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        finally:
            os.close(self.fd)


@dataclasses.dataclass
class _Call:
    idx: int
    request: AsyncRequest
    work: WriterJob | _ForkedCall | None
    dist_wrapper: Any = None
    writer: WriterProcess | None = None
    job_id: int = 0
    attempts: int = 1
    reply: dict[str, Any] | None = None

    @property
    def job(self) -> WriterJob | None:
        return self.work if isinstance(self.work, WriterJob) else None


_queues: "weakref.WeakSet[AsyncCallsQueue]" = weakref.WeakSet()


class AsyncCallsQueue:
    """Pending asynchronous calls of this process, in the order they were scheduled.

    NVRx's arguments: PERSISTENT (default True) writes on this process's shared, long-lived writer
    process; False gives the queue its own writer process, started on first use and stopped by
    ``close()`` (NVRx forks a process per call instead). CPU_PRIORITY (nice, 0-19) and IO_PRIORITY
    (ionice class 0-3, None: unchanged) apply to that writer. SIGTERM_TIMEOUT: how long ``close(abort=True)``
    waits for a write to stop before killing it. IS_DAEMON is accepted for NVRx's call: our writer always
    dies with this process. CPU_SHM_MODE is about GPU tensors: staging is always in shared memory here.

    Ours: WRITER (a ``WriterProcess`` to use), RETRIES (how many times a failed write is tried again),
    SKIP_FAILED (when it still fails, or publishing fails, log a warning and drop that save instead of raising).
    """

    def __init__(self, persistent: bool = True, is_daemon: bool = True, cpu_priority: int = 10,
                 io_priority: int | None = None, sigterm_timeout: float = 30.0, cpu_shm_mode: bool = False, *,
                 writer: WriterProcess | None = None, retries: int = 0, skip_failed: bool = False) -> None:
        if retries < 0:
            raise ValueError(f"retries={retries}: give 0 or more")
        if not 0 <= cpu_priority <= 19:
            raise ValueError(f"cpu_priority={cpu_priority}: give a nice value from 0 to 19")
        if io_priority is not None and io_priority not in range(4):
            raise ValueError(f"io_priority={io_priority}: give an ionice class from 0 to 3, or None")
        if cpu_shm_mode:
            log.info("cpu_shm_mode: staging is always in shared memory (memfd); the GPU-tensor part needs a GPU")
        self.persistent = persistent
        self.is_daemon = is_daemon
        self.sigterm_timeout = sigterm_timeout
        self._own_writer = writer is None and not persistent
        if writer is None:
            writer = default_writer() if persistent else WriterProcess(nice=cpu_priority, io_class=io_priority)
        if persistent and (cpu_priority, io_priority) != (writer.nice, writer.io_class):
            writer.set_priority(cpu_priority, io_priority)
        self.writer = writer
        self.retries = retries
        self.skip_failed = skip_failed
        self._idx = itertools.count()
        self._collective: list[_Call] = []
        self._local: list[_Call] = []
        _queues.add(self)

    @classmethod
    def get_instances(cls) -> list["AsyncCallsQueue"]:
        """Every live queue of this process (``abort_nvrx_checkpoint`` closes them all)."""
        return list(_queues)

    @classmethod
    def warmup_persistent_caller(cls, rank: int, is_daemon: bool = True, cpu_priority: int = 10,
                                 io_priority: int | None = None, sigterm_timeout: float = 30.0) -> WriterProcess:
        """Start this process's persistent writer now, so the first save does not wait for it (RANK: for the log)."""
        writer = default_writer()
        if (cpu_priority, io_priority) != (writer.nice, writer.io_class):
            writer.set_priority(cpu_priority, io_priority)
        log.debug("rank %s: checkpoint writer process %s is running", rank, writer.pid)
        return writer

    # ------------------------------------------------------------ scheduling

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start the call of ASYNC_REQUEST (call it on every rank); returns its call index (0, 1, ...)."""
        if not isinstance(async_request, AsyncRequest):
            raise CheckpointError(f"schedule_async_request takes an AsyncRequest, not {type(async_request).__name__}")
        fn = async_request.async_fn
        if isinstance(fn, WriterJob) and fn.destination is not None and fn.destination in self.pending_destinations():
            if fn.on_discard:
                fn.on_discard(False)  # the pending save owns the files at that path
            raise CheckpointWriteError(f"a save to {fn.destination} is still pending; finalize it first "
                                       "(maybe_finalize_async_calls(blocking=True)) or save to another path")
        idx = next(self._idx)
        request = async_request._replace(is_frozen=True, call_idx=idx, finalize_fns=list(async_request.finalize_fns))
        args = request.resolved_args()
        _queues.add(self)
        if isinstance(fn, WriterJob):
            call = _Call(idx, request, fn, fn.dist_wrapper, fn.submitted_to or self.writer)
            if fn.job_id:
                call.job_id = fn.job_id
            else:
                self._submit(call)
        elif fn is None:
            call = _Call(idx, request, None, _default_dist(), reply={"ok": True})
        else:
            call = _Call(idx, request, _ForkedCall(fn, args, dict(request.async_fn_kwargs or {})), _default_dist())
        (self._collective if call.dist_wrapper is not None else self._local).append(call)
        return idx

    def _submit(self, call: _Call) -> None:
        job = call.job
        assert job is not None and call.writer is not None
        call.reply = None
        message = {k: v for k, v in job.job.items() if k != "progressive"}  # a retry reads a complete buffer
        try:
            call.job_id = call.writer.submit(message, buffer=job.buffer, fd=job.fd)
        except RuntimeError as exc:  # writer unreachable: the failure is reported at finalize, like a write error
            call.job_id = 0
            call.reply = {"ok": False, "error": str(exc)}

    def pending_destinations(self) -> set[str]:
        return {c.job.destination for c in self._collective + self._local if c.job and c.job.destination}

    def get_num_unfinalized_calls(self) -> int:
        return len(self._collective) + len(self._local)

    # ------------------------------------------------------------ finalizing

    def _poll(self, call: _Call, block: bool) -> dict[str, Any] | None:
        if call.reply is None:
            if isinstance(call.work, _ForkedCall):
                call.reply = call.work.poll(block)
            elif call.job_id and call.writer is not None:
                call.reply = call.writer.result(call.job_id, block=block)
        return call.reply

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the calls whose writes are done on every rank; returns their call indices, in order.

        Call it on every rank the same number of times (it is collective while a distributed call is
        pending). BLOCKING waits until all pending calls are finalized. With nothing pending it returns []
        at once, without communicating. NO_DIST skips the agreement: each rank finalizes what it finished.
        """
        done = self._finalize_local(blocking)
        while self._collective:
            call = self._collective[0]
            reply = self._poll(call, blocking)
            dw = call.dist_wrapper
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
        return sorted(done)

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
        what = call.job.description if call.job else f"call {call.idx}"
        if call.job and call.attempts <= self.retries:
            log.warning("writing checkpoint %s failed (%s); trying again (%d of %d)", what, where, call.attempts,
                        self.retries)
            call.attempts += 1
            if call.reply is not None and not call.reply.get("ok"):
                self._submit(call)
            return True
        pending.remove(call)
        if call.job and call.job.on_discard:
            call.job.on_discard(True)
        if call.job:
            message = f"checkpoint {what} was not saved: {where}; the previous checkpoint is intact"
        else:
            message = f"asynchronous call {call.idx} failed: {where}; its finalize functions were not run"
        if self.skip_failed:
            log.warning("%s (skipped; training continues)", message)
            return False
        raise _write_failed(message, errors)

    def _finish(self, call: _Call) -> bool:
        """Run the finalize functions of a finished call; False if it failed and was skipped."""
        job = call.job
        try:
            if job is not None:
                job.deliver(call.reply)  # type: ignore[arg-type]
            for fn in call.request.finalize_fns:
                fn()
        except CheckpointCleanupError as exc:  # published: nothing to remove, only `latest`/pruning failed
            if self.skip_failed:
                log.warning("%s (training continues)", exc)
                return True
            raise
        except CheckpointWriteError as exc:
            if job is not None and job.on_discard:
                job.on_discard(True)
            if self.skip_failed:
                log.warning("%s (skipped; training continues)", exc)
                return False
            raise
        return True

    # ------------------------------------------------------------ shutting down

    def close(self, abort: bool = False, stop_writer: bool = False) -> None:
        """Finalize every pending call (blocking, collective) - or with ABORT stop and drop them unpublished.

        A queue's own writer (``persistent=False``) is stopped; the process-wide one only with STOP_WRITER
        (other queues of this process use it; it ends with the process). The queue can be used again.
        """
        try:
            if abort:
                self._abort()
            else:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            if stop_writer or self._own_writer:
                self.writer.stop()
            self._idx = itertools.count()
            _queues.discard(self)

    def _abort(self) -> None:
        for call in self._collective + self._local:
            try:
                self._stop_call(call)
            except Exception as exc:
                log.debug("cleanup of call %d failed: %s", call.idx, exc)
        self._collective.clear()
        self._local.clear()

    def _stop_call(self, call: _Call) -> None:
        """Stop a pending call's write (killing the writer if it does not stop in time) and drop its files."""
        if isinstance(call.work, _ForkedCall):
            if call.reply is None:
                call.work.stop(self.sigterm_timeout)
            return
        if call.job_id and call.reply is None and call.writer is not None:
            if not call.writer.abort(call.job_id, "the checkpoint queue was closed with abort=True",
                                     timeout=self.sigterm_timeout):
                call.writer.kill()
        if call.job and call.job.on_discard:
            call.job.on_discard(True)


def abort_nvrx_checkpoint() -> None:
    """Stop and drop every pending asynchronous call of this process (for in-process / in-job restart)."""
    for queue in AsyncCallsQueue.get_instances():
        queue.close(abort=True)


def _default_dist() -> Any:
    """The agreement over the default group for calls that are not ours, or None when there is nothing to agree.

    The agreement needs a CPU (gloo) group; with a GPU-only default group the ranks' calls are finalized
    without it (said once in the log), as with ``no_dist=True``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from nvrx.ckpt.async_ckpt.dist_wrapper import DistWrapper

    try:
        return DistWrapper()
    except CheckpointError as exc:
        global _warned_no_cpu_group
        if not _warned_no_cpu_group:
            log.warning("asynchronous calls are finalized per rank, without agreement: %s", exc)
            _warned_no_cpu_group = True
        return None


_warned_no_cpu_group = False


def _write_failed(message: str, errors: list[Any]) -> CheckpointWriteError:
    from nvrx.ckpt.async_ckpt.write_errors import CheckpointWriteFailed, failures_by_rank

    return CheckpointWriteFailed(message, failures_by_rank([str(e) if e else None for e in errors]))


def _warn_unfinalized_at_exit() -> None:
    for queue in list(_queues):
        pending = queue.get_num_unfinalized_calls()
        if pending:
            log.warning("%d checkpoint save(s) were never finalized and are not published (call ckpt.wait() or "
                        "ckpt.finalize_before_exit() before the process ends)", pending)


atexit.register(_warn_unfinalized_at_exit)
