"""Exit 16 ("resume on different hardware") on the test Slurm, continued both ways a user can:
`nvrx resume --requeue` (the same job id runs again, kept off the bad node) and scripts/auto_resume.sh as
the batch script (`nvrx resume --submit` sbatches the next job with --exclude=<bad node>)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path


from tests.conftest import tagged_processes
from tests.slurm.cluster import REPO


# Exits 16 in the first job execution, finishes in the next; records where each execution ran.
TRAIN = r'''
import json, os, sys
from nvrx.launcher.rank.job_control import mark_finished
run = f"{os.environ['SLURM_JOB_ID']}+{os.environ.get('SLURM_RESTART_COUNT', '0')}"
with open(os.path.join(os.environ["WORK"], "ran.jsonl"), "a") as fh:
    fh.write(json.dumps({"run": run, "node": os.environ.get("SLURMD_NODENAME")}) + "\n")
marker = os.path.join(os.environ["WORK"], "asked_for_other_hardware")
if not os.path.exists(marker):
    open(marker, "w").close()
    print("this node looks bad: asking for other hardware", flush=True)
    sys.exit(16)
mark_finished()
'''

REQUEUE_JOB = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --open-mode=append
exec nvrx resume --state-dir "$WORK/state" --requeue --max-failures 3 -- \\
    --nproc-per-node 1 --max-restarts 0 train.py
"""


def _setup(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    work = tmp_path / "work"
    (work / "state").mkdir(parents=True)
    (work / "train.py").write_text(TRAIN)
    env = {"WORK": str(work), "NVRX_TEST_TOKEN": uuid.uuid4().hex, "PYTHONPATH": str(REPO)}
    return work, env


def _runs(work: Path) -> list[dict]:
    path = work / "ran.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output)"


def test_requeue_after_exit_16_runs_the_same_job_again_off_the_bad_node(slurm_cluster, tmp_path):
    work, env = _setup(tmp_path)
    (work / "job.sh").write_text(REQUEUE_JOB)
    out = work / "job.out"
    job_id = slurm_cluster.sbatch(f"--output={out}", str(work / "job.sh"), env=env, cwd=work)
    info = slurm_cluster.wait_job(job_id, timeout=120)
    text = _output(out)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert info.get("Restarts") == "1", (info, text)  # requeued once: the same job id ran twice
    first, second = _runs(work)
    assert first["run"] == f"{job_id}+0" and second["run"] == f"{job_id}+1", text
    assert second["node"] != first["node"], (first, second)  # kept off the node whose rank exited 16
    state = json.loads((work / "state" / "state.json").read_text())
    assert state["excluded_nodes"] == [first["node"]] and state["finished"], state
    assert [h["cause"] for h in state["history"]] == ["resume_elsewhere", "clean_exit"], state["history"]
    (sub,) = state["submitted"]
    assert sub["method"] == "requeue" and sub["command"][-2:] == ["requeue", job_id], sub
    assert "finished: the finished flag exists" in text, text
    assert not tagged_processes(env["NVRX_TEST_TOKEN"])


def test_auto_resume_script_as_the_batch_script_submits_the_continuation_with_exclude(slurm_cluster, tmp_path):
    work, env = _setup(tmp_path)
    shutil.copy(REPO / "scripts" / "auto_resume.sh", work / "auto_resume.sh")
    first_job = slurm_cluster.sbatch(f"--output={work}/auto-%j.out", str(work / "auto_resume.sh"),
                                     str(work / "state"), "--nproc-per-node", "1", "--max-restarts", "0",
                                     "--log-dir", str(work / "logs"), "train.py", env=env, cwd=work)
    info = slurm_cluster.wait_job(first_job, timeout=90)
    text = _output(work / f"auto-{first_job}.out")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text  # the continuation goes on
    state = json.loads((work / "state" / "state.json").read_text())
    (sub,) = state["submitted"]
    assert sub["ok"] and sub["method"] == "sbatch", sub
    bad = _runs(work)[0]["node"]
    assert f"--exclude={bad}" in sub["command"], sub
    second = slurm_cluster.wait_job(sub["job_id"], timeout=90)
    # The continuation is this script submitted again, without the first job's --output: Slurm's default name.
    text2 = "".join(_output(p) for p in work.glob(f"*{sub['job_id']}*.out")) or "(no output)"
    assert (second["JobState"], second["ExitCode"]) == ("COMPLETED", "0:0"), text2
    assert "auto_resume: training is finished" in text2, text2
    runs = _runs(work)
    assert [r["run"] for r in runs] == [f"{first_job}+0", f"{sub['job_id']}+0"] and runs[1]["node"] != bad, runs
    assert not tagged_processes(env["NVRX_TEST_TOKEN"])
