"""Just-in-time checkpoints under real `nvrx launch --jit-ckpt`, 2 DDP ranks on gloo (tests/ckpt/jit_train.py).

Every case faults at step 12, when no periodic save is in flight (the trainer records the newest checkpoint
then). A working JIT save makes the restart resume at 13 (the survivors' last completed step); every failure of
the JIT save ends with the restart resuming from that previous checkpoint, one clear line from the agent, no published checkpoint that is not complete, no partial
directory left behind after the resume, and no process left over.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from nvrx.ckpt import find_latest_checkpoint, list_checkpoints, verify_checkpoint
from tests.conftest import free_port, listening, monitor_dirs, tagged_processes, wait_for

HERE = Path(__file__).resolve().parent
FAULT_AT, STEPS = 12, 20
# Only the hung rank is in section "work" (rank 0 blocked in the all-reduce with it stays unjudged: without
# heartbeats it has no deadline): a hang whose rank the monitor can tell apart from the ranks waiting for it.
HANG = ("--ft-param-rank-section-timeouts", "work:2", "--ft-param-workload-check-interval", "0.2")


def launch(launcher, out: Path, fault: str, *extra: str, env: dict | None = None, timeout: float = 180, nproc: int = 2):
    out.mkdir(parents=True, exist_ok=True)
    return launcher.run("--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", "--async-ckpt", "--jit-ckpt",
                        *extra, str(HERE / "jit_train.py"), str(out), str(STEPS), fault, str(FAULT_AT),
                        env=env, timeout=timeout)


def starts(out: Path, attempt: int) -> set[int]:
    return {json.loads((out / f"start-a{attempt}-r{r}.json").read_text())["start"] for r in (0, 1)}


def agent_lines(stderr: str, needle: str) -> list[str]:
    return [line for line in stderr.splitlines() if needle in line and "nvrx.launcher.agent" in line]


def check_clean(launcher, root: Path) -> None:
    """Every listed checkpoint is complete, nothing unfinished is left, no process is left over."""
    for info in list_checkpoints(root):
        verify_checkpoint(info.path)
    assert [p.name for p in root.iterdir() if p.name.startswith(".") and "partial" in p.name] == []
    assert launcher.leftovers() == []


def assert_fell_back(launcher, res, out: Path, why: str, root: Path | None = None) -> None:
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = agent_lines(res.stderr, "no just-in-time checkpoint")
    assert why in line and "newest periodic/local checkpoint" in line, line
    before = json.loads((out / "before.json").read_text())
    assert before["steps"] > 0 and starts(out, 1) == {before["steps"]}  # the previous checkpoint was used
    assert not any(p.name.startswith("jit_step_") for p in (root or out / "ckpts").iterdir())
    check_clean(launcher, root or out / "ckpts")


def test_a_crash_resumes_from_the_survivors_last_completed_step(launcher, tmp_path):
    res = launch(launcher, tmp_path / "jit", "crash")
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = agent_lines(res.stderr, "just-in-time checkpoint of step")
    assert f"step {FAULT_AT + 1} saved" in line and "jit_step_000000013" in line
    assert starts(tmp_path / "jit", 1) == {FAULT_AT + 1}  # one step lost at most, not those since the last save
    check_clean(launcher, tmp_path / "jit" / "ckpts")
    # the same training as without any fault: the JIT state is exactly the state of that step
    clean = launch(launcher, tmp_path / "clean", "none")
    assert clean.returncode == 0, clean.stderr[-3000:]
    final = json.loads((tmp_path / "jit" / "final.json").read_text())
    assert final == json.loads((tmp_path / "clean" / "final.json").read_text())


def test_a_hang_killed_by_its_monitor_is_saved_too(launcher, tmp_path):
    res = launch(launcher, tmp_path, "hang", *HANG)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "section timeout" in res.stderr or "section_timeout" in res.stderr, res.stderr[-2000:]
    (line,) = agent_lines(res.stderr, "just-in-time checkpoint of step")
    assert f"step {FAULT_AT + 1} saved" in line
    assert starts(tmp_path, 1) == {FAULT_AT + 1}
    check_clean(launcher, tmp_path / "ckpts")


# Failed in the full CI-flow suite (1 of 2 runs, serial, quiet machine) while passing alone and in this file's own
# runs: a race between the stopped rank's monitor and the waiting peer's, not yet found. Still run and reported
# (XPASS / XFAIL) until it is fixed; the other JIT cases cover the save itself.
@pytest.mark.xfail(strict=False, reason="races in the full suite: the SIGSTOP hang's JIT save (issue 30 follow-up)")
def test_a_stopped_rank_is_the_hang_and_its_waiting_peer_saves(launcher, tmp_path):
    # Heartbeats on both ranks: rank 0 falls silent in the all-reduce just after rank 1 stops. Its monitor leaves
    # the hang to the stopped peer's monitor, so rank 0 lives to save.
    res = launch(launcher, tmp_path, "stop", "--ft-param-auto-heartbeat", "true",
                 "--ft-param-rank-heartbeat-timeout", "4", "--ft-param-workload-check-interval", "0.2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "killed by SIGKILL by its monitor: heartbeat timeout" in res.stderr
    (line,) = agent_lines(res.stderr, "just-in-time checkpoint of step")
    assert f"step {FAULT_AT + 1} saved" in line
    assert starts(tmp_path, 1) == {FAULT_AT + 1}
    check_clean(launcher, tmp_path / "ckpts")


def test_a_second_failure_during_the_jit_save_falls_back(launcher, tmp_path):
    res = launch(launcher, tmp_path, "second")
    assert_fell_back(launcher, res, tmp_path, "went away during the save")


def test_another_rank_dying_during_the_jit_save_does_not_tear_it(launcher, tmp_path):
    # 3 ranks: rank 1 crashes, rank 0 saves, rank 2 is SIGKILLed while rank 0 writes. The save needs no other
    # rank (no collective): it completes, and it is exactly the state of the last completed step.
    res = launch(launcher, tmp_path / "jit", "other", nproc=3)
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = agent_lines(res.stderr, "just-in-time checkpoint of step")
    assert f"step {FAULT_AT + 1} saved" in line and "jit_step_000000013" in line
    assert starts(tmp_path / "jit", 1) == {FAULT_AT + 1}
    check_clean(launcher, tmp_path / "jit" / "ckpts")
    clean = launch(launcher, tmp_path / "clean", "none", nproc=3)
    assert clean.returncode == 0, clean.stderr[-3000:]
    # (3 ranks: gloo's all-reduce may add in another order run to run, so last-bit differences; a step more or
    # less would move the parameters by ~lr = 0.01)
    got, want = (json.loads((tmp_path / d / "final.json").read_text())["params"] for d in ("jit", "clean"))
    diff = max(abs(a - b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
    assert diff < 1e-5, diff


def test_a_save_past_the_bound_is_abandoned_and_its_torn_files_are_swept(launcher, tmp_path):
    res = launch(launcher, tmp_path, "torn", "--jit-ckpt-timeout", "1.5", "--term-timeout", "1")
    assert_fell_back(launcher, res, tmp_path, "no answer within 1.5 s: abandoned")


def test_a_survivor_inside_optimizer_step_is_not_saved(launcher, tmp_path):
    res = launch(launcher, tmp_path, "stuck", "--jit-ckpt-timeout", "1.5", "--term-timeout", "1")
    assert_fell_back(launcher, res, tmp_path, "inside optimizer.step()")


def test_a_full_disk_falls_back(launcher, tmp_path, tmpfs):
    root = tmpfs("8m")
    res = launch(launcher, tmp_path, "full", env={"JIT_TEST_CKPTS": str(root)})
    assert_fell_back(launcher, res, tmp_path, "No space left on device", root=root)


def test_without_the_option_nothing_is_asked(launcher, tmp_path):
    out = tmp_path
    out.mkdir(exist_ok=True)
    res = launcher.run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--async-ckpt",
                       str(HERE / "jit_train.py"), str(out), str(STEPS), "crash", str(FAULT_AT), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "just-in-time" not in res.stderr
    before = json.loads((out / "before.json").read_text())
    assert starts(out, 1) == {before["steps"]} and before["steps"] < FAULT_AT + 1
    newest = find_latest_checkpoint(out / "ckpts")
    assert newest is not None and not newest.path.name.startswith("jit_")


def test_jit_ckpt_timeout_without_jit_ckpt_is_one_line(launcher, tmp_path):
    res = launcher.run("--standalone", "--nproc-per-node", "1", "--jit-ckpt-timeout", "3",
                       str(HERE / "jit_train.py"), str(tmp_path), "1", "none", "0", timeout=60)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--jit-ckpt-timeout needs --jit-ckpt" in lines[0] and "Traceback" not in res.stderr


def _node_processes(launcher, tag: str) -> list[psutil.Process]:
    found = []
    for proc in tagged_processes(launcher.token):
        try:
            if proc.environ().get("JIT_TEST_NODE") == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def test_a_node_lost_with_its_agent_is_saved_by_the_other_node(launcher, tmp_path):
    # Two agents on loopback (one rank each) and a standby; the second node is SIGKILLed whole (agent, monitor,
    # rank, writer) while the first node's rank waits in an all-reduce. Nobody reports the lost rank: the survivor's
    # failed collective ends the round (keepalive_timeout 30 s would take far longer), its rank saves the state of
    # the last completed step, and the next round (the survivor and the standby) resumes from it.
    out, logs = tmp_path, tmp_path / "logs"
    port = free_port()
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "jitnode",
            "--log-dir", str(logs),
            "--rdzv-conf", "last_call_timeout=30,keepalive_interval=0.5,keepalive_timeout=30", "--max-restarts", "1",
            "--async-ckpt", "--jit-ckpt", str(HERE / "jit_train.py"), str(out), str(STEPS), "node", str(FAULT_AT)]
    host = launcher.start(*args)
    assert wait_for(lambda: listening(port), 60)
    lost = launcher.start(*args, env={"JIT_TEST_NODE": "lost"})
    assert wait_for(lambda: (out / "node-fault.json").exists(), 120), host.poll()
    standby = launcher.start(*args)
    dirs = monitor_dirs(_node_processes(launcher, "lost"))
    assert len(dirs) == 1, dirs  # the lost node's monitor
    for _ in range(3):  # every process of the node at once (a process forked meanwhile is caught by the next pass)
        for proc in _node_processes(launcher, "lost"):
            with contextlib.suppress(psutil.Error, OSError):
                proc.send_signal(signal.SIGKILL)
    lost.wait(timeout=30)
    for gone in dirs:  # nothing of the node was left to remove its monitor's socket directory
        shutil.rmtree(gone, ignore_errors=True)
    _, err = host.communicate(timeout=180)
    _, err_standby = standby.communicate(timeout=60)
    assert host.returncode == 0 and standby.returncode == 0, err[-3000:] + err_standby[-2000:]
    assert "a peer is gone" in err and "(a node lost with its agent?)" in err, err[-3000:]
    (line,) = agent_lines(err, "just-in-time checkpoint of step")
    assert f"step {FAULT_AT + 1} saved" in line and "jit_step_000000013" in line, line
    assert {json.loads(p.read_text())["start"] for p in out.glob("start-a1-r*.json")} == {FAULT_AT + 1}
    check_clean(launcher, out / "ckpts")
    # nvrx inspect names the cause as far as it is known, and the JIT outcome, on the fault's stop line
    report = subprocess.run([sys.executable, "-m", "nvrx", "inspect", str(logs)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert report.returncode == 0, report.stderr[-2000:]
    (stop,) = [ln for ln in report.stdout.splitlines() if "round 0 stopped" in ln]
    assert "a peer of rank 0 was lost without a word from its node" in stop, stop
    assert f"just-in-time checkpoint of step {FAULT_AT + 1} saved" in stop and "resumed from it" in stop, stop
