"""Fault matrix: bad or damaged input (config, log dir, resume state, logs for `nvrx inspect`)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import one_line_error
from tests.faults.conftest import FaultJob, one_line


class Resume(FaultJob):
    subcommand = "resume"


@pytest.fixture
def resume(tmp_path):
    r = Resume(tmp_path)
    yield r
    r.cleanup()


def test_corrupt_config(job):
    """Fault: a corrupt fault-tolerance config file (YAML that does not parse).
    Outcome: one line naming the file, exit 2; nothing starts.
    """
    cfg = job.tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  rank_heartbeat_timeout: [1, \n")
    res = job.run("--fault-tol-cfg-path", str(cfg), "--standalone", *job.train(5), timeout=60)
    one_line_error(res, "ft.yaml")
    assert job.ledger.entries() == []
    job.assert_clean()


def test_log_dir_cannot_be_created(job):
    """Fault: --log-dir names a path that cannot be created (under a regular file).
    Outcome: one line naming the flag and the reason, exit 2 (was a 44-line traceback, exit 1).
    """
    (job.tmp_path / "afile").write_text("")
    res = job.run("--log-dir", "afile/logs", "--standalone", *job.train(5), timeout=60)
    one_line_error(res, "--log-dir afile/logs", "Not a directory")
    assert job.ledger.entries() == []
    job.assert_clean()


def test_resume_state_file_is_a_directory(resume):
    """Fault: `nvrx resume` finds a directory where its state file should be.
    Outcome: one line naming the state file, exit 2 (was a traceback, exit 1); the state dir is left as it was.
    """
    state = resume.tmp_path / "state"
    (state / "state.json").mkdir(parents=True)
    before = sorted(p.name for p in state.iterdir())
    res = resume.run("--state-dir", str(state), "--check", timeout=60)
    one_line_error(res, "state.json is a directory")
    assert sorted(p.name for p in state.iterdir()) == before
    resume.assert_clean()


def test_corrupt_resume_state(resume):
    """Fault: `nvrx resume`'s state file is corrupt (not JSON) while its backup is good.
    Outcome: the counts come back from the backup (no budget reset), the bad file is kept aside; exit 3 (continue).
    """
    state = resume.tmp_path / "state"
    state.mkdir()
    rec = resume.run("--state-dir", str(state), "--exit-code", "1", "--max-failures", "5", timeout=60)
    assert rec.returncode == 3, rec.stderr
    good = json.loads((state / "state.json").read_text())
    assert good["failures"] == 1
    (state / "state.json").write_text('{"version": 1, "failures": ')
    res = resume.run("--state-dir", str(state), "--exit-code", "1", "--max-failures", "5", timeout=60)
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr and "corrupt" in res.stderr
    assert json.loads((state / "state.json").read_text())["failures"] == 2  # 1 recovered + this one
    assert list(state.glob("state.json.corrupt-*"))
    resume.assert_clean()


def test_corrupt_and_truncated_logs_for_inspect(job):
    """Fault: `nvrx inspect` reads event logs with garbage lines, a torn last line and a wrongly typed record.
    Outcome: the report is made from the good lines and counts the corrupt ones; exit 0, no traceback.
    """
    res = job.run("--standalone", "--rdzv-id", "logs", "--max-restarts", "1", *job.train(6, "crash"), timeout=120)
    assert res.returncode == 0, res.stderr
    log = next(job.run_dir("logs").glob("agent-*.jsonl"))
    text = log.read_bytes()
    log.write_bytes(b"\x00\xffgarbage\n" + text[: len(text) // 2] + b'\n{"v":1,"t":"x","ev":"rdzv_round","round":"a"}\n'
                    + text[len(text) // 2:-20])
    out = job.run_inspect("logs")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "corrupt" in out.stdout and "round 0 stopped: rank 0 exited with code 3" in out.stdout
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_restart_storm_without_progress(resume):
    """Fault: a restart storm: launch after launch fails at once, the iteration never advances.
    Outcome: `nvrx resume` gives up after --max-no-progress launches, exit 4, saying the run is stuck.
    """
    state = resume.tmp_path / "state"
    state.mkdir()
    progress = resume.tmp_path / "progress"
    progress.write_text("7")
    limits = ["--max-failures", "0", "--max-no-progress", "2", "--progress-file", str(progress)]
    codes = [resume.run("--state-dir", str(state), "--exit-code", "1", *limits, timeout=60) for _ in range(3)]
    assert [c.returncode for c in codes] == [3, 3, 4], codes[-1].stderr
    last = one_line(codes[-1].stderr)
    assert "no progress" in last and "stuck at 7" in last
    st = json.loads((state / "state.json").read_text())
    assert (st["attempts"], st["no_progress"], st["last_progress"]) == (3, 2, 7)  # the first one found step 7
    resume.assert_clean()
