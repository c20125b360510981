"""Fixtures for the checkpoint tests: small real file systems (tmpfs) for disk-full and read-only cases."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest


def _mount(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """make(size="2m") -> a fresh tmpfs of that size (skips, saying why, where mounting is impossible)."""
    mounts: list[Path] = []

    def make(size: str = "2m", name: str = "mnt") -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root (disk-full and read-only cases)")
        target = tmp_path / name
        target.mkdir()
        done = _mount(["-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(target)])
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(target)
        return target

    yield make
    for target in reversed(mounts):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def remount(target: Path, mode: str) -> None:
    """Switch a test mount to 'ro' or 'rw'."""
    done = _mount(["-o", f"remount,{mode}", str(target)])
    assert done.returncode == 0, done.stderr
