"""A new staging buffer filled by several lanes (``StagingBuffer.fill``): one pwrites chunks from the front, the others
populate chunks from the back and copy through the mapping. What another process reads from the memfd must be
exactly the values, across chunk boundaries, for odd sizes, for tensors the lanes cannot take (non-contiguous,
conjugate views: copied through the mapping), when populating fails, when a lane fails, and after the buffer is
released and reused warm. Chunks are made tiny here so a small state spans many of them."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from nvrx import ckpt
from nvrx.ckpt.async_ckpt import staging
from nvrx.ckpt.async_ckpt.staging import StagingPool, align
from nvrx.ckpt.snapshot import capture

CHUNK = 4 * mmap.PAGESIZE


@pytest.fixture(autouse=True)
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_CHUNK", CHUNK)
    monkeypatch.setattr(staging, "_default_lanes", lambda: 2)


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.dtype in (torch.bfloat16, torch.complex64) \
        else t.numpy().tobytes()


def mixed_state() -> list[tuple[str, object]]:
    """Tensors of odd sizes (not multiples of a chunk or a page), some spanning many chunks, and bytes."""
    gen = torch.Generator().manual_seed(3)
    return [
        ("big", torch.randn(10 * CHUNK // 4 + 7, generator=gen)),  # 10+ chunks, ends mid-page
        ("odd", torch.randint(0, 255, (CHUNK + 13,), dtype=torch.uint8, generator=gen)),
        ("empty", torch.empty(0)),
        ("strided", torch.arange(7 * 999, dtype=torch.int64).reshape(7, 999).t()),  # through the mapping
        ("conj", torch.randn(301, dtype=torch.complex64, generator=gen).conj()),  # a lazy view: through the mapping
        ("param", torch.nn.Parameter(torch.randn(3 * CHUNK // 4 + 1, generator=gen))),
        ("half", torch.linspace(0, 1, 2 * CHUNK // 2 + 3, dtype=torch.bfloat16)),
        ("blob", bytes(range(256)) * 9 + b"tail"),
    ]


def layout(items: list[tuple[str, object]]) -> tuple[list[tuple[int, object]], int]:
    copies, offset = [], 0
    for _, value in items:
        copies.append((offset, value))
        offset = align(offset + (len(value) if isinstance(value, bytes) else value.numel() * value.element_size()))
    return copies, offset


def expected(value: object) -> bytes:
    return value if isinstance(value, bytes) else tensor_bytes(value)


def assert_memfd_holds(buf, copies) -> None:
    for offset, value in copies:
        data = expected(value)
        assert os.pread(buf.fd, len(data), offset) == data, f"bytes at {offset} differ"


def wait_mapped() -> None:
    for t in [t for t in threading.enumerate() if t.name == "nvrx-ckpt-map"]:
        t.join(10)


def test_chunks_cut_pieces_at_chunk_multiples_and_keep_every_byte() -> None:
    pieces = [(100, 10_000, 3 * CHUNK), (align(100 + 3 * CHUNK), 90_000, 5), (5 * CHUNK, 1 << 20, CHUNK + 1)]
    chunks = staging._chunks(pieces)
    covered = []
    for chunk in chunks:
        index = chunk[0][0] // CHUNK
        for offset, address, n in chunk:
            assert offset // CHUNK == index and (offset + n - 1) // CHUNK == index  # no piece crosses a boundary
            covered.append((offset, address, n))
    for offset, address, nbytes in pieces:  # every piece is rebuilt exactly from its parts, addresses in step
        parts = sorted(p for p in covered if offset <= p[0] < offset + nbytes)
        assert parts[0][0] == offset and sum(p[2] for p in parts) == nbytes
        assert all(p[1] - address == p[0] - offset for p in parts)
    assert len(chunks) == len({c[0][0] // CHUNK for c in chunks})


def test_two_lanes_fill_a_new_buffer_exactly_and_it_is_reused_warm() -> None:
    pool = StagingPool()
    items = mixed_state()
    copies, total = layout(items)
    buf = pool.acquire(total, populate=False)
    assert not buf.populated
    seen = {"front": 0, "back": 0}
    front_done, back_started = threading.Event(), threading.Event()
    pwrite_chunk, map_and_copy = buf._pwrite_chunk, buf._map_and_copy

    def front(chunk):
        back_started.wait(10)  # both lanes take part in this fill, whatever the scheduling
        pwrite_chunk(chunk)
        seen["front"] += 1
        front_done.set()

    def back(chunk):
        back_started.set()
        front_done.wait(10)
        map_and_copy(chunk)
        seen["back"] += 1

    buf._pwrite_chunk, buf._map_and_copy = front, back
    buf.fill(copies)
    assert seen["front"] >= 1 and seen["back"] >= 1
    assert not [t for t in threading.enumerate() if t.name == "nvrx-ckpt-fill"]
    assert_memfd_holds(buf, copies)
    del buf._pwrite_chunk, buf._map_and_copy
    pool.release(buf)
    wait_mapped()
    assert buf.populated
    assert_memfd_holds(buf, copies)  # mapping the pages changed none of them
    again = pool.acquire(total, populate=False)
    assert again is buf
    changed = [(off, v * 3 if isinstance(v, torch.Tensor) and v.dtype != torch.uint8 else v) for off, v in copies]
    with torch.no_grad():
        again.fill(changed)  # warm: through the mapping
    assert_memfd_holds(again, changed)
    pool.close()


def test_one_lane_and_a_failed_populate_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    items = mixed_state()
    copies, total = layout(items)
    pool = StagingPool(keep_free=3)
    one = pool.acquire(total, populate=False)
    one.fill(copies, lanes=1)
    refused = pool.acquire(total, populate=False)
    monkeypatch.setattr(refused, "_madvise_populate", lambda *a: False)  # e.g. a kernel without MADV_POPULATE_WRITE
    refused.fill(copies, lanes=2)
    for buf in (one, refused):
        assert_memfd_holds(buf, copies)
    pool.close()


def test_a_failing_lane_stops_the_fill_and_leaves_no_thread() -> None:
    copies, total = layout(mixed_state())
    pool = StagingPool()
    buf = pool.acquire(total, populate=False)

    def broken(*args):
        raise OSError(28, "No space left on device")

    # Both lanes fail: which lane takes the first chunk depends on scheduling (a helper lane that gets a core
    # first can fill everything before the caller's pwrite lane starts), and either failing must end the fill.
    buf._pwrite_chunk = broken
    buf._map_and_copy = broken
    with pytest.raises(OSError, match="No space"):
        buf.fill(copies, lanes=2)
    assert not [t for t in threading.enumerate() if t.name == "nvrx-ckpt-fill"]
    pool.release(buf)
    pool.close()


def test_a_copy_that_does_not_fit_is_refused_before_anything_runs() -> None:
    pool = StagingPool()
    buf = pool.acquire(1, populate=False)
    with pytest.raises(ValueError, match="do not fit"):
        buf.fill([(buf.capacity - 8, torch.zeros(4))])
    pool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU tensor needs a GPU (copied through the mapping)")
def test_a_gpu_tensor_goes_through_the_mapping() -> None:
    pool = StagingPool()
    value = torch.randn(3 * CHUNK // 4 + 5, device="cuda")
    buf = pool.acquire(value.numel() * 4, populate=False)
    buf.fill([(0, value)])
    assert os.pread(buf.fd, value.numel() * 4, 0) == value.cpu().numpy().tobytes()
    pool.close()


def test_a_snapshot_of_a_new_state_holds_its_values() -> None:
    pool = StagingPool()
    state = {"a": torch.randn(5 * CHUNK // 4 + 3), "b": [torch.arange(999, dtype=torch.int32).reshape(9, 111).t()],
             "c": {"d": torch.randn(CHUNK // 4 - 1, dtype=torch.float64)}, "n": 5}
    snap = capture(state, pool=pool)
    assert torch.equal(snap.state["a"], state["a"]) and torch.equal(snap.state["b"][0], state["b"][0])
    assert torch.equal(snap.state["c"]["d"], state["c"]["d"]) and snap.state["n"] == 5
    start = snap.state["a"].data_ptr() - snap.buffer.bytes_view().data_ptr()
    assert os.pread(snap.buffer.fd, state["a"].nbytes, start) == state["a"].numpy().tobytes()
    snap.release()
    pool.close()


def test_a_first_save_filled_by_lanes_round_trips(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    state = {"w": torch.randn(333, 77), "t": torch.randn(150, 41).t(), "e": torch.zeros(0), "n": 7}
    for step in range(2):
        saved = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        cp.async_save(state, tmp_path / f"step_{step}")
        for value in (state["w"], state["t"]):
            value.add_(1.0)  # the training step right after the call
        cp.wait()
    target = {"w": torch.zeros(333, 77), "t": torch.zeros(41, 150), "e": torch.zeros(0), "n": 0}
    assert ckpt.load_latest(tmp_path, target).path.name == "step_1"
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["t"], saved["t"])
    assert target["n"] == 7
    cp.finalize_before_exit()
