"""`nvrx launch --local-ckpt-dir DIR`: ranks get it (ckpt.local.default_root()); a directory that cannot be made is
one clear line, exit 2."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import one_line_error, write_script

SCRIPT = """
import sys
from ckpt.local import LocalCheckpointManager, default_root
mgr = LocalCheckpointManager(default_root(), session_id="s")
mgr.save({"x": 1}, iteration=3)
open(sys.argv[1], "w").write(str(default_root()) + " " + str(mgr.find_latest()))
"""


def test_ranks_get_the_local_checkpoint_dir(launcher, tmp_path: Path) -> None:
    script = write_script(tmp_path / "train.py", SCRIPT)
    local = tmp_path / "node-local" / "ckpt"
    done = launcher.run("--standalone", "--nproc-per-node", "1", "--local-ckpt-dir", str(local), str(script),
                        str(tmp_path / "out.txt"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.txt").read_text() == f"{local} 3"
    assert (local / "s" / "rank0" / "iter_000000003_0_local.nvrxl").is_file()
    assert launcher.leftovers() == []


def test_an_unwritable_local_checkpoint_dir_is_one_line(launcher, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    script = write_script(tmp_path / "train.py", "pass\n")
    res = launcher.run("--standalone", "--nproc-per-node", "1", "--local-ckpt-dir", str(tmp_path / "afile" / "x"),
                       str(script))
    one_line_error(res, "--local-ckpt-dir", "is not a writable directory")
