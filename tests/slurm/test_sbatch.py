"""The nvrx/slurm/ templates, submitted as users submit them, on the test Slurm (2 emulated nodes)."""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import pytest

from nvrx.slurm import TEMPLATES_DIR
from nvrx.slurm.environment import expand_hostlist
from tests.conftest import tagged_processes
from tests.slurm.chain import ResumeChain
from tests.slurm.cluster import REPO


EXAMPLE = Path(__file__).with_name("example_train.py")


class Job:
    """A template copied into a test dir with the example script; submitted with NVRX_* variables."""

    def __init__(self, cluster, tmp_path: Path, template: str) -> None:
        self.cluster, self.dir = cluster, tmp_path
        self.token = uuid.uuid4().hex
        shutil.copy(TEMPLATES_DIR / template, tmp_path / template)
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


@pytest.mark.slow
def test_stopped_jobs_save_and_continue_in_new_jobs_until_finished(slurm_cluster, tmp_path):
    """The auto-resume chain on 2 nodes, stopped twice by the two signal paths that stay graceful:
    job 1: scancel --signal=TERM (Slurm signals the step: agents and ranks);
    job 2: scancel --batch --signal=USR1 (only the batch shell, which is nvrx resume: it passes the
           signal to srun, which forwards it to the agents).
    Each time all ranks stop at one agreed step with a checkpoint, the launch exits 128+signal, nvrx resume
    submits the continuation, and that one resumes at the next step. Job 3 finishes: the flag ends the chain."""
    chain = ResumeChain(slurm_cluster, tmp_path / "chain", steps=40, step_time=0.1)
    jobs = [chain.submit()]
    for scancel_args, sig in ((["--signal=TERM"], "SIGTERM"), (["--batch", "--signal=USR1"], "SIGUSR1")):
        job = jobs[-1]
        chain.wait_steps(job, 3)
        chain.signal(job, *scancel_args)
        info, _ = chain.wait_end(job)
        out = chain.output(job)
        assert info["ExitCode"] == "3:0", out  # nvrx resume: continue
        assert re.search(rf"nvrx resume: continue: .*interrupted by {sig} \(attempt", out), out
        # All ranks stopped after the same step, each after the checkpoint of that step was on disk.
        stops = [e for e in chain.events() if e["job"] == job and e["event"] == "stopped"]
        assert len(stops) == chain.nodes and {e["signal"] for e in stops} == {sig}, out
        assert len({e["step"] for e in stops}) == 1, stops
        nxt = chain.continuation_of(job)
        assert nxt, out
        assert slurm_cluster.job(nxt).get("Dependency", "(null)") in ("(null)", f"afterany:{job}(unfulfilled)",
                                                                      f"afterany:{job}")
        jobs.append(nxt)
    info, _ = chain.wait_end(jobs[-1])
    out = chain.output(jobs[-1])
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert "finished: the finished flag exists" in out and "submitted the continuation" not in out, out
    assert chain.queued() == [], "the finished flag must end the chain"

    assert sorted(chain.by_rank()) == [0, 1]
    for rank, events in chain.by_rank().items():
        # Job by job: start at the saved step, run to the agreed stop, the next job starts right after it.
        starts = [(e["job"], e["step"]) for e in events if e["event"] == "start"]
        stops = [(e["job"], e["step"]) for e in events if e["event"] == "stopped"]
        assert [j for j, _ in starts] == jobs and [j for j, _ in stops] == jobs[:2], events
        assert starts[0][1] == 0 and [s for _, s in starts[1:]] == [s + 1 for _, s in stops], (starts, stops)
        # Over the chain every step ran exactly once (none lost, none repeated) ...
        assert [e["step"] for e in events if e["event"] == "step"] == list(range(chain.steps)), rank
        # ... and the weights, restored from each checkpoint, add up to the uninterrupted result.
        finished = [e for e in events if e["event"] == "finished"]
        assert len(finished) == 1 and set(finished[0]["weights"]) == {chain.expected_weights()}, finished
    assert [p.name for p in chain.ckpt_dir.iterdir()] == [f"step-{chain.steps}"]
    assert (chain.state_dir / "finished.flag").exists()
    state = chain.resume_state()
    assert [h["cause"] for h in state["history"]] == ["interrupted", "interrupted", "clean_exit"], state["history"]
    assert [h["exit_code"] for h in state["history"]] == [143, 138, 0] and state["failures"] == 0
    assert state["jobs"] == jobs
    assert not tagged_processes(chain.token)


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
