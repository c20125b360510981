"""The suite's own rules (tests/tiers.py, tests/timeouts.py, free_port), checked by running pytest on small test
files with the real plugins: tiers enforced at collection and for unit tests at run time, --package selection,
the per-test timeout's report and kill, and 'alone' tests running with nothing else."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, pid_gone

INI = "[pytest]\naddopts = -p tests.tiers -p tests.timeouts -p tests.durations -p no:cacheprovider\ntimeout = 120\n"


def run_pytest(where: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120
               ) -> subprocess.CompletedProcess:
    """pytest on the files in WHERE with the suite's plugins (imported from this checkout)."""
    (where / "pytest.ini").write_text(INI)
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full.pop("PYTEST_XDIST_WORKER", None)
    full.pop("PYTEST_XDIST_TESTRUNUID", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", *args], check=False, cwd=where, env=full,
                          capture_output=True, text=True, timeout=timeout)


def test_a_test_with_no_tier_or_two_fails_collection_naming_it(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_untiered():\n    pass\n"
        "@pytest.mark.unit\n@pytest.mark.e2e\ndef test_both():\n    pass\n"
        "@pytest.mark.e2e\ndef test_fine():\n    pass\n")
    res = run_pytest(tmp_path)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "test_x.py::test_untiered has no tier" in res.stderr
    assert "test_x.py::test_both has two tier markers (e2e, unit)" in res.stderr
    assert "test_fine" not in res.stderr


def test_the_nearest_tier_marker_wins(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\npytestmark = pytest.mark.e2e\n"
        "def test_module_tier():\n    pass\n"
        "@pytest.mark.unit\ndef test_own_tier():\n    pass\n")
    res = run_pytest(tmp_path, "-m", "unit")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASSED test_x.py::test_own_tier" in res.stdout and "1 passed, 1 deselected" in res.stdout, res.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_the_run_ends_with_time_per_tier_and_the_slowest_tests(tmp_path, workers):
    (tmp_path / "integration").mkdir()  # a directory named like another tier must not decide the tier
    (tmp_path / "integration" / "test_x.py").write_text(
        "import pytest, subprocess, sys\n"
        "@pytest.mark.unit\n@pytest.mark.slow\ndef test_quick():\n    pass\n"
        "@pytest.mark.e2e\ndef test_proc():\n"
        "    subprocess.run([sys.executable, '-c', 'import time; time.sleep(0.3)'], check=True)\n")
    out = tmp_path / "tiers.json"
    res = run_pytest(tmp_path, *workers, "--tier-durations", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "time per tier" in res.stdout
    table = json.loads(out.read_text())
    assert table["tiers"]["unit"]["tests"] == 1 and table["tiers"]["e2e"]["tests"] == 1, table["tiers"]
    assert "integration" not in table["tiers"]
    assert table["tiers"]["e2e"]["seconds"] >= 0.3  # the subprocess's time is the test's
    assert table["slowest"][0] == {"nodeid": "integration/test_x.py::test_proc", "tier": "e2e",
                                   "seconds": table["slowest"][0]["seconds"]}
    # test_quick is marked slow but is not: the audit names it
    assert table["slow_audit"] == {"marked_slow_under": ["integration/test_x.py::test_quick"], "unmarked_over": []}


@pytest.mark.unit
def test_a_file_in_a_tier_directory_takes_its_tier():
    from tests.tiers import TESTS_DIR, tier_from_path

    assert tier_from_path(TESTS_DIR / "unit" / "test_new_module.py") == "unit"
    assert tier_from_path(TESTS_DIR / "slurm" / "test_new_module.py") == "e2e"
    assert tier_from_path(TESTS_DIR / "no_such_dir" / "test_x.py") is None


def test_a_unit_test_that_starts_a_process_or_a_socket_fails(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import multiprocessing, socket, subprocess, pytest\n"
        "@pytest.mark.unit\ndef test_popen():\n    subprocess.run(['true'])\n"
        "@pytest.mark.unit\ndef test_swallowed_socket():\n"
        "    try:\n        socket.socket()\n    except Exception:\n        pass\n"
        "@pytest.mark.unit\ndef test_spawn():\n"
        "    p = multiprocessing.get_context('spawn').Process(target=print)\n    p.start()\n    p.join()\n"
        "@pytest.mark.unit\ndef test_pure():\n    assert sorted([2, 1]) == [1, 2]\n"
        "@pytest.mark.integration\ndef test_allowed():\n    subprocess.run(['true'], check=True)\n    socket.socket().close()\n")
    res = run_pytest(tmp_path)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    for name in ("test_popen", "test_swallowed_socket", "test_spawn"):
        assert f"FAILED test_x.py::{name}" in out, out
    assert "PASSED test_x.py::test_pure" in out and "PASSED test_x.py::test_allowed" in out, out
    assert out.count("give it the integration tier") >= 3, out


def test_tier_audit_records_what_each_test_started(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import subprocess, pytest\n"
        "@pytest.mark.unit\ndef test_popen():\n    subprocess.run(['true', 'audit-me'])\n"
        "@pytest.mark.unit\ndef test_pure():\n    pass\n")
    audit = tmp_path / "audit.jsonl"
    res = run_pytest(tmp_path, f"--tier-audit={audit}")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {r["nodeid"]: r["events"] for r in map(json.loads, audit.read_text().splitlines())}
    assert rows["test_x.py::test_pure"] == []
    assert any("true audit-me" in e for e in rows["test_x.py::test_popen"]), rows


def test_package_selects_the_tests_that_name_it(tmp_path):
    (tmp_path / "test_ckpt_thing.py").write_text(
        "import pytest\n@pytest.mark.unit\ndef test_a():\n    import nvrx.ckpt.manifest\n")
    (tmp_path / "test_launch_thing.py").write_text(
        "import pytest\n@pytest.mark.integration\ndef test_b(tmp_path):\n    Launcher = None\n")
    (tmp_path / "test_other.py").write_text("import pytest\n@pytest.mark.unit\ndef test_c():\n    pass\n")
    ckpt = run_pytest(tmp_path, "--package", "ckpt")
    assert "PASSED test_ckpt_thing.py::test_a" in ckpt.stdout and "1 passed, 2 deselected" in ckpt.stdout, ckpt.stdout
    launcher = run_pytest(tmp_path, "--package", "launcher")
    assert "PASSED test_launch_thing.py::test_b" in launcher.stdout, launcher.stdout
    assert "1 passed, 2 deselected" in launcher.stdout, launcher.stdout


HUNG = r'''
import pathlib, signal, subprocess, sys, pytest
@pytest.mark.integration
@pytest.mark.timeout({timeout})
def test_hangs(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
    pathlib.Path("{pidfile}").write_text(str(child.pid))
    {block}
'''


def _hung_test(tmp_path: Path, block: str = "child.wait()") -> tuple[str, Path]:
    marker = f"hung-{uuid.uuid4().hex[:8]}"
    pidfile = tmp_path / "child.pid"
    (tmp_path / "test_hung.py").write_text(HUNG.format(timeout=3, marker=marker, pidfile=pidfile, block=block))
    return marker, pidfile


def test_a_hung_test_fails_with_its_stacks_and_process_tree_and_its_children_die(tmp_path):
    marker, pidfile = _hung_test(tmp_path)
    res = run_pytest(tmp_path, timeout=90)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "FAILED test_hung.py::test_hangs" in out and "Timeout: over 3 s" in out, out
    assert "ran over its timeout of 3 s" in out and "--- thread MainThread" in out, out
    assert "child.wait()" in out, out  # where the main thread was stuck
    assert marker in out, out  # the child in the process tree
    assert pid_gone(int(pidfile.read_text()))


def test_a_test_that_cannot_be_interrupted_ends_its_process_after_the_grace(tmp_path):
    # SIGALRM blocked: the main thread never sees the timeout, so the process ends itself after the grace period
    marker, pidfile = _hung_test(
        tmp_path, block="signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM}); __import__('time').sleep(600)")
    res = run_pytest(tmp_path, env={"NVRX_TEST_TIMEOUT_GRACE": "2"}, timeout=90)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "did not end 2 s after its child processes were killed" in res.stderr, res.stderr
    assert marker in res.stderr and "--- thread MainThread" in res.stderr
    assert pid_gone(int(pidfile.read_text()))


ALONE = r'''
import json, os, time, pytest
def _run(name, log):
    t0 = time.time()
    time.sleep(0.4)
    with open(log, "a") as fh:
        fh.write(json.dumps([name, t0, time.time()]) + "\n")
@pytest.mark.integration
@pytest.mark.parametrize("i", range(6))
def test_shared(i):
    _run(f"shared{{i}}", "{log}")
@pytest.mark.integration
@pytest.mark.alone
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    _run(f"alone{{i}}", "{log}")
'''


def test_alone_tests_run_while_nothing_else_runs(tmp_path):
    pytest.importorskip("xdist")
    log = tmp_path / "runs.jsonl"
    (tmp_path / "test_alone.py").write_text(ALONE.format(log=log))
    res = run_pytest(tmp_path, "-n", "2", "--dist", "loadgroup", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 8
    for name, start, end in runs:
        if name.startswith("alone"):
            others = [(n, s, e) for n, s, e in runs if n != name and s < end and e > start]
            assert not others, f"{name} overlapped {others}"


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    lo, _hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(10000 <= p < min(20000, lo) for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
