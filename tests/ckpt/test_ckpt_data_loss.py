"""Checkpoints a job can always come back to, and never one another user could have rewritten (issue 26):
``PeriodicCheckpointer`` under the usual umasks, ``check_private`` on another user's checkpoint.

Each case runs real ranks under the real `nvrx launch`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import write_script

PERIODIC = """
import sys
import torch, torch.distributed as dist
from nvrx import ckpt
dist.init_process_group("gloo")
w = torch.zeros(4)
saver = ckpt.PeriodicCheckpointer(sys.argv[1], state={"w": w}, every_steps=2)
start = saver.resume()
assert float(w[0]) == start, (float(w[0]), start)  # the restored state is the state of that step
for step in range(start, start + 4):
    w += 1
    saver.step(step)
saver.close()
with open(sys.argv[2], "a") as fh:
    fh.write(f"{start}\\n")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o000])
def test_a_job_resumes_from_its_own_checkpoints_under_any_usual_umask(launcher, tmp_path: Path, umask: int) -> None:
    """Two launches under UMASK: the second resumes from the first's checkpoint (under 002 the root used to be 0775
    and the load was refused as "writable by its group"; under 000, 0777)."""
    script = write_script(tmp_path / "train.py", PERIODIC)
    root, starts = tmp_path / "ckpts" / "run", tmp_path / "starts.txt"
    for _ in range(2):
        proc = launcher.start("--standalone", "--nproc-per-node", "1", str(script), str(root), str(starts),
                              preexec_fn=lambda: os.umask(umask))
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    assert starts.read_text().split() == ["0", "4"]
    assert root.stat().st_mode & 0o777 == 0o700
    assert launcher.leftovers() == []


RESUME_OR_SAY = """
import sys
import torch, torch.distributed as dist
from nvrx import ckpt
from nvrx.ckpt.errors import CheckpointError
dist.init_process_group("gloo")
saver = ckpt.PeriodicCheckpointer(sys.argv[1], state={"w": torch.zeros(4)}, every_steps=1)
try:
    start = saver.resume()
except CheckpointError as exc:
    open(sys.argv[2], "w").write(str(exc))
    sys.exit(3)
open(sys.argv[2], "w").write(f"resumed at {start}")
saver.close()
dist.destroy_process_group()
"""


def test_a_checkpoint_owned_by_another_user_is_refused_unless_allowed(launcher, tmp_path: Path) -> None:
    """A checkpoint directory of another user (not group/world-writable): its owner could rewrite the .metadata
    that loading unpickles, so loading is refused in one line naming the owner; allowed when the user opts in."""
    if os.geteuid() != 0:
        pytest.skip("giving files to another user needs root")
    script = write_script(tmp_path / "train.py", PERIODIC)
    root = tmp_path / "ckpts"
    first = launcher.run("--standalone", "--nproc-per-node", "1", str(script), str(root), str(tmp_path / "s.txt"))
    assert first.returncode == 0, first.stderr
    newest = max(p for p in root.iterdir() if p.name.startswith("step_"))
    for p in (newest, *newest.rglob("*")):
        os.chown(p, 12345, 12345, follow_symlinks=False)  # the root stays ours: the checkpoint is theirs
    probe = write_script(tmp_path / "probe.py", RESUME_OR_SAY)
    said = tmp_path / "said.txt"
    refused = launcher.run("--standalone", "--nproc-per-node", "1", str(probe), str(root), str(said))
    assert refused.returncode == 1 and "exited with code 3" in refused.stderr, refused.stderr
    message = said.read_text()
    assert "\\n" not in message and "belongs to another user (uid 12345)" in message and str(newest) in message
    allowed = launcher.run("--standalone", "--nproc-per-node", "1", str(probe), str(root), str(said),
                           env={"NVRX_CKPT_ALLOW_SHARED_WRITABLE": "1"})
    assert allowed.returncode == 0, allowed.stderr
    assert said.read_text() == "resumed at 4"
    assert launcher.leftovers() == []
