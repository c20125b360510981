"""An auto-resume chain on the test Slurm: nvrx/slurm/templates/auto_resume.sbatch running resumable_train.py.

Shared by tests/slurm/test_sbatch.py (which asserts on what happened) and bench/bench_slurm.py (which
times it). Everything of one chain lives in one directory: the copied template and script, the
checkpoints (nvrx/ckpt/), nvrx resume's state (state/), the ranks' journals (journal/rank-R.jsonl) and the
jobs' output (nvrx-resume-JOB.out, written by the template's --output=%x-%j.out).
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nvrx.slurm import TEMPLATES_DIR
from tests.slurm.cluster import REPO, SlurmCluster

TEMPLATE = "auto_resume.sbatch"
SCRIPT = Path(__file__).with_name("resumable_train.py")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


def wait_end(cluster: SlurmCluster, job_id: str, timeout: float = 90, poll: float = 0.05,
             describe: Callable[[str], str] = lambda job_id: "") -> tuple[dict[str, str], float]:
    """Block until the job is in a final state; return its fields and when this poll first saw that
    (cancels the job and fails after TIMEOUT)."""
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job(job_id)
        if info.get("JobState") in FINAL_STATES:
            return info, time.time()
        if time.monotonic() > deadline:
            cluster.run("scancel", job_id, check=False, timeout=10)
            raise AssertionError(f"job {job_id} not finished after {timeout:.0f} s: {info.get('JobState')}\n"
                                 f"{describe(job_id)}")
        time.sleep(poll)


def wait_running(cluster: SlurmCluster, job_id: str, timeout: float = 60, poll: float = 0.05) -> float:
    """Block until the job left PENDING; return when this poll first saw it."""
    deadline = time.monotonic() + timeout
    while True:
        if cluster.job(job_id).get("JobState") not in ("PENDING", None):
            return time.time()
        assert time.monotonic() < deadline, f"job {job_id} still pending after {timeout:.0f} s"
        time.sleep(poll)


@dataclass
class ResumeChain:
    """One run of the auto-resume template: submit, watch the ranks' journals, signal, follow the chain."""

    cluster: SlurmCluster
    dir: Path
    steps: int = 40
    step_time: float = 0.1
    nodes: int = 2
    nproc_per_node: int = 1
    env: dict[str, str] = field(default_factory=dict)  # more variables for the first job (and so the chain)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(TEMPLATES_DIR / TEMPLATE, self.dir / TEMPLATE)
        shutil.copy(SCRIPT, self.dir / SCRIPT.name)
        for sub in ("journal", "state"):
            (self.dir / sub).mkdir(exist_ok=True)

    # ------------------------------------------------------------ jobs

    @property
    def journal_dir(self) -> Path:
        return self.dir / "journal"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"

    @property
    def ckpt_dir(self) -> Path:
        return self.dir / "ckpt"

    def submit(self, *sbatch_args: str) -> str:
        """sbatch the template from the chain's dir, as a user would; continuations come from nvrx resume."""
        args = f"--ckpt-dir {self.ckpt_dir} --steps {self.steps} --step-time {self.step_time} --journal {self.journal_dir}"
        env = {"NVRX_EXAMPLE_SCRIPT": SCRIPT.name, "NVRX_EXAMPLE_ARGS": args, "NVRX_STATE_DIR": str(self.state_dir),
               "NVRX_NPROC_PER_NODE": str(self.nproc_per_node), "NVRX_TEST_TOKEN": self.token, **self.env}
        return self.cluster.sbatch(f"--nodes={self.nodes}", *sbatch_args, TEMPLATE, env=env, cwd=self.dir)

    def state(self, job_id: str) -> str | None:
        return self.cluster.job(job_id).get("JobState")

    def wait_steps(self, job_id: str, count: int, timeout: float = 60) -> float:
        """Block until every rank of JOB_ID journaled COUNT steps; return the time seen. Fails if the job
        ends first."""
        world = self.nodes * self.nproc_per_node
        deadline = time.monotonic() + timeout
        while True:
            done = [sum(1 for e in evs if e["event"] == "step") for evs in self.by_rank(job_id).values()]
            if len(done) == world and min(done) >= count:
                return time.time()
            state = self.state(job_id)
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), \
                f"job {job_id} is {state} before its ranks did {count} steps:\n{self.output(job_id)}"
            assert time.monotonic() < deadline, f"job {job_id}: ranks not at step {count} within {timeout:.0f} s"
            time.sleep(0.05)

    def signal(self, job_id: str, *scancel_args: str) -> float:
        """scancel SCANCEL_ARGS JOB_ID (bounded); return the time just before it was called."""
        t = time.time()
        self.cluster.run("scancel", *scancel_args, job_id, timeout=15)
        return t

    def wait_end(self, job_id: str, timeout: float = 90) -> tuple[dict[str, str], float]:
        return wait_end(self.cluster, job_id, timeout, describe=self.output)

    def wait_running(self, job_id: str, timeout: float = 60) -> float:
        return wait_running(self.cluster, job_id, timeout)

    def continuation_of(self, job_id: str) -> str | None:
        """The job nvrx resume submitted from JOB_ID, as its output says."""
        m = re.search(r"submitted the continuation: job (\d+)", self.output(job_id))
        return m.group(1) if m else None

    def output(self, job_id: str) -> str:
        path = self.dir / f"nvrx-resume-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else f"(no output file {path.name})"

    def queued(self) -> list[str]:
        """Jobs of this chain still known to the queue (pending or running)."""
        out = self.cluster.run("squeue", "-h", "-o", "%i %o", check=False, timeout=10).stdout
        return [line.split()[0] for line in out.splitlines() if str(self.dir) in line]

    # ------------------------------------------------------------ what the ranks did

    def events(self) -> list[dict[str, Any]]:
        """Every journal line of every rank (a torn last line of a killed rank is skipped)."""
        found = []
        for path in sorted(self.journal_dir.glob("rank-*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
        return found

    def by_rank(self, job_id: str | None = None) -> dict[int, list[dict[str, Any]]]:
        """Journal events per rank, in order, optionally of one job only."""
        ranks: dict[int, list[dict[str, Any]]] = {}
        for e in self.events():
            if job_id is None or e["job"] == job_id:
                ranks.setdefault(e["rank"], []).append(e)
        return ranks

    def expected_weights(self) -> float:
        """The weight every element must end with: each step adds 1 + 2 + ... + world."""
        world = self.nodes * self.nproc_per_node
        return float(self.steps * world * (world + 1) // 2)

    def resume_state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "state.json").read_text())
