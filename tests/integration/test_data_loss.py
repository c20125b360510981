"""Nothing of the user's is lost or overwritten (issue 26, "Data loss"): names that would escape the job's
directories, a --local-ckpt-dir session the user made, planted symbolic links, full file systems.

Every case runs the real `nvrx launch` (agent, ranks) as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ckpt.conftest import tmpfs  # noqa: F401  (a fixture: small real file systems)
from tests.conftest import one_line_error, run_events, wait_for, write_script


@pytest.fixture
def script(tmp_path: Path) -> Path:
    return write_script(tmp_path / "ok.py", "print('hello')\n")


@pytest.mark.parametrize("args,needles", [
    (["--rdzv-id", ".."], ["--rdzv-id '..'", "not a usable name"]),
    (["--rdzv-id", "."], ["--rdzv-id '.'", "not a usable name"]),
    (["--rdzv-id", ""], ["--rdzv-id empty", "not a usable name"]),
    (["--rdzv-id", "a/b"], ["--rdzv-id 'a/b'", "path separator"]),
    (["--rdzv-id", "a\nb"], ["--rdzv-id 'a\\nb'", "control character"]),
    (["--rdzv-id", "x" * 300], ["--rdzv-id is 300 characters long", "at most 128"]),
    (["--role", "../x"], ["--role '../x'", "path separator"]),
    (["--role", ".."], ["--role '..'", "not a usable name"]),
    (["--role", ""], ["--role empty"]),
])
def test_names_that_would_escape_the_job_directories_are_refused(launcher, script, tmp_path, args, needles):
    logs = tmp_path / "logs" / "inner"
    logs.mkdir(parents=True)
    res = launcher.run("--standalone", "--log-dir", str(logs), *args, str(script), timeout=60)
    one_line_error(res, *needles)
    assert sorted(p.name for p in logs.parent.iterdir()) == ["inner"], "nothing may be written beside --log-dir"
    assert list(logs.iterdir()) == []
    assert launcher.leftovers(wait=0.5) == []


LOCAL_SAVE = """
from nvrx.ckpt.local import LocalCheckpointManager, default_root
LocalCheckpointManager(default_root()).save({"x": 1}, iteration=2)  # the job's session: <root>/<run id>
"""


def test_a_users_own_directory_named_like_the_run_is_never_removed(launcher, tmp_path: Path) -> None:
    """--local-ckpt-dir D --rdzv-id X where D/X is the user's: the job succeeds and D/X keeps every file."""
    root = tmp_path / "local"
    notes = root / "X" / "data" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")
    (root / "X").chmod(0o700)  # private, as the local tier asks of a session it saves into
    script = write_script(tmp_path / "train.py", LOCAL_SAVE)
    done = launcher.run("--standalone", "--rdzv-id", "X", "--local-ckpt-dir", str(root), str(script))
    assert done.returncode == 0, done.stderr
    assert notes.read_text() == "mine"
    assert (root / "X" / "rank0" / "iter_000000002_0_local.nvrxl").is_file()  # not proven nvrx's: kept as well
    assert "was not made by nvrx" in done.stderr
    assert launcher.leftovers() == []


def test_removal_of_the_jobs_own_session_keeps_what_nvrx_did_not_write(launcher, tmp_path: Path) -> None:
    """The session nvrx made is removed on success, but a link planted in it is not followed and a file nvrx
    did not write stays (with its directories)."""
    root, elsewhere = tmp_path / "local", tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    (elsewhere / "keep" / "iter_000000001_0_local.nvrxl").write_text("not a checkpoint of this job")
    script = write_script(tmp_path / "train.py", LOCAL_SAVE + f"""
import json
import os
import json
import os
import re
import subprocess
import sys
from pathlib import Path
session = Path(default_root()) / os.environ["TORCHELASTIC_RUN_ID"]
(session / "rank1").symlink_to({str(elsewhere / "keep")!r}, target_is_directory=True)
(session / "rank0" / "user.txt").write_text("kept")
""")
    done = launcher.run("--standalone", "--rdzv-id", "own", "--local-ckpt-dir", str(root), str(script))
    assert done.returncode == 0, done.stderr
    assert (elsewhere / "keep" / "iter_000000001_0_local.nvrxl").read_text() == "not a checkpoint of this job"
    assert sorted(p.name for p in (root / "own" / "rank0").iterdir()) == ["user.txt"]  # the checkpoint is gone
    assert (root / "own" / "rank1").is_symlink()
    assert launcher.leftovers() == []


def test_a_planted_output_link_is_not_followed(launcher, tmp_path: Path) -> None:
    """A stdout.log symbolic link left in the run directory: the rank's output goes to a new file of the job; the
    link's target keeps its contents and its mode."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    rank_dir = tmp_path / "logs" / "planted" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    for d in (rank_dir, rank_dir.parent, rank_dir.parent.parent):
        d.chmod(0o700)
    (rank_dir / "stdout.log").symlink_to(victim)
    script = write_script(tmp_path / "train.py", "print('rank output')\n")
    done = launcher.run("--standalone", "--rdzv-id", "planted", "--log-dir", str(tmp_path / "logs"),
                        "--redirects", "3", str(script))
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644
    out = rank_dir / "stdout.log"
    assert not out.is_symlink() and out.read_text() == "rank output\n" and out.stat().st_mode & 0o777 == 0o600
    assert launcher.leftovers() == []


@pytest.mark.parametrize("owner,mode,needle", [
    (12345, 0o700, "belongs to uid 12345"),
    (None, 0o777, "can be written by others (mode 0777)"),
])
def test_a_run_directory_nvrx_did_not_make_is_refused(launcher, tmp_path: Path, owner, mode, needle) -> None:
    """<log-dir>/<run id> prepared by another user (or open to everyone), holding a planted stdout.log link: one
    line, exit 2, nothing written through the link."""
    if owner is not None and os.geteuid() != 0:
        pytest.skip("making a directory of another user needs root")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run_dir = tmp_path / "logs" / "12345"
    (run_dir / "attempt_0" / "0").mkdir(parents=True)
    (run_dir / "attempt_0" / "0" / "stdout.log").symlink_to(victim)
    run_dir.chmod(mode)
    if owner is not None:
        for d in (run_dir, run_dir / "attempt_0", run_dir / "attempt_0" / "0"):
            os.chown(d, owner, owner)
    script = write_script(tmp_path / "train.py", "print('rank output')\n")
    res = launcher.run("--standalone", "--rdzv-id", "12345", "--log-dir", str(tmp_path / "logs"), "--redirects", "3",
                       str(script), timeout=60)
    one_line_error(res, "--log-dir", str(run_dir), needle)
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0"]  # no event file, no monitor log
    assert launcher.leftovers(wait=0.5) == []


def test_event_files_do_not_follow_a_planted_link(tmp_path: Path) -> None:
    """The event writer (agent and monitors alike) refuses a link at its path: nothing written through it."""
    from nvrx.events import EventLog

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    (tmp_path / "agent-n-1.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        EventLog(tmp_path / "agent-n-1.jsonl", source="agent")
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644


WAIT_FOR_SPACE = """
import os, sys, time
from pathlib import Path
work = Path(sys.argv[1])
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(1)  # the first attempt fails: the restart is where a full log file system used to end the job
(work / "started").write_text("")
deadline = time.monotonic() + 120
while not (work / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0 if (work / "go").exists() else 3)
"""


def _fill(mount: Path) -> Path:
    """Fill MOUNT until it has no space left; the filler file (remove it to give the space back)."""
    filler = mount / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return filler


def test_a_full_log_file_system_does_not_end_the_job(launcher, tmp_path: Path, tmpfs) -> None:
    """Events cannot be written (ENOSPC) from before the first round: the health checks pass, the failed first
    attempt is restarted, one line says events are dropped; once space returns, events are written again (with
    the count of those dropped) and the job ends 0."""
    logs = tmpfs("1m", name="logs")
    (logs / "full").mkdir(mode=0o700)
    filler = _fill(logs)
    script = write_script(tmp_path / "train.py", WAIT_FOR_SPACE)
    proc = launcher.start("--standalone", "--rdzv-id", "full", "--log-dir", str(logs / "full"), "--max-restarts",
                          "1", str(script), str(tmp_path))
    assert wait_for(lambda: (tmp_path / "started").exists() or proc.poll() is not None, 120), "no second attempt"
    assert proc.poll() is None, proc.communicate()
    filler.unlink()  # space returns while the job runs
    (tmp_path / "go").write_text("")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    dropping = [ln for ln in err.splitlines() if "dropping events" in ln]
    assert len(dropping) == 1, err
    again = [ln for ln in err.splitlines() if "events are written to" in ln and "event(s) were dropped" in ln]
    assert len(again) == 1 and re.search(r"again; [1-9]\d* event\(s\) were dropped", again[0]), err
    events = run_events(logs / "full" / "full", "agent-")
    assert events[-1]["ev"] == "job_end" and events[-1]["status"] == "succeeded"
    assert launcher.leftovers() == []


def test_a_full_shared_file_system_is_not_a_bad_node(launcher, tmp_path: Path, tmpfs) -> None:
    """The shared-storage health check fails (ENOSPC): the agent says so in one line naming the path and exits 18,
    and `nvrx resume` on that exit relaunches without excluding the node (it excluded it on exit 16 before)."""
    import socket

    from tests.integration.test_resume import fake_slurm_tools

    shared = tmpfs("1m", name="shared")
    _fill(shared)
    script = write_script(tmp_path / "train.py", "raise SystemExit('must not run')\n")
    logs = tmp_path / "logs"
    res = launcher.run("--standalone", "--rdzv-id", "55", "--log-dir", str(logs),
                       "--ft-param-enable_dist_storage_healthcheck", "true",
                       "--ft-param-storage_healthcheck_path", str(shared), str(script), timeout=120)
    assert res.returncode == 18, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if str(shared) in ln]
    assert len(lines) == 1 and "shared storage" in lines[0] and "exit 18" in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    health = [e for e in run_events(logs / "55", "agent-") if e["ev"] == "node_health"]
    assert health and health[-1]["ok"] is True and "shared storage" in health[-1]["action"]

    state = tmp_path / "state"
    state.mkdir()
    args_file = tmp_path / "sbatch.args"
    path = fake_slurm_tools(tmp_path / "bin", sbatch=f'echo "$@" > {args_file}; echo 778',
                            scontrol="echo JobId=55; echo '   Command=/bin/true'")
    env = {"PATH": path, "SLURM_JOB_ID": "55", "SLURMD_NODENAME": socket.gethostname(), "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": f"{socket.gethostname()},other"}
    launcher.subcommand = "resume"
    decided = launcher.run("--state-dir", str(state), "--submit", "--launch-log-dir", str(logs),
                           "--exit-code", str(res.returncode), env=env, timeout=60)
    assert decided.returncode == 3, decided.stderr  # continue
    assert "--exclude" not in args_file.read_text(), args_file.read_text()
    st = json.loads((state / "state.json").read_text())
    assert st["excluded_nodes"] == [] and st["last_cause"] == "storage_failed"
    assert launcher.leftovers() == []


MARK_FINISHED = """
import sys
from nvrx.launcher.rank.job_control import mark_finished
for _ in range(int(sys.argv[1])):
    mark_finished()
"""


def test_mark_finished_from_every_rank_of_two_nodes_with_the_same_pids(launcher, tmp_path: Path) -> None:
    """Two nodes (each launch in its own pid namespace: their ranks get the same pids) share the flag's file
    system and every rank calls mark_finished, many times: every call succeeds, the flag is there, no temporary
    is left. (Named by pid alone, the temporaries collided and a rename failed with FileNotFoundError.)"""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("two nodes with the same pids need unshare -p as root")
    flag = tmp_path / "shared" / "finished.flag"
    script = write_script(tmp_path / "train.py", MARK_FINISHED)
    env = {"FAULT_TOL_FINISHED_FLAG_FILE": str(flag)}
    nodes = []
    for node in ("a", "b"):
        cmd = [unshare, "-pf", "--mount-proc", sys.executable, "-m", "nvrx", "launch", "--standalone",
               "--nproc-per-node", "2", "--rdzv-id", f"node-{node}", str(script), "300"]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=launcher.env(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        launcher.procs.append(nodes[-1])
    for proc in nodes:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    assert flag.read_text().startswith("finished host=")
    assert sorted(p.name for p in flag.parent.iterdir()) == ["finished.flag"]
    assert launcher.leftovers() == []


def test_a_closed_event_log_writes_nothing_more(tmp_path: Path) -> None:
    """After close, an event goes to the listeners only: the file (perhaps on a file system being unmounted) is
    not opened again."""
    from nvrx.events import EventLog, JobEnd

    path = tmp_path / "run" / "agent-n-1.jsonl"
    events = EventLog(path, source="agent")
    events.close()
    path.unlink()
    events.emit(JobEnd(status="succeeded", exit_code=0))
    assert not path.exists()
