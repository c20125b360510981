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
