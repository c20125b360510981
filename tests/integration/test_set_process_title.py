"""``nvrx.common.process.set_process_title`` in real processes, checked from outside through /proc.

Each probe process sets a title, reports what it sees itself (``sys.argv``, ``os.environ``, C
``getenv``) on stdout, then waits for EOF on stdin while the test reads its ``/proc/PID/cmdline``
and ``/proc/PID/comm``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE_VALUE = "probe value = ünïcode"

PROBE = r'''
import ctypes, json, logging, os, sys
from nvrx.common.process import set_process_title

logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
argv, environ = list(sys.argv), dict(os.environ)
changed = set_process_title(json.loads(os.environ["TITLE"]))
print(json.dumps({
    "changed": changed,
    "argv_unchanged": sys.argv == argv,
    "environ_unchanged": dict(os.environ) == environ,
    "getenv_probe": (libc.getenv(b"NVRX_TITLE_PROBE") or b"").decode(),
    "getenv_mismatches": sorted(k.decode() for k, v in os.environb.items() if libc.getenv(k) != v),
}), flush=True)
sys.stdin.read()
'''


class Probe:
    """A process that set TITLE and waits for the test to look at it."""

    def __init__(self, tmp_path: Path, title: list[str], prefix: list[str] = ()) -> None:
        script = tmp_path / "p.py"  # a short original command line: long titles overflow it
        script.write_text(PROBE)
        env = {**os.environ, "PYTHONPATH": str(REPO), "TITLE": json.dumps(title), "NVRX_TITLE_PROBE": PROBE_VALUE}
        self.proc = subprocess.Popen([*prefix, sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if not line:
            self.stderr = self.proc.communicate()[1]
            self.report: dict = {}
        else:
            self.report = json.loads(line)
        self.pid = self.proc.pid

    def cmdline(self) -> bytes:
        return Path(f"/proc/{self.pid}/cmdline").read_bytes()

    def comm(self) -> str:
        return Path(f"/proc/{self.pid}/comm").read_text().rstrip("\n")

    def finish(self) -> str:
        _, err = self.proc.communicate(timeout=60)  # safety net only: EOF on stdin ends the probe at once
        assert self.proc.returncode == 0, err
        return err


@pytest.fixture
def probe(tmp_path):
    started: list[Probe] = []

    def start(title: list[str], prefix: list[str] = ()) -> Probe:
        p = Probe(tmp_path, title, list(prefix))
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.communicate()


def assert_unobservable_inside(report: dict) -> None:
    assert report["argv_unchanged"] and report["environ_unchanged"]
    assert report["getenv_probe"] == PROBE_VALUE
    assert report["getenv_mismatches"] == []


def test_a_title_that_fits_is_shown_as_separate_arguments(probe):
    title = ["/usr/bin/python3", "-u", "t.py", "a b"]  # shorter than `python .../p.py`
    p = probe(title)
    assert p.report["changed"] is True
    raw = p.cmdline()
    shown = b"\0".join(a.encode() for a in title) + b"\0"
    assert raw.startswith(shown) and raw[len(shown):].strip(b"\0") == b""
    assert psutil.Process(p.pid).cmdline()[:len(title)] == title
    assert p.comm() == "python3"
    assert_unobservable_inside(p.report)
    p.finish()


def test_a_longer_title_overflows_into_the_environment_area_as_one_string(probe):
    title = ["/usr/bin/python3", "-u", "train.py", "--data", "/datasets/" + "x" * 300, "--lr=0.1"]
    p = probe(title)
    assert p.report["changed"] is True
    assert p.cmdline() == " ".join(title).encode() + b"\0"
    assert psutil.Process(p.pid).cmdline() == title  # psutil splits a one-string title at spaces
    assert p.pid in {q.pid for q in psutil.process_iter(["cmdline"])
                     if "train.py --data" in " ".join(q.info["cmdline"] or ())}
    # the environment strings it overwrote were moved first: C getenv and os.environ still agree
    assert_unobservable_inside(p.report)
    p.finish()


def test_the_name_is_the_basename_cut_to_15_bytes(probe):
    p = probe(["/opt/envs/bin/python3.11-debug-build", "-u", "t.py"])
    assert p.comm() == "python3.11-debu"
    p.finish()


def test_pgrep_finds_the_title(probe):
    pgrep = shutil.which("pgrep")
    if pgrep is None:
        pytest.skip("no pgrep here (the psutil match above covers the same)")
    p = probe(["python3", "-u", "train.py", "--run=pgrep-probe-7f3a"])
    found = subprocess.run([pgrep, "-f", "train.py --run=pgrep-probe-7f3a"], capture_output=True, text=True).stdout
    assert str(p.pid) in found.split()
    p.finish()


def test_without_proc_it_only_logs_one_debug_line(probe, tmp_path):
    # a private mount namespace whose /proc is an empty tmpfs: /proc/self/stat cannot be read
    unshare = shutil.which("unshare")
    hide_proc = [unshare, "-rm", "sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh"] if unshare else None
    if hide_proc is None or subprocess.run([*hide_proc, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a mount namespace here (needs user namespaces)")
    p = probe(["python3", "-u", "t.py"], prefix=hide_proc)
    assert p.report["changed"] is False
    assert_unobservable_inside(p.report)
    lines = [ln for ln in p.finish().splitlines() if ln.startswith("nvrx.common.process")]
    assert len(lines) == 1 and "process title not set" in lines[0], lines
