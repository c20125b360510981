"""`nvrx resume` and the re-run record (<state dir>/rerun.json) of the ranks' state machine, in record mode
(as a bash loop calls it): a damaged record is ignored with one warning, and a record is used for one
attempt only (an old one does not excuse a later restart from the no-progress guard)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import Launcher


def record(tmp: Path, state: Path, code: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nvrx", "resume", "--state-dir", str(state), "--exit-code", str(code), *args]
    return subprocess.run(cmd, env=Launcher(tmp).env(), cwd=tmp, capture_output=True, text=True, timeout=60)


def test_a_damaged_record_is_ignored_and_a_record_counts_once(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    progress = tmp_path / "progress"
    progress.write_text("3\n")
    guard = ("--progress-file", str(progress), "--max-no-progress", "2", "--max-failures", "0")
    assert record(tmp_path, state, 1, *guard).returncode == 3          # an earlier attempt reached iteration 3

    (state / "rerun.json").write_text("{not json")
    res = record(tmp_path, state, 16, *guard)
    assert res.returncode == 3 and "ignoring" in res.stderr and "rerun.json" in res.stderr
    st = json.loads((state / "state.json").read_text())
    assert st["no_progress"] == 1 and "rerun" not in st["history"][-1]  # an unexplained exit 16: no progress

    rerun = {"id": "abc", "attempt": None, "step": 3, "state": "will_rerun_from_checkpoint", "diagnosis": None,
             "exit_code": 16, "suspects": [{"rank": 1, "node": "nvrx-n4", "message": "loss", "result": "nan"}]}
    (state / "rerun.json").write_text(json.dumps(rerun))
    res = record(tmp_path, state, 16, *guard)
    st = json.loads((state / "state.json").read_text())
    assert res.returncode == 3 and st["no_progress"] == 1 and st["history"][-1]["rerun"]["id"] == "abc"
    assert st["excluded_nodes"] == ["nvrx-n4"]

    res = record(tmp_path, state, 16, *guard)                          # the same (old) record again
    assert res.returncode == 4 and "no progress" in res.stderr.splitlines()[-1]
