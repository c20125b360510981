"""A staging failure on one rank of two (real processes, gloo): both ranks raise the same clear error at the
save call, nobody hangs in finalize, nothing half-written is left, the previous checkpoint stays `latest` and
loadable, and the next save - even to the same name - works."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import ckpt
from tests.conftest import tagged_processes

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
JOIN_TIMEOUT = 120.0  # the ranks' own gloo timeout is 20 s: a rank stuck in a collective ends long before this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(work: Path) -> tuple[list[dict], str]:
    token = uuid.uuid4().hex
    env = dict(os.environ, NVRX_TEST_TOKEN=token, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(HERE / "staging_fault_ranks.py"), str(r), port, str(work)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=JOIN_TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} did not finish within {JOIN_TIMEOUT:.0f}s: a staging failure made it hang")
            assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.poll() is not None for p in procs)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in (0, 1)], token


def test_staging_failure_on_one_rank_is_agreed_by_all_ranks(tmp_path: Path) -> None:
    ranks, token = run_ranks(tmp_path)
    root = tmp_path / "root"
    for case, injected in (("A", "rank 1: MemoryError: cannot allocate"), ("B", "rank 1: RuntimeError: device lost")):
        errors = [r[case]["error"] for r in ranks]
        assert errors[0] is not None and errors[0] == errors[1], (case, errors)  # the same error on both ranks
        assert f"{root / 'step_2'} was not saved" in errors[0] and injected in errors[0], errors[0]
        assert "every rank abandoned this save and the previous checkpoint is intact" in errors[0]
        assert "rank 0:" not in errors[0] and "\n" not in errors[0]
        for r in ranks:
            assert r[case]["pending"] == 0  # nothing scheduled that a later maybe_finalize would wait on
            assert r[case]["listing"] == {"visible": ["latest", "step_1"], "hidden": [], "latest": "step_1"}, case
            assert r[case]["step_1"] == 1.0  # the previous checkpoint loads (collectively, on both ranks)
    for r in ranks:
        assert r["after"] == {"visible": ["latest", "step_1", "step_2"], "hidden": [], "latest": "step_2"}
        assert r["step_2"] == 4.0
        assert r["writer_pid_after"] == r["writer_pid"]  # the persistent writer survived both failures
    ckpt.verify_checkpoint(root / "step_1")
    ckpt.verify_checkpoint(root / "step_2")
    assert tagged_processes(token) == []  # ranks and their writer processes are gone
