"""`nvrx inspect` on the logs of a real `nvrx launch` run: a rank crashes, the job restarts and finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nvrx.events import AgentStart, EventLog, RdzvJoin, RdzvRound
from tests.conftest import REPO, one_line_error, write_script


CRASH_ONCE = r'''
import os, signal, sys
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {rank} attempt {attempt} working", flush=True)
if rank == 1 and attempt == 0:
    print("rank 1: about to segfault", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
'''


INSPECT = [sys.executable, "-m", "nvrx", "inspect"]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def inspect(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*INSPECT, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    """One real run for the module: rank 1 dies of SIGSEGV in attempt 0; attempt 1 succeeds."""
    from tests.conftest import Launcher

    tmp = tmp_path_factory.mktemp("inspect")
    lau = Launcher(tmp)
    try:
        script = write_script(tmp / "crash_once.py", CRASH_ONCE)
        res = lau.run("--nproc-per-node", "2", "--max-restarts", "2", "--rdzv-id", "crashy", "--log-dir",
                      str(tmp / "logs"), str(script), timeout=120)
        assert res.returncode == 0, res.stderr
        assert lau.leftovers() == []
    finally:
        lau.cleanup()
    return tmp / "logs"


def test_text_report_names_the_crash_and_the_rank(crashed_run):
    res = inspect(str(crashed_run / "crashy"))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "rank 1 crashed with SIGSEGV" in out
    assert "| rank 1: about to segfault" in out       # the failing rank's last output lines
    assert "job crashy succeeded" in out
    assert "\x1b[" not in out                          # piped: plain text, no ANSI codes
    assert res.stderr == ""


def test_json_report(crashed_run):
    res = inspect("--json", str(crashed_run))          # the --log-dir itself (parent of the run dir) works too
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    (job,) = rep["jobs"]
    assert job["run_id"] == "crashy" and job["status"] == "succeeded" and job["exit_code"] == 0
    assert [r["round"] for r in job["rounds"]] == [0, 1] and job["rounds"][1]["restart_count"] == 1
    (fault,) = rep["faults"]
    assert (fault["kind"], fault["rank"], fault["signal"]) == ("failed", 1, "SIGSEGV")
    assert fault["cause"] == "rank 1 crashed with SIGSEGV"
    assert "rank 1: about to segfault" in fault["tail"]
    assert fault["lost_s"] is not None and fault["lost_s"] >= 0
    assert fault["recovered_at"] >= fault["t"]
    assert rep["corrupt"]["count"] == 0
    assert 0 < rep["uptime"] <= 1
    assert rep["goodput"] is None and rep["goodput_source"] is None  # the script reports no progress
    assert rep["timeouts"]["configured"]["rank_termination_signal"] == "SIGKILL"
    assert inspect("--json", "--rank", "0", str(crashed_run)).stdout.count('"cause"') == 0


def test_corrupt_lines_in_a_real_log_are_reported(crashed_run, tmp_path):
    import shutil

    run = tmp_path / "crashy"
    shutil.copytree(crashed_run / "crashy", run)
    agent = next(run.glob("agent-*.jsonl"))
    with open(agent, "ab") as fh:
        fh.write(b"\x00\x00\x00\x00\n" + b'{"v":1,"t":17')
    res = inspect(str(run))
    assert res.returncode == 0 and "Traceback" not in res.stderr
    assert "Corrupt lines: 2 skipped" in res.stdout and "rank 1 crashed with SIGSEGV" in res.stdout


def _one_line_error(res: subprocess.CompletedProcess, needle: str) -> None:
    one_line_error(res, needle)
    assert res.stdout == ""


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "train.log").write_text("epoch 1\n")
    _one_line_error(inspect(str(tmp_path / "empty")), "empty directory")
    _one_line_error(inspect(str(tmp_path / "notarun")), "no nvrx event files")
    _one_line_error(inspect(str(tmp_path / "missing")), "no such file or directory")
    _one_line_error(inspect(str(tmp_path / "notarun" / "train.log")), "not an nvrx event file")
    _one_line_error(inspect("--since", "whenever", str(tmp_path / "empty")), "--since")
    _one_line_error(inspect("--follow", str(tmp_path / "missing")), "no such file or directory")


def test_follow_prints_new_entries_and_exits_0_on_ctrl_c(crashed_run, tmp_path):
    import shutil

    run = tmp_path / "crashy"
    shutil.copytree(crashed_run / "crashy", run)
    proc = subprocess.Popen([*INSPECT, "--follow", "--interval", "0.1", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        seen = _read_until(proc, lambda out: "job crashy succeeded" in out)  # it has read what was there
        # the next job of the run starts: a new agent appends, as a live `nvrx launch` would
        log = EventLog(run / "agent-nexthost-4242.jsonl", "agent")
        now = time.time()
        log.emit(AgentStart(pid=4242, nproc=2, nnodes="1:1", max_restarts=0, run_id="crashy"), t=now)
        log.emit(RdzvJoin(round=0, node_id="nexthost-4242-aa"), t=now)
        log.emit(RdzvRound(round=0, group_rank=0, nodes=["nexthost-4242-aa"], world_size=2, restart_count=0,
                           waited=0.0), t=now)
        log.close()
        seen = _read_until(proc, lambda out: out.count("job crashy started") == 2, seen=seen)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # a bound only: 20 s ran out once at load 12
        out = seen + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "rank 1 crashed with SIGSEGV" in out                         # what was there at the start
    assert out.count("job crashy started") == 2                        # and what was appended later
    assert "\x1b[" not in out


def _read_until(proc: subprocess.Popen, done, timeout: float = 30.0, seen: str = "") -> str:
    """The follower's output so far, read until DONE(output) holds (bounded; the follower keeps running).

    Read from the pipe's fd, not through the text wrapper: communicate() reads the fd directly and would
    not see lines left in the wrapper's buffer.
    """
    import select

    deadline = time.monotonic() + timeout
    out = seen
    while not done(out):
        left = deadline - time.monotonic()
        assert left > 0, f"inspect --follow did not print what was expected; so far:\n{out}"
        ready, _, _ = select.select([proc.stdout.fileno()], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 1 << 16).decode()
            assert chunk, f"inspect --follow closed its output early:\n{out}"
            out += chunk
    return out
