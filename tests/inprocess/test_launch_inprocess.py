"""`nvrx launch --inprocess`: the script runs inside the Wrapper and the agent lets it handle faults."""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_script

SCRIPT = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from nvrx.launcher.rank import inprocess
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


SCRIPT_WITH_OWN_WRAPPER = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from nvrx.launcher.rank import inprocess
MODE = os.environ["TEST_MODE"]
print(json.dumps({"event": "script", "pid": os.getpid(), "outer_it": inprocess.current().iteration}), flush=True)


def finalize(state):
    print(json.dumps({"event": "finalize", "it": state.iteration, "pid": os.getpid()}), flush=True)


@inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=2 if MODE == "exhaust" else 5),
                   finalize=finalize, soft_timeout=datetime.timedelta(seconds=20),
                   hard_timeout=datetime.timedelta(seconds=40))
def train(call_wrapper: inprocess.CallWrapper):
    it = call_wrapper.iteration
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    print(json.dumps({"event": "train", "it": it, "rank": rank, "world": dist.get_world_size(), "pid": os.getpid(),
                      "same_handle": inprocess.current() is call_wrapper}), flush=True)
    t = torch.ones(2)
    for step in range(3):
        if rank == 1 and step == 1 and (it == 0 or MODE == "exhaust"):
            raise RuntimeError("injected on rank 1")
        dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t[0])


print(json.dumps({"event": "result", "value": train(), "pid": os.getpid()}), flush=True)
"""


def _events(stdout: str, name: str) -> list[dict]:
    return [line for line in _lines(stdout) if line.get("event") == name]


def _run_script_with_own_wrapper(launcher, tmp_path, mode: str):
    script = write_script(tmp_path / "train.py", SCRIPT_WITH_OWN_WRAPPER)
    return launcher.run("--nproc-per-node", "2", "--inprocess", "--max-restarts", "0", str(script), timeout=120,
                        env={"TEST_MODE": mode})


def test_the_scripts_own_wrapper_runs_with_its_own_settings_under_inprocess_launch(launcher, tmp_path):
    res = _run_script_with_own_wrapper(launcher, tmp_path, "ok")
    assert res.returncode == 0, res.stderr
    scripts = _events(res.stdout, "script")
    assert len(scripts) == 2 and {s["outer_it"] for s in scripts} == {0}, "the launcher re-ran the script"
    trains = _events(res.stdout, "train")
    assert sorted((t["it"], t["rank"]) for t in trains) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(t["same_handle"] for t in trains), "inprocess.current() is not the script Wrapper's CallWrapper"
    assert sorted(f["it"] for f in _events(res.stdout, "finalize")) == [0, 0], "the script's finalize was not used"
    pids = {s["pid"] for s in scripts}
    assert {t["pid"] for t in trains} == pids and {r["pid"] for r in _events(res.stdout, "result")} == pids
    assert "the script wraps its entry point in its own Wrapper" in res.stderr
    assert launcher.leftovers() == []


def test_the_scripts_own_retry_limit_ends_the_job_under_inprocess_launch(launcher, tmp_path):
    # Without honouring the script's Wrapper, the launcher's (no retry limit) would restart the script forever.
    res = _run_script_with_own_wrapper(launcher, tmp_path, "exhaust")
    assert res.returncode != 0
    assert "max_iterations=2" in res.stderr
    assert sorted(t["it"] for t in _events(res.stdout, "train")) == [0, 0, 1, 1]
    assert len(_events(res.stdout, "script")) == 2, "the launcher re-ran the script over the Wrapper's decision"
    assert not _events(res.stdout, "result")
    assert launcher.leftovers() == []
