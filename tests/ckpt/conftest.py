"""Fixtures and helpers for the checkpoint tests: small real file systems (tmpfs) for disk-full and read-only cases,
child processes that import this repository, two real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.conftest import REPO, free_port


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


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python process that imports this repository's packages."""
    return dict(os.environ, **extra, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def run_rank_procs(script: Path, work: Path, timeout: float, *extra: str, world: int = 2, expect_rc: int = 0) -> str:
    """Run SCRIPT as ranks 0..WORLD-1 (args: RANK PORT WORK *EXTRA), tagged with a fresh token; each must exit
    EXPECT_RC within TIMEOUT. Returns the token (to look for leftover processes)."""
    token = uuid.uuid4().hex
    env = child_env(NVRX_TEST_TOKEN=token)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(work), *extra], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    what = " ".join((script.name, *extra))
    try:
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} of {what} did not finish within {timeout:.0f}s (hung?)")
            assert p.returncode == expect_rc, f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.poll() is not None for p in procs)
    return token


def run_two_ranks(script: Path, work: Path, timeout: float) -> tuple[list[dict], str]:
    """Run SCRIPT as ranks 0 and 1 (args: RANK PORT WORK); each must exit 0 within TIMEOUT. Returns what they
    wrote to WORK/rank<R>.json and the token (to look for leftover processes)."""
    token = run_rank_procs(script, work, timeout)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in (0, 1)], token
