"""Staging buffers filled without page faults: a new buffer gets plain CPU tensors by pwrite into its memfd, other
tensors through its mapping; what the writer process reads (the memfd) is exactly the values, and mapping the
pages afterwards (for warm copies) changes none of them. Real memfds, a real save through the writer process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from nvrx import ckpt
from nvrx.ckpt.async_ckpt.staging import StagingPool, align


def memfd_bytes(buf, offset: int, nbytes: int) -> bytes:
    return os.pread(buf.fd, nbytes, offset)  # what another process reading the memfd sees


def test_a_new_buffer_takes_mixed_tensors_without_populating_and_keeps_them_when_mapped() -> None:
    pool = StagingPool()
    plain = torch.arange(100_000, dtype=torch.float32)
    strided = torch.arange(60, dtype=torch.int64).reshape(6, 10).t()  # not contiguous: through the mapping
    half = torch.linspace(0, 1, 33, dtype=torch.bfloat16)
    offsets = [0, align(plain.nbytes), align(plain.nbytes) + align(strided.nbytes)]
    total = offsets[2] + half.nbytes + 16
    buf = pool.acquire(total, populate=False)
    assert buf.fresh and not buf.populated
    buf.copy_tensor(offsets[0], plain)
    buf.copy_tensor(offsets[1], strided)
    buf.copy_tensor(offsets[2], half)
    buf.copy_bytes(offsets[2] + half.nbytes, b"0123456789abcdef")
    assert not buf.populated  # no MADV_POPULATE_WRITE pass: pwrite allocated the pages it filled
    expected = [plain.numpy().tobytes(), strided.contiguous().numpy().tobytes(),
                half.contiguous().view(torch.int16).numpy().tobytes(), b"0123456789abcdef"]
    starts = [*offsets, offsets[2] + half.nbytes]
    for start, data in zip(starts, expected):
        assert memfd_bytes(buf, start, len(data)) == data
    pool.release(buf)  # maps the pages on a thread, for the next save's copies
    for t in [t for t in threading.enumerate() if t.name == "nvrx-ckpt-map"]:
        t.join(10)
    assert buf.populated and not buf.fresh
    for start, data in zip(starts, expected):
        assert memfd_bytes(buf, start, len(data)) == data
    again = pool.acquire(total, populate=False)
    assert again is buf
    again.copy_tensor(offsets[0], plain * 2)  # warm now: through the mapping
    assert memfd_bytes(buf, 0, plain.nbytes) == (plain * 2).numpy().tobytes()
    pool.close()


def test_first_and_later_saves_of_an_unprepared_state_round_trip(tmp_path: Path) -> None:
    cp = ckpt.AsyncCheckpointer()
    state = {"w": torch.randn(300, 200), "t": torch.randn(50, 40).t(), "n": 7}
    for step in range(3):
        saved = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        cp.async_save(state, tmp_path / f"step_{step}")
        for value in (state["w"], state["t"]):
            value.add_(1.0)  # the training step right after the call
        state["n"] += 1
        cp.wait()
    target = {"w": torch.zeros(300, 200), "t": torch.zeros(40, 50), "n": 0}
    assert ckpt.load_latest(tmp_path, target).path.name == "step_2"
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["t"], saved["t"])
    assert target["n"] == 9
    cp.finalize_before_exit()
