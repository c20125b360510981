"""nvrx.common.files.atomic_write, the one home of atomic file writes (issue 25): whole-old or whole-new, the
mode asked for whatever the umask, never through a link, nothing left behind when the write fails."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from nvrx.common.files import atomic_write


def test_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        atomic_write(tmp_path / "a", b"x", mode=0o600)
        atomic_write(tmp_path / "b", b"y", mode=0o644)
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o600 and (tmp_path / "b").stat().st_mode & 0o777 == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f"
    atomic_write(target, b"old")

    def fail(fh) -> None:
        fh.write(b"half")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_concurrent_writers_of_one_file_never_collide(tmp_path: Path) -> None:
    """Many threads of one process (one pid) replace the same file: every call succeeds, one whole value wins."""
    target, errors = tmp_path / "flag", []

    def write(i: int) -> None:
        try:
            for _ in range(50):
                atomic_write(target, f"writer {i}\n".encode())
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and target.read_text().startswith("writer ") and os.listdir(tmp_path) == ["flag"]

