"""`nvrx launch --async-ckpt`: the bootstrap starts each rank's checkpoint writer before user code runs,
every save of that rank reuses it, and nothing is left running after the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nvrx import ckpt

HERE = Path(__file__).resolve().parent



def _wired() -> bool:
    from nvrx.nvrx_cli.launch_cmd import _OPTIONS

    return any("--async-ckpt" in names for names, _ in _OPTIONS)


@pytest.mark.skipif(not _wired(), reason="nvrx launch has no --async-ckpt flag yet (launch_cmd/config/bootstrap "
                                         "lines not added; see docs/guides/checkpoints.md)")
def test_launch_async_ckpt_starts_one_writer_per_rank_at_rank_start(launcher, tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    done = launcher.run("--standalone", "--nproc-per-node", "2", "--async-ckpt", str(HERE / "launch_train.py"),
                        str(root))
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        info = json.loads((root / f"rank{rank}.json").read_text())
        assert info["early_pid"] is not None, "the writer was not started by the bootstrap"
        assert info["used_pid"] == info["early_pid"]  # the save used that writer: no process per save
    ckpt.verify_checkpoint(root / "step_3")
    assert launcher.leftovers() == []


def test_launch_without_the_flag_starts_no_writer_early(launcher, tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    done = launcher.run("--standalone", "--nproc-per-node", "1", str(HERE / "launch_train.py"), str(root))
    assert done.returncode == 0, done.stderr
    info = json.loads((root / "rank0.json").read_text())
    assert info["early_pid"] is None and info["used_pid"] is not None  # started on first use instead
    assert launcher.leftovers() == []


@pytest.mark.skipif(not _wired(), reason="nvrx launch has no --async-ckpt flag yet")
def test_a_user_module_named_ckpt_still_imports(launcher, tmp_path: Path) -> None:
    """The bootstrap imports our writer before user code; a user's own `ckpt` module must win the import."""
    project = tmp_path / "project"  # the script's directory comes first on the rank's sys.path
    project.mkdir()
    (project / "ckpt.py").write_text("OWN = 'user ckpt'\n")
    (project / "train.py").write_text("import ckpt\nprint(ckpt.OWN)\n")
    done = launcher.run("--standalone", "--nproc-per-node", "1", "--async-ckpt", str(project / "train.py"))
    assert done.returncode == 0, done.stderr
    assert "user ckpt" in done.stdout
    assert launcher.leftovers() == []
