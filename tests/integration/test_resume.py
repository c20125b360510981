"""End-to-end `nvrx resume -- nvrx launch ...`: real launches of a 2-rank gloo job, the state file and
events on disk, signal forwarding, bad input; the process tree is checked after each test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, Launcher, one_line_error, write_script

TRAIN = r'''
import json, os, signal, sys, time
import torch, torch.distributed as dist
from nvrx.launcher.rank.job_control import mark_finished

work, mode = sys.argv[1], sys.argv[2]
attempt = int(os.environ["NVRX_RESUME_ATTEMPT"])
terms = []
signal.signal(signal.SIGTERM, lambda s, f: terms.append(s))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([1.0])
dist.all_reduce(t)
assert t.item() == world == 2
with open(os.path.join(work, f"ran.{attempt}.{rank}"), "w") as fh:
    json.dump({"flag": os.environ["FAULT_TOL_FINISHED_FLAG_FILE"], "pid": os.getpid()}, fh)
if mode == "fail_then_finish":
    if attempt == 1:
        sys.exit(1 if rank == 1 else 0)
    dist.barrier()
    if rank == 0:
        mark_finished()
elif mode == "always_fail":
    if rank == 1:
        print(f"rank 1 fails in attempt {attempt}", flush=True)
        sys.exit(5)
elif mode == "stuck":
    if rank == 0:
        with open(os.path.join(work, "progress"), "w") as fh:
            fh.write("7\n")
elif mode == "wait_term":
    open(os.path.join(work, f"ready.{rank}"), "w").close()
    while not terms:
        time.sleep(0.02)
    time.sleep(0.5)  # "save a checkpoint"; a second signal would show up here
    with open(os.path.join(work, f"saved.{rank}"), "w") as fh:
        fh.write(str(len(terms)))
elif mode == "finish":
    if rank == 0:
        mark_finished()
'''


class Resume(Launcher):
    """Runs `nvrx resume` as a real subprocess, tagged so that leftovers can be found."""

    subcommand = "resume"
    default_timeout = 90.0

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.state_dir = tmp_path / "state"
        self.state_dir.mkdir()
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.script = write_script(tmp_path / "train.py", TRAIN)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = super().env(extra)
        if "FAULT_TOL_FINISHED_FLAG_FILE" not in (extra or {}):
            env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)  # an outer run's flag must not end this one
        return env

    def launch(self, mode: str, *resume_args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("--state-dir", str(self.state_dir), *resume_args, "--", "nvrx", "launch",
                        "--nproc-per-node", "2", "--standalone", "-q", str(self.script), str(self.work), mode, **kw)

    def start_waiting(self) -> subprocess.Popen:
        """Start a 2-rank `wait_term` attempt; return once both ranks are ready (fails if it ends first)."""
        proc = self.start("--state-dir", str(self.state_dir), "--", "--nproc-per-node", "2", "--standalone",
                          "-q", str(self.script), str(self.work), "wait_term")
        deadline = time.monotonic() + 60
        while not all((self.work / f"ready.{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        return proc

    def state(self) -> dict:
        return json.loads((self.state_dir / "state.json").read_text())

    def events(self) -> list[dict]:
        return [json.loads(line) for line in (self.state_dir / "resume.jsonl").read_text().splitlines()]


@pytest.fixture
def resume(tmp_path: Path):
    r = Resume(tmp_path)
    yield r
    r.cleanup()


# ---------------------------------------------------------------- real launches

def test_fails_once_then_finishes_on_second_attempt(resume):
    res = resume.launch("fail_then_finish", "--max-failures", "3")
    assert res.returncode == 0, res.stderr
    st = resume.state()
    assert (st["attempts"], st["failures"], st["finished"]) == (2, 1, True)
    assert [h["cause"] for h in st["history"]] == ["failed", "clean_exit"]
    assert [h["exit_code"] for h in st["history"]] == [1, 0]
    flag = resume.state_dir / "finished.flag"
    assert flag.exists()
    ranks = json.loads((resume.work / "ran.2.1").read_text())
    assert ranks["flag"] == str(flag)  # every rank got FAULT_TOL_FINISHED_FLAG_FILE
    evs = [e["ev"] for e in resume.events()]
    assert evs.count("resume_attempt_start") == evs.count("resume_attempt_end") == 2
    decisions = [e for e in resume.events() if e["ev"] == "resume_decision"]
    assert [d["action"] for d in decisions] == ["continue", "finished"]
    assert all(e["src"] == "resume" for e in resume.events())
    assert "relaunching" in res.stderr and "finished" in res.stderr.splitlines()[-1]
    assert resume.leftovers() == []
    # the run is finished: another invocation (e.g. a stray continuation job) launches nothing
    again = resume.launch("fail_then_finish")
    assert again.returncode == 0 and "already finished" in again.stderr
    assert not (resume.work / "ran.3.0").exists()


def test_always_failing_job_gives_up_after_max_failures(resume):
    # an earlier job of the chain failed (recorded by a bash loop); this job's launch fails too
    pre = resume.run("--state-dir", str(resume.state_dir), "--exit-code", "1", "--max-failures", "2")
    assert pre.returncode == 3, pre.stderr
    res = resume.launch("always_fail", "--max-failures", "2", "--max-attempts", "10")
    assert res.returncode == 4, res.stderr
    assert "--max-failures 2" in res.stderr.splitlines()[-1]
    assert "rank 1 fails in attempt 2" in res.stdout + res.stderr
    st = resume.state()
    assert (st["attempts"], st["failures"], st["last_exit_code"]) == (2, 2, 1)
    assert not (resume.work / "ran.3.0").exists()
    assert resume.leftovers() == []
    # budget spent: the next job gives up at once, without launching
    again = resume.launch("always_fail", "--max-failures", "2")
    assert again.returncode == 4 and "--max-failures 2" in again.stderr
    assert not (resume.work / "ran.3.0").exists()


def test_no_progress_stops_a_restart_storm(resume):
    (resume.work / "progress").write_text("7\n")
    res = resume.launch("stuck", "--progress-file", str(resume.work / "progress"), "--max-no-progress", "2",
                        "--max-attempts", "10", "--max-failures", "0")
    assert res.returncode == 4, res.stderr
    last = res.stderr.splitlines()[-1]
    assert "no progress" in last and "stuck at 7" in last
    st = resume.state()
    assert (st["attempts"], st["no_progress"], st["failures"]) == (2, 2, 0)
    assert resume.leftovers() == []


def test_sigterm_is_forwarded_once_and_ends_as_continue(resume):
    proc = resume.start_waiting()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    for rank in (0, 1):  # each rank saw exactly one SIGTERM and had time to "save"
        assert (resume.work / f"saved.{rank}").read_text() == "1"
    st = resume.state()
    assert (st["attempts"], st["failures"], st["last_cause"], st["last_exit_code"]) == (1, 0, "interrupted", 143)
    sig = [e for e in resume.events() if e["ev"] == "resume_signal"]
    assert len(sig) == 1 and sig[0]["signal"] == "SIGTERM" and sig[0]["forwarded"] is True
    assert resume.leftovers() == []
    # the next job sees the same state: one attempt, interrupted, nothing given up
    res = resume.run("--state-dir", str(resume.state_dir), "--check")
    assert res.returncode == 3 and "attempts so far 1, failures 0" in res.stderr


# ---------------------------------------------------------------- record mode and state recovery (no launch)

def test_record_mode_and_corrupt_state_keeps_counts(resume):
    d = str(resume.state_dir)
    assert resume.run("--state-dir", d, "--exit-code", "143").returncode == 3
    assert resume.run("--state-dir", d, "--exit-code", "1").returncode == 3
    bad = b'{"version": 1, "attempts": '
    (resume.state_dir / "state.json").write_bytes(bad)
    res = resume.run("--state-dir", d, "--exit-code", "1", "--max-failures", "2")
    assert res.returncode == 4, res.stderr  # failures 1 (recovered) + 1 = --max-failures 2
    assert "Traceback" not in res.stderr
    warn = [ln for ln in res.stderr.splitlines() if "corrupt" in ln]
    assert len(warn) == 1 and "kept it as state.json.corrupt-" in warn[0] and "failures 1" in warn[0]
    copies = list(resume.state_dir.glob("state.json.corrupt-*"))
    assert len(copies) == 1 and copies[0].read_bytes() == bad
    st = resume.state()
    assert (st["attempts"], st["failures"]) == (3, 2)
    assert resume.run("--state-dir", d, "--check", "--max-failures", "2").returncode == 4
    assert resume.run("--state-dir", d, "--check", "--max-failures", "5").returncode == 3
    (resume.state_dir / "finished.flag").touch()
    assert resume.run("--state-dir", d, "--check").returncode == 0


def test_stop_ends_the_chain_until_reset(resume):
    d = str(resume.state_dir)
    assert resume.run("--state-dir", d, "--exit-code", "143").returncode == 3  # interrupted: would continue
    res = resume.run("--state-dir", d, "--stop")
    assert res.returncode == 4, res.stderr
    assert resume.state()["stopped"] == "stopped on purpose with nvrx resume --stop"
    res = resume.launch("ok")  # the pending continuation: gives up without launching
    assert res.returncode == 4 and "--stop" in res.stderr, res.stderr
    assert not any(e["ev"] == "resume_attempt_start" for e in resume.events())
    assert resume.run("--state-dir", d, "--check", "--reset").returncode == 3
    assert resume.leftovers() == []


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing runs

def test_missing_state_dir(resume, tmp_path):
    one_line_error(resume.run("--state-dir", str(tmp_path / "nope"), "--", str(resume.script)),
                    "does not exist", "mkdir -p")
    assert not (tmp_path / "nope").exists()


def test_state_dir_is_a_file(resume, tmp_path):
    (tmp_path / "f").write_text("x")
    one_line_error(resume.run("--state-dir", str(tmp_path / "f"), "--exit-code", "0"), "not a directory")


def test_unwritable_state_dir(resume, tmp_path):
    if os.geteuid() == 0:
        target = Path("/sys")  # root may write anywhere else
    else:
        target = tmp_path / "ro"
        target.mkdir(mode=0o500)
    one_line_error(resume.run("--state-dir", str(target), "--exit-code", "0"), "not writable")


def test_unrecoverable_state_file(resume):
    bad = b"\x00garbage"
    (resume.state_dir / "state.json").write_bytes(bad)
    line = one_line_error(resume.run("--state-dir", str(resume.state_dir), "--", str(resume.script)),
                           "corrupt", "--reset")
    assert "state.json.corrupt-" in line
    assert (resume.state_dir / "state.json").read_bytes() == bad  # nothing replaced with zero counts
    assert not list(resume.work.iterdir())  # nothing launched


def fake_slurm_tools(bin_dir: Path, **bodies: str) -> str:
    """Shell scripts named after BODIES' keys (sbatch, scontrol) in BIN_DIR; returns a PATH that finds them first."""
    bin_dir.mkdir()
    for name, body in bodies.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{os.environ.get('PATH', '')}"


def test_wrongly_typed_state_file_is_one_line_and_kept(resume, tmp_path):
    path = fake_slurm_tools(tmp_path / "bin", sbatch="echo 777", scontrol="echo JobId=9; echo '   Command=/bin/true'")
    bad = b'{"version":1,"seq":3,"attempts":1,"failures":0,"submitted":["x"],"excluded_nodes":[5]}'
    (resume.state_dir / "state.json").write_bytes(bad)
    res = resume.run("--state-dir", str(resume.state_dir), "--submit", "--exit-code", "16",
                     env={"PATH": path, "SLURM_JOB_ID": "9"})
    line = one_line_error(res, "state.json is corrupt", "excluded_nodes holds 5, not a string", "--reset")
    assert "state.json.corrupt-" in line
    assert (resume.state_dir / "state.json").read_bytes() == bad  # not rewritten, nothing submitted


def test_exit_16_excludes_the_node_whose_rank_exited_not_the_batch_host(resume, tmp_path):
    from tests.unit.test_resume import write_agent_logs

    args_file = tmp_path / "sbatch.args"
    path = fake_slurm_tools(tmp_path / "bin", sbatch=f'echo "$@" > {args_file}; echo 778',
                            scontrol="echo JobId=55; echo '   Command=/bin/true'")
    logs = tmp_path / "logs"
    write_agent_logs(logs / "55", bad="n2")
    slurm = {"PATH": path, "SLURM_JOB_ID": "55", "SLURMD_NODENAME": "n1", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_JOB_NODELIST": "n[1-2]"}
    res = resume.run("--state-dir", str(resume.state_dir), "--submit", "--launch-log-dir", str(logs),
                     "--exit-code", "16", env=slurm)
    assert res.returncode == 3, res.stderr
    assert "--exclude=n2" in args_file.read_text() and "n1" not in args_file.read_text()
    assert resume.state()["excluded_nodes"] == ["n2"]


def test_sbatch_not_on_path(resume, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    res = resume.run("--state-dir", str(resume.state_dir), "--submit", "--", "--nproc-per-node", "2", "--standalone",
                     str(resume.script), str(resume.work), "finish",
                     env={"PATH": str(empty), "SLURM_JOB_ID": "4242"})
    one_line_error(res, "`sbatch` is not on PATH", "--submit")
    assert not list(resume.work.iterdir())  # found before anything ran
    res = resume.run("--state-dir", str(resume.state_dir), "--requeue", "--exit-code", "143",
                     env={"PATH": str(empty), "SLURM_JOB_ID": "4242"})
    one_line_error(res, "`scontrol` is not on PATH", "--requeue")


def test_submit_needs_a_job_id(resume, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    sbatch = fake_bin / "sbatch"  # never run: the job id check comes first
    sbatch.write_text("#!/bin/sh\nexit 99\n")
    sbatch.chmod(0o755)
    res = resume.run("--state-dir", str(resume.state_dir), "--submit", "--exit-code", "143",
                     env={"PATH": f"{fake_bin}:{os.environ.get('PATH', '')}"})
    one_line_error(res, "SLURM_JOB_ID", "--job-id")


@pytest.mark.parametrize("args,needle", [
    ([], "nothing to do"),
    (["--exit-code", "1", "--check"], "cannot be combined"),
    (["--submit", "--requeue", "--exit-code", "1"], "--submit and --requeue"),
    (["--max-no-progress", "2", "--exit-code", "1"], "--progress-file"),
    (["--sbatch-script", "x.sh", "--exit-code", "1"], "only applies with --submit"),
    (["--exit-code", "300"], "--exit-code"),
    (["--max-failures", "-1", "--exit-code", "1"], "--max-failures"),
    (["--exec", "--", "no-such-program-xyz"], "not on PATH"),
])
def test_bad_flags(resume, args, needle):
    one_line_error(resume.run("--state-dir", str(resume.state_dir), *args), needle)
    assert not (resume.state_dir / "state.json").exists()


def test_auto_resume_script_bash_loop(resume, tmp_path):
    script = write_script(tmp_path / "light.py", (
        "import os, sys\n"
        "from nvrx.launcher.rank.job_control import mark_finished\n"
        "count = os.path.join(sys.argv[1], 'count')\n"
        "n = int(open(count).read()) if os.path.exists(count) else 0\n"
        "open(count, 'w').write(str(n + 1))\n"
        "sys.exit(9) if n == 0 else mark_finished()\n"))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "auto_resume.sh"), str(resume.state_dir / "run"),
                           "--nproc-per-node", "1", "--standalone", "-q", str(script), str(resume.work)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=90,
                          env=resume.env({"NVRX": f"{sys.executable} -m nvrx",
                                          "RESUME_ARGS": "--max-failures 2"}))
    assert proc.returncode == 0, proc.stderr
    assert "training is finished" in proc.stderr
    st = json.loads((resume.state_dir / "run" / "state.json").read_text())
    assert (st["attempts"], st["failures"], st["finished"]) == (2, 1, True)
    assert [h["exit_code"] for h in st["history"]] == [1, 0]
    assert (resume.state_dir / "run" / "finished.flag").exists()
    assert resume.leftovers() == []


def test_killed_driver_leaves_no_orphans_and_the_attempt_is_counted(resume):
    proc = resume.start_waiting()
    proc.kill()  # SIGKILL: nothing can be forwarded; the launch gets its parent-death signal
    proc.communicate(timeout=30)
    assert resume.leftovers(wait=30) == []
    for rank in (0, 1):  # the agent stopped the ranks gracefully
        assert (resume.work / f"saved.{rank}").read_text() == "1"
    res = resume.run("--state-dir", str(resume.state_dir), "--check")
    assert res.returncode == 3 and "attempts so far 1" in res.stderr and "lost" in res.stderr
