"""The slurm/ templates, submitted as users submit them, on the test Slurm (2 emulated nodes)."""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from pathlib import Path

import pytest

from launcher.slurm_env import expand_hostlist
from tests.conftest import tagged_processes
from tests.slurm.cluster import REPO

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).with_name("example_train.py")


class Job:
    """A template copied into a test dir with the example script; submitted with NVRX_* variables."""

    def __init__(self, cluster, tmp_path: Path, template: str) -> None:
        self.cluster, self.dir = cluster, tmp_path
        self.token = uuid.uuid4().hex
        shutil.copy(REPO / "slurm" / template, tmp_path / template)
        shutil.copy(EXAMPLE, tmp_path / "example_train.py")
        self.template = template
        self.reports = tmp_path / "reports"
        self.reports.mkdir()
        self.out = tmp_path / "job.out"

    def submit(self, *sbatch_args: str, output: bool = True, **env: str) -> str:
        """sbatch from the test dir, as a user would (continuations are submitted from there too)."""
        job_env = {"NVRX_EXAMPLE_SCRIPT": "example_train.py", "EXAMPLE_REPORT_DIR": str(self.reports),
                   "NVRX_TEST_TOKEN": self.token, **env}
        out = [f"--output={self.out}"] if output else []
        return self.cluster.sbatch(*sbatch_args, *out, self.template, env=job_env, cwd=self.dir)

    def finish(self, job_id: str) -> dict[str, str]:
        info = self.cluster.wait_job(job_id)
        left = [p for p in tagged_processes(self.token)]
        assert not left, f"job {job_id} left processes behind: {[(p.pid, p.name()) for p in left]}"
        return info

    def ranks(self) -> list[dict]:
        return sorted((json.loads(p.read_text()) for p in self.reports.glob("rank-*.json")), key=lambda r: r["rank"])

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else "(no output file)"


def test_two_node_job_from_the_multi_node_template(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path, "multi_node.sbatch")
    job_id = job.submit("--nodes=2", NVRX_NPROC_PER_NODE="2", NVRX_MAX_RESTARTS="0")
    info = job.finish(job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.output()

    hosts = expand_hostlist(info["NodeList"])
    ranks = job.ranks()
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], job.output()
    assert {r["world"] for r in ranks} == {4} and {r["sum"] for r in ranks} == {6.0}
    # Node rank = Slurm's node index; two ranks per node; the run is named after the job.
    assert [(r["node"], r["group_rank"], r["local_rank"]) for r in ranks] == [
        (hosts[0], 0, 0), (hosts[0], 0, 1), (hosts[1], 1, 0), (hosts[1], 1, 1)]
    assert {r["run_id"] for r in ranks} == {job_id} and {r["restart"] for r in ranks} == {0}
    # Each agent names its event log after its Slurm node (emulated nodes share a hostname).
    logs = (tmp_path / "nvrx_logs" / job_id).glob("agent-*.jsonl")
    assert sorted(p.name.removeprefix("agent-").rsplit("-", 1)[0] for p in logs) == sorted(hosts)


def test_crash_in_the_job_is_recovered_by_an_in_job_restart(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path, "multi_node.sbatch")
    marker = tmp_path / "crashed.marker"
    job_id = job.submit("--nodes=2", NVRX_NPROC_PER_NODE="2", NVRX_MAX_RESTARTS="1",
                        EXAMPLE_CRASH_RANK="3", EXAMPLE_CRASH_MARKER=str(marker))
    info = job.finish(job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    assert marker.read_text() == "0"  # rank 3 crashed in the first attempt
    ranks = job.ranks()
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and {r["restart"] for r in ranks} == {1}, job.output()
    assert "crashing on purpose" in job.output()


def test_single_node_template(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path, "single_node.sbatch")
    job_id = job.submit(NVRX_NPROC_PER_NODE="2")
    info = job.finish(job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.output()
    ranks = job.ranks()
    assert [(r["rank"], r["world"], r["sum"], r["run_id"]) for r in ranks] == [(0, 2, 1.0, job_id), (1, 2, 1.0, job_id)]
    assert {r["node"] for r in ranks} == {info["NodeList"]}


def test_one_agent_per_task_is_refused(slurm_cluster, tmp_path):
    """The usual mistake: srun --ntasks-per-node=2 nvrx launch -> one clear line, exit 2, no ranks started."""
    job = Job(slurm_cluster, tmp_path, "multi_node.sbatch")
    job_id = slurm_cluster.sbatch("--nodes=1", "--ntasks-per-node=2", f"--chdir={tmp_path}", f"--output={job.out}",
                                  "--wrap", "srun nvrx launch --nproc-per-node 2 example_train.py",
                                  env={"NVRX_TEST_TOKEN": job.token, "EXAMPLE_REPORT_DIR": str(job.reports)})
    info = job.finish(job_id)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), job.output()
    errors = [line for line in job.output().splitlines() if line.startswith("Error:") or "error" in line.lower()]
    assert any("one nvrx launch per node: use srun --ntasks-per-node=1" in line for line in errors), job.output()
    assert "Traceback" not in job.output() and not job.ranks()


def _wait_for(path: Path, cluster, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = cluster.job(job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} is {state} before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout:.0f} s"
        time.sleep(0.1)


def test_interrupted_job_continues_in_a_new_job_until_finished(slurm_cluster, tmp_path):
    """scancel --signal=TERM -> the launch ends as interrupted -> nvrx resume submits the continuation,
    which runs the next launch; that one marks the run finished, which ends the chain."""
    job = Job(slurm_cluster, tmp_path, "auto_resume.sbatch")
    env = dict(NVRX_NPROC_PER_NODE="1", NVRX_STATE_DIR=str(tmp_path / "state"), EXAMPLE_FINISH_ON_LAUNCH="2",
               EXAMPLE_WAIT_FOR_STOP="1")
    first = job.submit("--nodes=2", output=False, **env)
    _wait_for(job.reports / "ready", slurm_cluster, first)
    slurm_cluster.run("scancel", "--signal=TERM", first, timeout=15)
    info = slurm_cluster.wait_job(first)
    out1 = (tmp_path / f"nvrx-resume-{first}.out").read_text(errors="replace")
    assert info["ExitCode"] == "3:0", out1  # nvrx resume: continue
    m = re.search(r"submitted the continuation: job (\d+)", out1)
    assert m, out1
    second = m.group(1)
    assert slurm_cluster.job(second).get("Dependency", "(null)") in ("(null)", f"afterany:{first}(unfulfilled)",
                                                                     f"afterany:{first}")
    info2 = job.finish(second)
    out2 = (tmp_path / f"nvrx-resume-{second}.out").read_text(errors="replace")
    assert (info2["JobState"], info2["ExitCode"]) == ("COMPLETED", "0:0"), out2
    assert (job.reports / "launches").read_text().split() == [first, second]
    assert (tmp_path / "state" / "finished.flag").exists()
    assert "submitted the continuation" not in out2
    assert not tagged_processes(job.token)


def test_job_failing_every_time_gives_up_after_max_failures(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path, "auto_resume.sbatch")
    (tmp_path / "fail.py").write_text("import sys\nprint('failing on purpose', flush=True)\nsys.exit(5)\n")
    job_id = job.submit("--nodes=2", NVRX_EXAMPLE_SCRIPT="fail.py", NVRX_MAX_RESTARTS="0", NVRX_MAX_FAILURES="2",
                        NVRX_STATE_DIR=str(tmp_path / "state"))
    info = job.finish(job_id)
    assert info["ExitCode"] == "4:0", job.output()  # nvrx resume: give up
    launches = re.findall(r"^nvrx resume: attempt (\d+):", job.output(), re.M)
    assert launches == ["1", "2"], job.output()  # two failed launches, then it stops
    assert "submitted the continuation" not in job.output()
