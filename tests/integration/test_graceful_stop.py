"""Graceful stop: a signal to one agent stops every rank on every node at the same step; steering exit codes."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import free_port, run_events, wait_for, write_script


TRAIN = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from nvrx.launcher.rank import job_control
out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(100000):
    t = torch.ones(1)
    dist.all_reduce(t)                      # lockstep, like real training
    if step == 3:
        open(os.path.join(out, f"running.{rank}"), "w").close()
    if job_control.should_stop(step):
        json.dump({"step": step, "signal": job_control.stop_signal().name},
                  open(os.path.join(out, f"saved.{rank}.json"), "w"))   # "checkpoint" at the agreed step
        break
    time.sleep(0.02)
dist.destroy_process_group()
'''


def _wait_files(out: Path, pattern: str, n: int, timeout: float = 60) -> None:
    assert wait_for(lambda: len(list(out.glob(pattern))) >= n, timeout), f"only {sorted(out.glob(pattern))} after {timeout} s"


def _saved(out: Path) -> dict[int, dict]:
    return {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out.glob("saved.*.json")}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_stops_all_ranks_at_the_same_step_and_exits_as_interrupted(launcher, tmp_path, sig):
    script = write_script(tmp_path / "train.py", TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-id", "gs", str(script), str(out))
    _wait_files(out, "running.*", 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err  # "interrupted, resume me": neither finished nor failed
    saved = _saved(out)
    assert sorted(saved) == [0, 1], err
    assert len({s["step"] for s in saved.values()}) == 1 and saved[0]["signal"] == sig.name
    assert "restarting" not in err
    assert launcher.leftovers() == []


def test_signal_to_one_node_stops_both_nodes_at_the_same_step(launcher, tmp_path):
    script = write_script(tmp_path / "train.py", TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv-id", "gs2", "--rdzv-conf", "join_timeout=60"]
    a = launcher.start(*common, str(script), str(out))
    b = launcher.start(*common, str(script), str(out))
    _wait_files(out, "running.*", 2)
    a.send_signal(signal.SIGTERM)  # only one node is told (e.g. a preempted node)
    for proc in (a, b):
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
    saved = _saved(out)
    assert sorted(saved) == [0, 1]
    assert saved[0]["step"] == saved[1]["step"]
    assert launcher.leftovers() == []


def test_script_without_should_stop_keeps_the_default_signal_action(launcher, tmp_path):
    script = write_script(tmp_path / "plain.py", "import os, sys, time\n"
                          "open(os.path.join(sys.argv[1], 'running.' + os.environ['RANK']), 'w').close()\n"
                          "time.sleep(300)\n")
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "2", "--term-timeout", "60", "--rdzv-id", "plain", str(script), str(out))
    _wait_files(out, "running.*", 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    exits = [e for e in run_events(tmp_path / "nvrx_logs" / "plain", "agent-") if e["ev"] == "rank_exit"]
    # died of the forwarded SIGTERM itself, not killed after the 60 s grace period
    assert sorted(e["signal"] for e in exits) == ["SIGTERM", "SIGTERM"], exits
    assert launcher.leftovers() == []


@pytest.mark.parametrize("code", [16, 17, 93])
def test_steering_exit_code_ends_the_job_without_restart_in_place(launcher, tmp_path, code):
    script = write_script(tmp_path / "steer.py", "import os, sys\n"
                          "open(os.path.join(sys.argv[1], 'attempt.' + os.environ['TORCHELASTIC_RESTART_COUNT']), 'w')\n"
                          f"sys.exit({code} if os.environ['RANK'] == '1' else 0)\n")
    out = tmp_path / "out"
    out.mkdir()
    res = launcher.run("--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-id", f"steer{code}",
                       str(script), str(out), timeout=120)
    assert res.returncode == code, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["attempt.0"]
    assert launcher.leftovers() == []


def test_the_same_signal_delivered_twice_is_one_graceful_stop(launcher, tmp_path):
    """Slurm signals every process of the step (and `nvrx resume` forwards): the ranks keep their grace period."""
    script = write_script(tmp_path / "train.py", TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    proc = launcher.start("--nproc-per-node", "2", "--rdzv-id", "twice", str(script), str(out))
    _wait_files(out, "running.*", 2)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    saved = _saved(out)
    assert sorted(saved) == [0, 1] and saved[0]["step"] == saved[1]["step"], err
    assert launcher.leftovers() == []
