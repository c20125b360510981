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
