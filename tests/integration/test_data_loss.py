"""Nothing of the user's is lost or overwritten (issue 26, "Data loss"): names that would escape the job's
directories, a --local-ckpt-dir session the user made, planted symbolic links, full file systems.

Every case runs the real `nvrx launch` (agent, ranks) as a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import one_line_error, write_script


@pytest.fixture
def script(tmp_path: Path) -> Path:
    return write_script(tmp_path / "ok.py", "print('hello')\n")


@pytest.mark.parametrize("args,needles", [
    (["--rdzv-id", ".."], ["--rdzv-id '..'", "not a usable name"]),
    (["--rdzv-id", "."], ["--rdzv-id '.'", "not a usable name"]),
    (["--rdzv-id", ""], ["--rdzv-id empty", "not a usable name"]),
    (["--rdzv-id", "a/b"], ["--rdzv-id 'a/b'", "path separator"]),
    (["--rdzv-id", "a\nb"], ["--rdzv-id 'a\\nb'", "control character"]),
    (["--rdzv-id", "x" * 300], ["--rdzv-id is 300 characters long", "at most 128"]),
    (["--role", "../x"], ["--role '../x'", "path separator"]),
    (["--role", ".."], ["--role '..'", "not a usable name"]),
    (["--role", ""], ["--role empty"]),
])
def test_names_that_would_escape_the_job_directories_are_refused(launcher, script, tmp_path, args, needles):
    logs = tmp_path / "logs" / "inner"
    logs.mkdir(parents=True)
    res = launcher.run("--standalone", "--log-dir", str(logs), *args, str(script), timeout=60)
    one_line_error(res, *needles)
    assert sorted(p.name for p in logs.parent.iterdir()) == ["inner"], "nothing may be written beside --log-dir"
    assert list(logs.iterdir()) == []
    assert launcher.leftovers(wait=0.5) == []


LOCAL_SAVE = """
from nvrx.ckpt.local import LocalCheckpointManager, default_root
LocalCheckpointManager(default_root()).save({"x": 1}, iteration=2)  # the job's session: <root>/<run id>
"""


def test_a_users_own_directory_named_like_the_run_is_never_removed(launcher, tmp_path: Path) -> None:
    """--local-ckpt-dir D --rdzv-id X where D/X is the user's: the job succeeds and D/X keeps every file."""
    root = tmp_path / "local"
    notes = root / "X" / "data" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")
    (root / "X").chmod(0o700)  # private, as the local tier asks of a session it saves into
    script = write_script(tmp_path / "train.py", LOCAL_SAVE)
    done = launcher.run("--standalone", "--rdzv-id", "X", "--local-ckpt-dir", str(root), str(script))
    assert done.returncode == 0, done.stderr
    assert notes.read_text() == "mine"
    assert (root / "X" / "rank0" / "iter_000000002_0_local.nvrxl").is_file()  # not proven nvrx's: kept as well
    assert "was not made by nvrx" in done.stderr
    assert launcher.leftovers() == []


def test_removal_of_the_jobs_own_session_keeps_what_nvrx_did_not_write(launcher, tmp_path: Path) -> None:
    """The session nvrx made is removed on success, but a link planted in it is not followed and a file nvrx
    did not write stays (with its directories)."""
    root, elsewhere = tmp_path / "local", tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    (elsewhere / "keep" / "iter_000000001_0_local.nvrxl").write_text("not a checkpoint of this job")
    script = write_script(tmp_path / "train.py", LOCAL_SAVE + f"""
import os
from pathlib import Path
session = Path(default_root()) / os.environ["TORCHELASTIC_RUN_ID"]
(session / "rank1").symlink_to({str(elsewhere / "keep")!r}, target_is_directory=True)
(session / "rank0" / "user.txt").write_text("kept")
""")
    done = launcher.run("--standalone", "--rdzv-id", "own", "--local-ckpt-dir", str(root), str(script))
    assert done.returncode == 0, done.stderr
    assert (elsewhere / "keep" / "iter_000000001_0_local.nvrxl").read_text() == "not a checkpoint of this job"
    assert sorted(p.name for p in (root / "own" / "rank0").iterdir()) == ["user.txt"]  # the checkpoint is gone
    assert (root / "own" / "rank1").is_symlink()
    assert launcher.leftovers() == []
