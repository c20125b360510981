"""Ranks started by `nvrx launch` show torchrun's command line: `<python> -u train.py ARGS`.

Forked from the template process they would otherwise show the template's command line; spawned,
`python -m nvrx.launcher.rank.bootstrap ...`. Each rank reports to the test over a Unix socket, then waits
while the test reads its /proc/PID/cmdline and /proc/PID/comm and matches it the way `pgrep -f` does.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import write_script


PROBE_VALUE = "probe value"
NPROC = 2

RANK = r'''
import ctypes, json, os, socket, sys

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
report = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv,
          "environ_probe": os.environ.get("NVRX_TITLE_PROBE"),
          "getenv_probe": (libc.getenv(b"NVRX_TITLE_PROBE") or b"").decode(),
          "getenv_mismatches": sorted(k.decode() for k, v in os.environb.items() if libc.getenv(k) != v)}
with socket.socket(socket.AF_UNIX) as s:
    s.connect("\0" + sys.argv[1])
    s.sendall((json.dumps(report) + "\n").encode())
    s.recv(1)  # the test reads our /proc entries meanwhile
'''


def _collect_reports(server: socket.socket, launch: subprocess.Popen) -> tuple[list[dict], list[socket.socket]]:
    """Every rank's report, waiting on the socket and on the launch's exit (which means they never come)."""
    reports, conns = [], []
    launch_ended = os.pidfd_open(launch.pid)
    try:
        while len(conns) < NPROC:
            ready, _, _ = select.select([server, launch_ended], [], [], 120)  # the timeout is a safety net only
            if server not in ready:
                launch.kill()
                raise AssertionError(f"the ranks did not report; nvrx launch said:\n{launch.communicate()[1]}")
            conn, _ = server.accept()
            conns.append(conn)
            reports.append(json.loads(conn.makefile().readline()))
    finally:
        os.close(launch_ended)
    return reports, conns


def _matches_pgrep_f(pattern: str) -> set[int]:
    """Pids whose command line contains PATTERN, as `pgrep -f` matches (through psutil)."""
    return {p.pid for p in psutil.process_iter(["cmdline"]) if pattern in " ".join(p.info["cmdline"] or ())}


@pytest.mark.parametrize("fork_server, module", [(True, False), (False, False), (True, True)],
                         ids=["forked", "spawned", "forked-module"])
def test_ranks_show_the_command_line_torchrun_would_give_them(launcher, tmp_path, fork_server, module):
    name = f"nvrx-title-{uuid.uuid4().hex[:12]}"
    write_script(tmp_path / ("trainmod.py" if module else "train.py"), RANK)
    entry = ["-m", "trainmod"] if module else ["train.py"]
    # The long argument makes a forked rank's title overflow the template's short argument area; a spawned
    # rank's always fits (`-m nvrx.launcher.rank.bootstrap` is longer than `-u`).
    args = [name, "--data=/datasets/" + "x" * 200]
    expected = [sys.executable, "-u", *entry, *args]
    server = socket.socket(socket.AF_UNIX)
    server.bind("\0" + name)
    server.listen(NPROC)
    launch = launcher.start("--nproc-per-node", str(NPROC), "--rdzv-id", name,
                            "--fork-server" if fork_server else "--no-fork-server",
                            *(["-m", "trainmod"] if module else ["train.py"]), *args,
                            env={"NVRX_TITLE_PROBE": PROBE_VALUE})
    conns: list[socket.socket] = []
    try:
        reports, conns = _collect_reports(server, launch)
        pgrep_hits = _matches_pgrep_f(" ".join(expected[1:]))
        for r in reports:
            pid = r["pid"]
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            if fork_server:  # overflowed: one string, as setproctitle(3) shows it
                assert raw == " ".join(expected).encode() + b"\0"
            else:  # fits: NUL-separated arguments, the rest of the area zeros
                assert raw.rstrip(b"\0") == b"\0".join(map(os.fsencode, expected))
            assert psutil.Process(pid).cmdline()[:len(expected)] == expected
            assert Path(f"/proc/{pid}/comm").read_text().strip() == os.path.basename(sys.executable)[:15]
            assert pid in pgrep_hits
            parent = " ".join(psutil.Process(r["ppid"]).cmdline())
            assert ("nvrx.launcher.agent.fork_server" in parent) == fork_server, parent
            # what the script itself sees is untouched
            assert r["argv"][1:] == args
            assert r["argv"][0] == (str(tmp_path / "trainmod.py") if module else "train.py")
            assert r["environ_probe"] == r["getenv_probe"] == PROBE_VALUE
            assert r["getenv_mismatches"] == []
        if shutil.which("pgrep"):
            pattern = " ".join(["-u", *entry, *args])
            found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
            assert {r["pid"] for r in reports} <= set(map(int, found.stdout.split()))
    finally:
        for conn in conns:
            conn.sendall(b"x")
            conn.close()
        server.close()
        _, err = launch.communicate(timeout=120)
    assert launch.returncode == 0, err
    assert launcher.leftovers() == []
