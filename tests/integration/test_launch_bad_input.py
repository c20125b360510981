"""Bad input to `nvrx launch`: one clear line, exit 2, no traceback, nothing left running."""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import one_line_error, write_script


@pytest.fixture
def script(tmp_path):
    return write_script(tmp_path / "ok.py", "print('hello')\n")


@pytest.mark.parametrize("args,needles", [
    ([], ["missing the training script"]),
    (["--nproc-per-node", "two"], ["--nproc-per-node", "'two'"]),
    (["--nproc-per-node", "0"], ["--nproc-per-node", "at least 1"]),
    (["--nnodes", "3:2"], ["MIN (3) is larger than MAX (2)"]),
    (["--nnodes", "2", "--rdzv-endpoint", "host:port:x"], ["--rdzv-endpoint"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:99999"], ["port", "1..65535"]),
    (["--nproc-per-nod", "2"], ["--nproc-per-node"]),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], ["--node-rank 2", "0..1"]),
])
def test_bad_flags(launcher, script, args, needles):
    res = launcher.run(*args, *([str(script)] if args or False else []), timeout=30)
    one_line_error(res, *needles)
    assert launcher.leftovers(wait=0.5) == []


def test_missing_script(launcher, tmp_path):
    res = launcher.run("--nproc-per-node", "2", str(tmp_path / "nope.py"), timeout=30)
    one_line_error(res, "nope.py", "does not exist")


def test_port_in_use_by_another_program(launcher, script):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = launcher.run("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x",
                           "--rdzv-conf", "join_timeout=3", str(script), timeout=60)
    one_line_error(res, str(port), "in use")
    assert launcher.leftovers() == []


def test_unreachable_endpoint_after_bounded_wait(launcher, script):
    t0 = time.monotonic()
    # 192.0.2.1 (TEST-NET-1) is not local: this agent is a client and nobody answers
    res = launcher.run("--nnodes", "2", "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-id", "x",
                       "--rdzv-conf", "join_timeout=2", str(script), timeout=60)
    one_line_error(res, "192.0.2.1:29400", "after")
    assert time.monotonic() - t0 < 30
    assert launcher.leftovers() == []
