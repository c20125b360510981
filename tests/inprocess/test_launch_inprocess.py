"""`nvrx launch --inprocess`: the script runs inside the Wrapper and the agent lets it handle faults."""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_script

SCRIPT = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from launcher import inprocess

it = inprocess.current().iteration
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
print(json.dumps({"pid": os.getpid(), "it": it, "rank": rank, "world": world, "local": int(os.environ["LOCAL_RANK"])}),
      flush=True)
t = torch.ones(2)
for step in range(3):
    if it == 0 and rank == 1 and step == 1:
        raise RuntimeError("injected on rank 1")
    if it == 1 and rank == 0 and step == 1:
        os._exit(5)  # the rank's process is lost; the Wrapper store lives in the agent, so the job goes on
    dist.all_reduce(t)
dist.destroy_process_group()
sys.exit(0)
"""


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_inprocess_restart_under_nvrx_launch_with_a_spare(launcher, tmp_path):
    script = write_script(tmp_path / "train.py", SCRIPT)
    res = launcher.run("--nproc-per-node", "3", "--inprocess", "--inprocess-spares", "1", "--max-restarts", "0",
                       str(script), timeout=120)
    assert res.returncode == 0, res.stderr
    lines = _lines(res.stdout)
    by_it = {it: sorted((l["rank"], l["local"], l["pid"]) for l in lines if l["it"] == it) for it in (0, 1, 2)}
    assert [r for r, _, _ in by_it[0]] == [0, 1] and all(l["world"] == 2 for l in lines)
    assert by_it[1] == by_it[0], "iteration 1 must run in the same processes, same ranks"
    pids = {local: pid for _, local, pid in by_it[0]}
    # iteration 2: local rank 0 died; the spare (local rank 2) took over as rank 1 and rank 1 shifted to 0
    assert [(r, local) for r, local, _ in by_it[2]] == [(0, 1), (1, 2)]
    assert dict((local, pid) for _, local, pid in by_it[2])[1] == pids[1]
    assert "nvrx job finished" in res.stderr
    assert launcher.leftovers() == []


@pytest.mark.parametrize("args, message", [
    (["--inprocess-spares", "1"], "--inprocess-spares needs --inprocess"),
    (["--inprocess", "--inprocess-spares", "2", "--nproc-per-node", "2"], "leaves no active rank"),
    (["--inprocess", "--inprocess-spares", "-1"], "must be a whole number"),
    (["--inprocess", "--no-python"], "cannot be used with --no-python"),
])
def test_bad_inprocess_flags_are_one_line_usage_errors(launcher, tmp_path, args, message):
    script = write_script(tmp_path / "train.py", "print('never runs')\n")
    res = launcher.run(*args, str(script), timeout=60)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr and "never runs" not in res.stdout
