"""Staging buffers: memfd-backed memory the training process copies checkpoint data into.

A save blocks training only for the copy into a staging buffer; the writer process reads the
same pages (the memfd is passed to it once) and writes them to disk. Buffers are kept and reused
by later saves, so a warm save is a plain memory copy into pages that already exist. A buffer
belongs to one pending save until that save is finalized (a retry re-writes from it).
"""

from __future__ import annotations

import ctypes
import functools
import io
import itertools
import logging
import mmap
import os
import threading
from typing import Any, Sequence

log = logging.getLogger("nvrx.ckpt.staging")

ALIGN = 64  # item offsets inside a buffer (cache-line aligned copies)
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_GRANULE = 2 << 20  # buffer sizes are rounded up to this
_CHUNK = 32 << 20  # one lane's unit of work when several threads fill a new buffer (a multiple of the page size)
_MAX_LANES = 4
_ids = itertools.count(1)
_close_hooks: list[Any] = []  # weak methods called with a buffer before it is closed (the writer unmaps it)


def add_close_hook(hook: Any) -> None:
    """HOOK is a weakref.WeakMethod (or a callable returning a callable or None) run for each closed buffer."""
    _close_hooks.append(hook)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingBuffer:
    """One memfd mapped into this process; ``id`` names it to the writer process."""

    def __init__(self, capacity: int) -> None:
        self.id = next(_ids)
        self.capacity = max(_GRANULE, (capacity + _GRANULE - 1) // _GRANULE * _GRANULE)
        self.fd = os.memfd_create(f"nvrx-ckpt-staging-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.capacity)
            self.mm = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._u8: Any = None
        self.in_use = False
        self.fresh = True  # no page of it has been touched yet (first use pays the page faults)
        self.populated = False  # every page is allocated and mapped here (copies through the mapping run warm)
        self.warming: threading.Event | None = None  # set while reserve() faults the pages in

    def populate(self) -> None:
        """Fault every page in now (MADV_POPULATE_WRITE, else by writing zeros), so copies into it run warm."""
        self.fresh = False
        self.populated = True
        if not self._madvise_populate():
            self.bytes_view().zero_()

    def map_pages(self) -> None:
        """Map pages pwrite already filled (no data changes), so later copies go through the mapping, warm."""
        if self._madvise_populate():
            self.populated = True

    def _madvise_populate(self, start: int = 0, length: int | None = None) -> bool:
        """MADV_POPULATE_WRITE over [start, start+length) (default: all); False if it failed or is unsupported."""
        try:
            address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm, start))
            return _libc().madvise(address, self.capacity - start if length is None else length,
                                   _MADV_POPULATE_WRITE) == 0
        except (OSError, AttributeError, TypeError, ValueError):  # (ValueError: the mapping was closed)
            return False

    def bytes_view(self) -> Any:
        """The whole buffer as a uint8 tensor (created once; views of it are cheap)."""
        if self._u8 is None:
            import torch

            self._u8 = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self._u8

    def copy_tensor(self, offset: int, tensor: Any) -> None:
        """Copy TENSOR's values into [offset, offset+nbytes) (from any device, any strides).

        Into a buffer not populated through the mapping, a plain CPU tensor is written to the memfd with
        pwrite: the kernel allocates each page and fills it in one go, where a first copy through the mapping
        pays a fault per page plus zeroing it (measured 2-3x a warm copy for a fresh buffer; pwrite ~1-1.3x).
        """
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return
        if not self.populated and _plain_cpu(tensor):
            self._pwrite(offset, memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B"))
            return
        # (no populate() here: its fallback writes zeros over what pwrite already put in)
        dst = self.bytes_view()[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape)
        dst.copy_(tensor.detach())

    def fill(self, copies: Sequence[tuple[int, Any]], lanes: int | None = None) -> None:
        """Copy each (offset, tensor or bytes-like) of COPIES into the buffer, as ``copy_tensor`` / ``copy_bytes`` would.

        A buffer not populated yet (its first save) is filled by LANES threads (default: torch's intra-op
        threads, as a warm copy uses): this one writes chunks from the front with pwrite (the kernel allocates
        each page and fills it, no zeroing, but one writer at a time per memfd), helpers take chunks from the
        back, populating each (allocate + zero + map, no file lock) and copying through the mapping. Chunks
        split the buffer at page-aligned boundaries, so no page is written by two lanes.
        """
        pieces: list[tuple[int, int, int]] = []  # (offset, source address, nbytes) of plain CPU tensors
        keep: list[Any] = []  # the tensors those addresses point into, alive until the copy is done
        for offset, data in copies:
            if not hasattr(data, "data_ptr"):
                self.copy_bytes(offset, data)
                continue
            nbytes = data.numel() * data.element_size()
            if nbytes and offset + nbytes > self.capacity:
                raise ValueError(f"{nbytes} bytes at {offset} do not fit staging buffer {self.id} ({self.capacity})")
            if self.populated or not _plain_cpu(data) or nbytes == 0:
                self.copy_tensor(offset, data)
            else:
                pieces.append((offset, data.data_ptr(), nbytes))
                keep.append(data)
        lanes = _default_lanes() if lanes is None else max(1, lanes)
        chunks = _chunks(pieces)
        if lanes == 1 or len(chunks) < 2:
            for chunk in chunks:
                self._pwrite_chunk(chunk)
            return
        self.bytes_view()  # (created here, not raced for by the lanes)
        _libc()
        _run_lanes(chunks, min(lanes, len(chunks)), self._pwrite_chunk, self._map_and_copy)
        del keep

    def _pwrite_chunk(self, chunk: list[tuple[int, int, int]]) -> None:
        for offset, address, nbytes in chunk:
            self._pwrite(offset, memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B"))

    def _map_and_copy(self, chunk: list[tuple[int, int, int]]) -> None:
        """Populate CHUNK's pages in one call, then copy through the mapping (pwrite if populating fails:
        a plain store into a page the kernel cannot provide would be a SIGBUS, pwrite an OSError)."""
        start = chunk[0][0] // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(self.capacity, -(-(chunk[-1][0] + chunk[-1][2]) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if not self._madvise_populate(start, end - start):
            self._pwrite_chunk(chunk)
            return
        base = self.bytes_view().data_ptr()
        for offset, address, nbytes in chunk:
            ctypes.memmove(base + offset, address, nbytes)  # (releases the GIL)

    def copy_bytes(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        if not self.populated:
            self._pwrite(offset, view)
            return
        self.mm[offset: offset + len(view)] = view

    def _pwrite(self, offset: int, view: memoryview) -> None:
        if offset + len(view) > self.capacity:
            raise ValueError(f"{len(view)} bytes at {offset} do not fit staging buffer {self.id} ({self.capacity})")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def close(self) -> None:
        for hook in list(_close_hooks):
            fn = hook()
            if fn is None:
                _close_hooks.remove(hook)
            else:
                fn(self)
        self._u8 = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes when it does
            log.debug("staging buffer %d still referenced at close", self.id)
        try:
            os.close(self.fd)
        except OSError:
            pass


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _default_lanes() -> int:
    """As many threads as a warm copy uses (torch's intra-op threads), at most _MAX_LANES."""
    import torch

    return max(1, min(_MAX_LANES, torch.get_num_threads(), os.cpu_count() or 1))


def _chunks(pieces: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """PIECES (offset, address, nbytes) cut at multiples of _CHUNK and grouped by chunk, in offset order."""
    out: list[list[tuple[int, int, int]]] = []
    last = -1
    for offset, address, nbytes in sorted(pieces):
        while nbytes:
            index = offset // _CHUNK
            n = min(nbytes, (index + 1) * _CHUNK - offset)
            if index != last:
                out.append([])
                last = index
            out[-1].append((offset, address, n))
            offset, address, nbytes = offset + n, address + n, nbytes - n
    return out


def _run_lanes(chunks: list[Any], lanes: int, front: Any, back: Any) -> None:
    """FRONT(chunk) on this thread from the first chunk on, BACK(chunk) on LANES-1 helper threads from the last one
    back, until they meet. (This thread takes the cheaper lane: if the helpers get no core, the fill costs what
    FRONT alone would.) The first error stops every lane (after its current chunk) and is raised."""
    lock = threading.Lock()
    bounds = [0, len(chunks)]
    errors: list[BaseException] = []

    def take(from_front: bool) -> Any:
        with lock:
            if errors or bounds[0] >= bounds[1]:
                return None
            if from_front:
                bounds[0] += 1
                return chunks[bounds[0] - 1]
            bounds[1] -= 1
            return chunks[bounds[1]]

    def lane(from_front: bool) -> None:
        try:
            while (chunk := take(from_front)) is not None:
                (front if from_front else back)(chunk)
        except BaseException as exc:  # (this thread's interruption included: the helpers stop, then it is raised)
            with lock:
                errors.append(exc)

    helpers = [threading.Thread(target=lane, args=(False,), name="nvrx-ckpt-fill", daemon=True) for _ in range(lanes - 1)]
    for t in helpers:
        t.start()
    lane(True)
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]


def _plain_cpu(tensor: Any) -> bool:
    """TENSOR's bytes lie in this process's memory exactly as they are saved (contiguous, CPU, no lazy bits)."""
    import torch

    return tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_quantized \
        and not tensor.is_conj() and not tensor.is_neg() and tensor.is_contiguous()


class StagingPool:
    """Reusable staging buffers of one process. ``acquire`` prefers the smallest free buffer that fits."""

    def __init__(self, keep_free: int = 1) -> None:
        self.keep_free = keep_free
        self._buffers: list[StagingBuffer] = []
        self._lock = threading.Lock()
        self.created = 0  # buffers made so far (reserved or by a save): a save that found one ready adds none
        self.reserved = 0  # the largest reservation asked for

    def reserve(self, nbytes: int) -> bool:
        """Have a buffer of NBYTES ready for the next save: allocated now, its pages faulted in on a thread.

        Returns False when a free (or still warming) buffer of that size was there already."""
        with self._lock:
            self.reserved = max(self.reserved, nbytes)
            if any(b.capacity >= nbytes and (not b.in_use or b.warming is not None) for b in self._buffers):
                return False
            buf = StagingBuffer(nbytes)
            self.created += 1
            buf.in_use = True
            buf.warming = threading.Event()
            self._buffers.append(buf)
        threading.Thread(target=self._warm, args=(buf,), name="nvrx-ckpt-reserve", daemon=True).start()
        return True

    def _warm(self, buf: StagingBuffer) -> None:
        try:
            buf.populate()
        finally:
            with self._lock:
                buf.in_use = False
                event, buf.warming = buf.warming, None
            if event is not None:
                event.set()

    def wait_reserved(self) -> None:
        """Block until every reservation made by ``reserve`` is faulted in."""
        with self._lock:
            events = [b.warming for b in self._buffers if b.warming is not None]
        for event in events:
            event.wait()

    def acquire(self, nbytes: int, populate: bool = True) -> StagingBuffer:
        """A free buffer of at least NBYTES. POPULATE=False: a new one is left unpopulated for a caller that
        copies only through ``fill`` / ``copy_tensor`` / ``copy_bytes`` (they allocate its pages as they fill them)."""
        with self._lock:
            pending = [b.warming for b in self._buffers if b.warming is not None and b.capacity >= nbytes]
        for event in pending:  # a reserved buffer that fits is still being faulted in: it is worth the wait
            event.wait()
        with self._lock:
            free = [b for b in self._buffers if not b.in_use]
            fitting = sorted((b for b in free if b.capacity >= nbytes), key=lambda b: b.capacity)
            if fitting:
                buf = fitting[0]
            else:
                for small in free:  # a free buffer that is too small is replaced, not kept beside the new one
                    self._drop(small)
                buf = StagingBuffer(nbytes)
                self.created += 1
                self._buffers.append(buf)
                if 0 < self.reserved < nbytes:
                    log.debug("this save needs %d bytes of staging, more than the %d reserved: it gets a new buffer "
                              "(faulted in while training waits, as without a reservation)", nbytes, self.reserved)
                if populate:
                    buf.populate()  # one call that allocates every page beats a page fault per 4 KiB in the copy
                log.debug("new staging buffer %d of %d bytes", buf.id, buf.capacity)
            buf.in_use = True
            return buf

    def release(self, buf: StagingBuffer) -> None:
        if buf.fresh and not buf.populated:  # its first save filled it by pwrite: map it (background) for the next
            threading.Thread(target=buf.map_pages, name="nvrx-ckpt-map", daemon=True).start()
        with self._lock:
            buf.in_use = False
            buf.fresh = False
            free = [b for b in self._buffers if not b.in_use]
            for extra in sorted(free, key=lambda b: b.capacity)[: max(0, len(free) - self.keep_free)]:
                self._drop(extra)

    def _drop(self, buf: StagingBuffer) -> None:
        self._buffers.remove(buf)
        buf.close()

    def close(self) -> None:
        with self._lock:
            for buf in list(self._buffers):
                self._drop(buf)

    @property
    def buffers(self) -> list[StagingBuffer]:
        return list(self._buffers)


class FdWriter(io.RawIOBase):
    """Sequential writes to an open fd that never stop short (what torch.save needs from a stream).

    A full disk raises OSError (ENOSPC) instead of returning a short count.
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.pos = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.pos + done)
        self.pos += done
        return done


class StagingFile(FdWriter):
    """A growable memfd written sequentially (a whole torch.save stream); the writer reads it through its fd."""

    def __init__(self) -> None:
        super().__init__(os.memfd_create("nvrx-ckpt-file", os.MFD_CLOEXEC))
        self.in_use = False

    def rewind(self) -> None:
        self.pos = 0

    def close(self) -> None:
        if not self.closed:
            try:
                os.close(self.fd)
            except OSError:
                pass
        super().close()


class StagingFilePool:
    """Reusable staging files (pages stay allocated between saves: warm saves do not fault them in again)."""

    def __init__(self, keep_free: int = 1) -> None:
        self.keep_free = keep_free
        self._files: list[StagingFile] = []
        self._lock = threading.Lock()

    def acquire(self) -> StagingFile:
        with self._lock:
            for f in self._files:
                if not f.in_use:
                    break
            else:
                f = StagingFile()
                self._files.append(f)
            f.in_use = True
            f.rewind()
            return f

    def release(self, f: StagingFile) -> None:
        with self._lock:
            f.in_use = False
            free = [x for x in self._files if not x.in_use]
            for extra in free[self.keep_free:]:
                self._files.remove(extra)
                extra.close()


@functools.cache
def default_file_pool() -> StagingFilePool:
    """This process's staging files (created on first use)."""
    return StagingFilePool()


@functools.cache
def default_pool() -> StagingPool:
    """This process's staging buffers (created on first use)."""
    return StagingPool()
