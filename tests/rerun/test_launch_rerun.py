"""The re-run state machine in a real 2-rank gloo job under `nvrx launch` (train_rerun.py), with emulated
nodes (SLURMD_NODENAME): a transient NaN, a NaN only one node reproduces (exit 16, then persistent_error on
the other node), a deterministic NaN (exit 17); `nvrx resume` (record mode, as a bash loop runs it) keeps
the verdicts, excludes the suspected node and does not count the re-runs as a restart storm; `nvrx inspect`
shows it all. The re-run from the checkpoint landing on the suspected node again is tested in one process
(test_machine.py). The process tree is checked after each launch. The swap to a standby within one job runs on
emulated hosts: test_launch_rerun_hosts.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Launcher

TRAIN = Path(__file__).with_name("train_rerun.py")


class Job(Launcher):
    """`nvrx launch` of train_rerun.py on an emulated node; `nvrx resume`/`nvrx inspect` on its outputs."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.logs, self.state = tmp_path / "logs", tmp_path / "resume"
        self.state.mkdir()

    def train(self, work: Path, inject: str, node: str) -> subprocess.CompletedProcess:
        work.mkdir(exist_ok=True)
        res = self.run("--nproc-per-node", "2", "--standalone", "--log-dir", str(self.logs), "-q", str(TRAIN),
                       str(work), inject, env={"SLURMD_NODENAME": node, "NVRX_RESUME_STATE_DIR": str(self.state)})
        assert self.leftovers() == []
        return res

    def record(self, code: int, *args: str) -> subprocess.CompletedProcess:
        """`nvrx resume --exit-code CODE` (a bash loop's call after each launch)."""
        cmd = [sys.executable, "-m", "nvrx", "resume", "--state-dir", str(self.state), "--exit-code",
               str(code), *args]
        return subprocess.run(cmd, env=self.env(), cwd=self.tmp_path, capture_output=True, text=True, timeout=60)

    def inspect(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "nvrx", "inspect", str(self.logs), *args]
        return subprocess.run(cmd, env=self.env(), cwd=self.tmp_path, capture_output=True, text=True, timeout=60)

    def resume_state(self) -> dict:
        return json.loads((self.state / "state.json").read_text())


@pytest.fixture
def job(tmp_path: Path):
    j = Job(tmp_path)
    yield j
    j.cleanup()


def fault_free_weights(tmp_path: Path) -> list[str]:
    """The final weights of the same training without any fault (one host)."""
    j = Job(tmp_path)
    try:
        res = j.train(j.tmp_path / "work", "none", "nvrx-n1")
        assert res.returncode == 0, res.stderr
        return json.loads((j.tmp_path / "work" / "weights.json").read_text())["weights"]
    finally:
        j.cleanup()


@pytest.fixture(scope="module")
def clean_weights(tmp_path_factory) -> list[str]:
    return fault_free_weights(tmp_path_factory.mktemp("clean"))


def weights(work: Path) -> dict:
    return json.loads((work / "weights.json").read_text())


def loss_hex(work: Path, node: str, n: int) -> str:
    return json.loads((work / f"loss-{node}-{n}.json").read_text())


@pytest.mark.slow
def test_transient_then_node_fault_then_persistent_elsewhere_and_a_deterministic_nan_stops(job, clean_weights):
    # an earlier attempt of the chain got to iteration 3 (e.g. it crashed after its step-3 checkpoint)
    progress = job.tmp_path / "progress"
    progress.write_text("3\n")
    guard = ("--progress-file", str(progress), "--max-no-progress", "1")
    assert job.record(1, *guard).returncode == 3

    work = job.tmp_path / "work"
    first = job.train(work, "node", "nvrx-n1")       # NaN once at step 1 (transient); NaN at step 3 on nvrx-n1
    assert first.returncode == 16, first.stderr
    assert (work / "ckpts" / "step_0003").is_dir() and not (work / "weights.json").exists()
    assert loss_hex(work, "nvrx-n1", 0) == loss_hex(work, "nvrx-n1", 1)  # the in-place re-run: the same loss
    fork = job.tmp_path / "work-deterministic"
    shutil.copytree(work, fork)                      # the same first job, for the deterministic case below
    rec = job.record(16, *guard)
    assert rec.returncode == 3, rec.stderr           # stuck at iteration 3, but a re-run is not a restart storm
    st = job.resume_state()
    assert st["no_progress"] == 0
    assert st["excluded_nodes"] == ["nvrx-n1"]       # the suspected node, from the machine's record
    assert st["history"][-1]["rerun"]["step"] == 3 and st["history"][-1]["rerun"]["suspects"][0]["rank"] == 1
    assert "to re-run step 3" in rec.stderr

    second = job.train(work, "node", "nvrx-n2")      # resumed without that node
    assert second.returncode == 0, second.stderr
    out = weights(work)
    assert out["verdicts"] == ["transient_error", "persistent_error"]   # the first job's verdict came along
    assert out["transient_errors"] == 1
    assert out["weights"] == clean_weights           # bitwise: the faults cost nothing but time
    assert loss_hex(work, "nvrx-n2", 0) == loss_hex(work, "nvrx-n1", 0)  # the step re-run exactly, elsewhere
    rec = job.record(0, *guard)
    assert "re-run verdict for step 3: persistent_error (rank 1 on nvrx-n1)" in rec.stderr
    assert job.resume_state()["history"][-1]["rerun"]["diagnosis"] == "persistent_error"
    text = job.inspect().stdout
    assert "re-run: step 1: unexpected result (rank 0 on node nvrx-n1: loss is NaN or Inf (call 1) = nan)" in text
    assert "re-run verdict for step 1: transient error" in text
    assert "re-run: step 3 re-run in place reproduced the result" in text
    assert "re-run verdict for step 3: persistent error of the suspected node" in text
    assert "rank 1 on node nvrx-n1: loss is NaN or Inf (call 1) = nan, re-run on nvrx-n2" in text

    # a NaN that the other node reproduces too: a correct (deterministic) result, fatal -> exit 17
    det = job.train(fork, "deterministic", "nvrx-n2")
    assert det.returncode == 17, det.stderr
    report = json.loads(job.inspect("--json").stdout)
    (verdict,) = [it for it in report["timeline"] if it["kind"] == "rerun:rerun_verdict"
                  and "correct result" in it["text"]]
    assert verdict["level"] == "error" and "exit with code 17" in verdict["text"]

