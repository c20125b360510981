"""The persistent checkpoint writer process (``python -m nvrx.ckpt.async_ckpt.writer_main FD PARENT_PID [NICE]``).

Started once per training process and reused for every save. It maps the staging buffers it is
given (memfds), writes the files each job describes, fsyncs them and answers with sizes, offsets
and checksums. It never publishes a checkpoint: that is the training processes' finalize step.

It ignores the graceful-stop signals (the launcher signals the whole process group; the training
process decides when its writer stops) and exits at once when the training process goes away
(end of file on the control channel, or SIGKILL through PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import mmap
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any

from nvrx.ckpt.async_ckpt.control import Channel, ChannelClosed
from nvrx.common.process import die_with_parent

_NICE = 10  # default niceness; the training process may ask for another (AsyncCallsQueue(cpu_priority=...))


class Writer:
    """Maps buffers, runs jobs in order on one thread, replies on the channel."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.buffers: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self.jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run_jobs, name="nvrx-ckpt-jobs", daemon=True)
        # progressive jobs: the trainer is still copying into the buffer; it reports how far it got
        self.staged: dict[int, int] = {}
        self.aborted: dict[int, str] = {}
        self.progress = threading.Condition()

    def reply(self, message: dict[str, Any]) -> None:
        with self.send_lock:
            try:
                self.channel.send(message)
            except OSError:
                os._exit(0)  # the training process is gone

    def attach(self, buf_id: int, size: int, fd: int) -> None:
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffers[buf_id] = (mm, memoryview(mm))

    def detach(self, buf_id: int) -> None:
        entry = self.buffers.pop(buf_id, None)
        if entry is not None:
            mm, view = entry
            view.release()
            try:
                mm.close()
            except BufferError:
                pass

    def _run_jobs(self) -> None:
        from nvrx.ckpt.async_ckpt import file_writer

        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job["op"] == "detach":
                self.detach(job["buf"])
                continue
            started = time.perf_counter()
            try:
                if job["op"] == "write":
                    view = self.buffers[job["buf"]][1]
                    wait = self._waiter(job["id"]) if job.get("progressive") else None
                    files = file_writer.write_files(view, job["dir"], job["files"], fsync=job.get("fsync", True),
                                                    wait_staged=wait)
                elif job["op"] == "local":  # the local checkpoint tier (nvrx.ckpt.local): its files, replicas announced on a pipe
                    from nvrx.ckpt.local import writer_job

                    files = writer_job.run(job, self.buffers[job["buf"]][1], job.get("_fd"))
                else:  # "copy": a whole file staged in the memfd that came with the message
                    files = [file_writer.copy_to_file(job["_fd"], job["nbytes"], job["path"], fsync=job.get("fsync", True))]
                self.reply({"op": "done", "id": job["id"], "ok": True, "files": files,
                            "seconds": time.perf_counter() - started})
            except Exception as exc:  # reported to the training process, which decides what to do
                self.reply({"op": "done", "id": job["id"], "ok": False, "error": _describe(exc)})
            finally:
                if "_fd" in job:
                    os.close(job["_fd"])
                with self.progress:
                    self.staged.pop(job["id"], None)
                    self.aborted.pop(job["id"], None)

    def _waiter(self, job_id: int) -> Any:
        """For a progressive job: block until bytes [0, end) of its buffer are staged (or staging failed)."""

        def wait_staged(end: int) -> None:
            with self.progress:
                self.progress.wait_for(lambda: self.staged.get(job_id, 0) >= end or job_id in self.aborted)
                if job_id in self.aborted:
                    raise RuntimeError(f"staging failed in the training process: {self.aborted[job_id]}")

        return wait_staged

    def serve(self) -> None:
        self.thread.start()
        self.reply({"op": "ready", "pid": os.getpid()})
        while True:
            try:
                message = self.channel.recv()
            except ChannelClosed:
                os._exit(0)
            op = message.get("op")
            if op == "attach":
                self.attach(message["buf"], message["size"], self.channel.take_fd())
            elif op == "copy" or (op == "local" and message.get("pipe")):
                message["_fd"] = self.channel.take_fd()
                self.jobs.put(message)
            elif op == "local":  # a retry: no pipe came with it
                self.jobs.put(message)
            elif op in ("write", "detach"):
                self.jobs.put(message)
            elif op == "staged":
                with self.progress:
                    self.staged[message["id"]] = max(self.staged.get(message["id"], 0), message["upto"])
                    self.progress.notify_all()
            elif op == "abort":
                with self.progress:
                    self.aborted[message["id"]] = message.get("reason", "aborted")
                    self.progress.notify_all()
            elif op == "exit":
                self.jobs.put(None)
                self.thread.join()
                os._exit(0)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _warm_up() -> None:
    """Import torch early so the first save does not wait for it."""
    import torch  # noqa: F401
    import nvrx.ckpt as ckpt
    import nvrx.ckpt.async_ckpt.file_writer  # noqa: F401


def main(argv: list[str]) -> None:
    fd, parent_pid = int(argv[0]), int(argv[1])
    nice = int(argv[2]) if len(argv) > 2 else _NICE
    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
    for sig in stop_signals:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)  # blocked by the training process across our start
    die_with_parent(parent_pid)
    try:
        os.nice(max(0, nice - os.nice(0)))  # training comes first: while a rank copies its state the writer yields
    except OSError:
        pass

    channel = Channel(socket.socket(fileno=fd))
    threading.Thread(target=_warm_up, name="nvrx-ckpt-warmup", daemon=True).start()
    Writer(channel).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
