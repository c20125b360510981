"""`nvrx launch --local-ckpt-dir DIR`: ranks get it (nvrx.ckpt.local.default_root()); the job's own session (its run id)
is removed when the job succeeds and kept when it fails; a directory that cannot be made is one clear line, exit 2."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import one_line_error, write_script

SCRIPT = """
import sys
from nvrx.ckpt.local import LocalCheckpointManager, default_root
mgr = LocalCheckpointManager(default_root(), session_id="s")
mgr.save({"x": 1}, iteration=3)
job = LocalCheckpointManager(default_root())  # the default session: the job's run id
job.save({"x": 2}, iteration=4)
open(sys.argv[1], "w").write(f"{default_root()} {mgr.find_latest()} {job.session_dir.name} {job.find_latest()}")
sys.exit(int(sys.argv[2]))
"""


def test_ranks_get_the_local_checkpoint_dir(launcher, tmp_path: Path) -> None:
    script = write_script(tmp_path / "train.py", SCRIPT)
    local = tmp_path / "node-local" / "ckpt"
    (local / "other-job").mkdir(parents=True)  # another job's session under the same root
    done = launcher.run("--standalone", "--rdzv-id", "job-ok", "--nproc-per-node", "1", "--local-ckpt-dir", str(local),
                        str(script), str(tmp_path / "out.txt"), "0")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.txt").read_text() == f"{local} 3 job-ok 4"
    # success: the job's own session is gone; nothing else under the root is touched
    assert not (local / "job-ok").exists()
    assert (local / "s" / "rank0" / "iter_000000003_0_local.nvrxl").is_file() and (local / "other-job").is_dir()
    assert launcher.leftovers() == []


def test_a_failed_job_keeps_its_local_checkpoints_for_the_next_attempt(launcher, tmp_path: Path) -> None:
    script = write_script(tmp_path / "train.py", SCRIPT)
    local = tmp_path / "node-local" / "ckpt"
    done = launcher.run("--standalone", "--rdzv-id", "job-bad", "--nproc-per-node", "1", "--max-restarts", "0",
                        "--local-ckpt-dir", str(local), str(script), str(tmp_path / "out.txt"), "1")
    assert done.returncode != 0
    assert (tmp_path / "out.txt").read_text() == f"{local} 3 job-bad 4"
    assert (local / "job-bad" / "rank0" / "iter_000000004_0_local.nvrxl").is_file()
    assert launcher.leftovers() == []


def test_an_unwritable_local_checkpoint_dir_is_one_line(launcher, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    script = write_script(tmp_path / "train.py", "pass\n")
    res = launcher.run("--standalone", "--nproc-per-node", "1", "--local-ckpt-dir", str(tmp_path / "afile" / "x"),
                       str(script))
    one_line_error(res, "--local-ckpt-dir", "is not a writable directory")


def test_only_the_job_session_itself_is_ever_removed(tmp_path: Path) -> None:
    from nvrx.launcher.agent.local_ckpt_dir import claim_job_session, remove_job_session

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    root.mkdir()
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    assert claim_job_session(root, "linked") is False
    assert remove_job_session(root, "linked") is None and (elsewhere / "keep").is_dir()  # a link is not followed
    for bad in ("..", ".", "a/b", ""):
        assert claim_job_session(root, bad) is False and remove_job_session(root, bad) is None
    assert root.is_dir() and remove_job_session(None, "x") is None and remove_job_session(root, "absent") is None
    (root / "theirs" / "rank0").mkdir(parents=True)  # made by someone else: no marker, never removed
    assert claim_job_session(root, "theirs") is False and remove_job_session(root, "theirs") is None
    assert (root / "theirs" / "rank0").is_dir()
    assert claim_job_session(root, "job") is True and claim_job_session(root, "job") is True  # a later launch
    (root / "job" / "rank0").mkdir()
    (root / "job" / "rank0" / "iter_000000001_0_local.nvrxl").write_bytes(b"x")
    (root / "job" / "rank0" / ".nvrx_fence.json").write_bytes(b"{}")  # the lineage of rounds (nvrx/ckpt/fence.py)
    assert remove_job_session(root, "job") == root / "job" and not (root / "job").exists() and root.is_dir()
