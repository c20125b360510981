"""Write staged checkpoint data to files in the DCP layout, make it durable, and read back its checksums.

Used by the writer process (the normal, asynchronous path) and in-process by the synchronous
``FileSystemWriterAsync.write_data``. The input is a staging buffer (bytes already copied out of
the training state) plus a JSON description of which byte ranges go to which file. Each tensor
item becomes one ``torch.save`` blob (the DCP on-disk format); a bytes item is copied verbatim.

Checksums: ``torch.save`` writes a zip whose central directory holds the CRC-32 of every member,
so the CRC of a tensor's data is computed once, while it is written, and read back from the
blob's directory (a few hundred bytes) for the manifest. Bytes items get a ``zlib.crc32``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from nvrx.ckpt.async_ckpt.staging import FdWriter

_SYNC_FILE_RANGE_WRITE = 2
_libc: Any = None
_libc_lock = threading.Lock()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing this range to disk now, so the final fsync has less to wait for."""
    global _libc
    with _libc_lock:
        if _libc is None:
            try:
                _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            except (OSError, AttributeError):
                _libc = False
    if _libc:
        _libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class FileSlice(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start+length) of an open file descriptor."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, size: int = -1) -> bytes:
        remaining = max(0, self.length - self.pos)
        size = remaining if size is None or size < 0 else min(size, remaining)
        data = os.pread(self.fd, size, self.start + self.pos) if size else b""
        self.pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _is_data_member(name: str) -> bool:
    parts = name.split("/")
    return len(parts) >= 2 and parts[-2] == "data" and parts[-1].isdigit()


def blob_data_crc(fd: int, start: int, length: int) -> int:
    """CRC-32 of the tensor data inside the torch.save blob at [start, start+length), from its zip directory."""
    with zipfile.ZipFile(FileSlice(fd, start, length)) as zf:
        crcs = [info.CRC for info in zf.infolist() if _is_data_member(info.filename)]
    return crcs[0] if crcs else 0


def verify_blob(fd: int, start: int, length: int, expected_crc: int) -> str | None:
    """Re-read a torch.save blob: every member must match its CRC, the data CRC the recorded one.

    Returns None when the blob is intact, else what is wrong.
    """
    try:
        with zipfile.ZipFile(FileSlice(fd, start, length)) as zf:
            found = 0
            for info in zf.infolist():
                with zf.open(info) as member:  # zipfile raises BadZipFile on a CRC mismatch at EOF
                    while member.read(1 << 24):
                        pass
                if _is_data_member(info.filename):
                    found = info.CRC
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        return f"damaged data ({exc})"
    if found != expected_crc:
        return f"checksum {found:#010x} differs from the recorded {expected_crc:#010x}"
    return None


def verify_bytes(fd: int, start: int, length: int, expected_crc: int) -> str | None:
    crc, pos, end = 0, start, start + length
    while pos < end:
        chunk = os.pread(fd, min(1 << 24, end - pos), pos)
        if not chunk:
            return "file is shorter than recorded"
        crc = zlib.crc32(chunk, crc)
        pos += len(chunk)
    if crc != expected_crc:
        return f"checksum {crc:#010x} differs from the recorded {expected_crc:#010x}"
    return None


def _tensor_from(buffer: memoryview, item: dict[str, Any]) -> Any:
    import torch

    dtype = getattr(torch, item["dtype"])
    nbytes = item["nbytes"]
    if nbytes == 0:
        return torch.empty(item["shape"], dtype=dtype)
    raw = torch.frombuffer(buffer[item["off"]: item["off"] + nbytes], dtype=torch.uint8)
    return raw.view(dtype).reshape(item["shape"])


class _FileStream(FdWriter):
    """A checkpoint file being written; keeps the OSError a write raised (ENOSPC, EIO, ...) to report it."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.error: OSError | None = None  # torch.save hides a failed write behind its own message; keep ours

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            self.error = exc
            raise

    def save(self, tensor: Any) -> None:
        import torch

        try:
            torch.save(tensor, self)
        except Exception:
            if self.error is not None:
                raise self.error from None
            raise


def _write_one_file(buffer: memoryview, directory: str, spec: dict[str, Any], fsync: bool,
                    wait_staged: Callable[[int], None] | None = None) -> dict[str, Any]:
    path = os.path.join(directory, spec["name"])
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)  # read: the blobs' zip directories
    results = []
    try:
        out = _FileStream(fd)
        for item in spec["items"]:
            if wait_staged is not None:  # the trainer may still be copying this item into the buffer
                wait_staged(item["off"] + item["nbytes"])
            start = out.tell()
            if item["kind"] == "tensor":
                tensor = _tensor_from(buffer, item)
                out.save(tensor)
                del tensor
                length = out.tell() - start
                crc = blob_data_crc(fd, start, length)
            else:
                view = buffer[item["off"]: item["off"] + item["nbytes"]]
                out.write(view)
                length = out.tell() - start
                crc = zlib.crc32(view)
            results.append({"offset": start, "length": length, "crc32": crc})
            if fsync and length >= (1 << 20):
                _start_writeback(fd, start, length)
        size = out.tell()
        if fsync:
            os.fsync(fd)
    except OSError as exc:
        if exc.filename is None:  # say which file (a write error alone names none)
            raise OSError(exc.errno, exc.strerror, path) from None
        raise
    finally:
        os.close(fd)
    return {"name": spec["name"], "size": size, "items": results}


def write_files(buffer: memoryview, directory: str, files: list[dict[str, Any]], *, fsync: bool = True,
                wait_staged: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Write FILES (each: name + items) from BUFFER into DIRECTORY, one thread per file; results in order.

    WAIT_STAGED(end), when given, blocks until buffer bytes [0, end) hold their data (the trainer copies
    items in offset order while the files are already being written).
    """
    if len(files) <= 1:
        return [_write_one_file(buffer, directory, spec, fsync, wait_staged) for spec in files]
    with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="nvrx-ckpt-write") as pool:
        futures = [pool.submit(_write_one_file, buffer, directory, spec, fsync, wait_staged) for spec in files]
        return [f.result() for f in futures]


def copy_to_file(src_fd: int, nbytes: int, path: str, *, fsync: bool = True) -> dict[str, Any]:
    """Write the first NBYTES of SRC_FD (a whole torch.save file staged by the trainer) to PATH."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        pos = 0
        while pos < nbytes:
            sent = os.sendfile(fd, src_fd, pos, min(nbytes - pos, 64 << 20))
            if sent == 0:
                raise OSError(f"staged data ended after {pos} of {nbytes} bytes")
            pos += sent
            if fsync:
                _start_writeback(fd, 0, pos)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"name": os.path.basename(path), "size": nbytes, "digest": zip_digest(path, nbytes)}


def zip_digest(path: str, size: int) -> int:
    """A checksum over the CRC-32s a torch.save file's zip directory records for its members (for its sidecar)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with zipfile.ZipFile(FileSlice(fd, 0, size)) as zf:
            crc = 0
            for info in zf.infolist():
                crc = zlib.crc32(info.CRC.to_bytes(4, "little"), crc)
            return crc
    finally:
        os.close(fd)


