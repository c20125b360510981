"""Fault matrix: network partitions between emulated hosts (tests/hosts.py: network namespaces on a bridge).

Each agent runs on a host of its own with its own address and host name; the fault pulls a host's cable
(its switch port goes down) while its agent and ranks keep running, or freezes a host. Deadlines asserted here
are the guarantees of docs/faults.md ("Partitions"): a cut-off side stops its own ranks within store_timeout +
0.5 s, the survivors notice within keepalive_timeout + 0.5 s, both measured from the cut.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nvrx import ckpt
from nvrx.ckpt.publish import read_latest
from tests.conftest import pid_gone, wait_for
from tests.faults.conftest import ShmWatch, one_line


PORT = 29400  # the hosts' network is the test's own: the usual port cannot clash with anything
KA_INTERVAL, KA_TIMEOUT, STORE_TIMEOUT = 1.0, 3.0, 3.0
RDZV_CONF = (f"last_call_timeout=1,keepalive_interval={KA_INTERVAL},keepalive_timeout={KA_TIMEOUT},"
             f"store_timeout={STORE_TIMEOUT}")
SLACK = 0.5  # the guarantee's margin
RESUME_TRAIN = Path(__file__).parents[1] / "hosts_e2e" / "resume_train.py"  # nvrx.ckpt checkpoints, resumable


def _common(job, run_id: str, nnodes: str, steps: int, max_restarts: int = 3, conf: str = RDZV_CONF) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", f"{job.hosts[0].addr}:{PORT}",
            "--rdzv-id", run_id, "--max-restarts", str(max_restarts), "--rdzv-conf", conf,
            "--term-timeout", "2", *job.train(steps)]


def _world_running(job, run_id: str, world: int) -> int:
    """The attempt (restart count) of the newest round of WORLD ranks, once all its ranks train."""
    def newest() -> dict | None:
        rounds = [e for e in job.events(run_id) if e["ev"] == "rdzv_round" and e["world_size"] == world]
        return max(rounds, key=lambda e: e["t"]) if rounds else None

    assert wait_for(lambda: newest() is not None, 90), "no round with every host"
    attempt = newest()["restart_count"]
    for rank in range(world):
        job.wait_running(rank=rank, attempt=attempt, timeout=90)
    return attempt


class GoneClock:
    """When each of some pids was first seen gone (polled every 20 ms on a thread of its own)."""

    def __init__(self, pids: list[int]) -> None:
        self.gone: dict[int, float] = {}
        self._pids = pids
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.time() + 120
        while len(self.gone) < len(self._pids) and time.time() < deadline:
            for pid in self._pids:
                if pid not in self.gone and pid_gone(pid):
                    self.gone[pid] = time.time()
            time.sleep(0.02)

    def last(self, timeout: float) -> float:
        self._thread.join(timeout)
        assert len(self.gone) == len(self._pids), f"still running: {set(self._pids) - set(self.gone)}"
        return max(self.gone.values())


def _assert_thawed_agent_ended(job, run_id: str, host, proc, old_round: int) -> None:
    """A thawed host's agent either found the store gone (exit 1, one line) or joined a later round, never its old
    one again, and finished (exit 0)."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 1), err
    if proc.returncode == 1:
        assert "cut off from the rendezvous store" in one_line(err)
    else:
        rounds = [e["round"] for e in job.events(run_id, f"agent-{host.name}-") if e["ev"] == "rdzv_round"]
        assert rounds.count(old_round) == 1 and rounds[-1] > old_round, rounds


def _stop_time(job, run_id: str, host_name: str, kind: str) -> float:
    stops = [e for e in job.events(run_id, f"agent-{host_name}-") if e["ev"] == "rdzv_stop" and e["kind"] == kind]
    assert stops, f"{host_name} wrote no {kind} stop"
    return min(e["t"] for e in stops)


@pytest.mark.slow
def test_partition_cut_off_host_elastic(host_job):
    """Fault: partition: one host's link is cut for good while its agent and ranks keep running (elastic
    --nnodes 1:2, the other host holds the store).
    Outcome: the cut-off host stops its own ranks within store_timeout + 0.5 s and exits 1 ("cut off from the
    rendezvous store"); the other notices within keepalive_timeout + 0.5 s, goes on alone from the last
    checkpoint and finishes, exit 0. Nothing is left on either host.
    """
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    args = _common(job, "cut", "1:2", 120)
    env = {"FAULT_STEP_TIME": "0.05"}
    store_host = job.start_on(h0, *args, env=env)
    cut_off = job.start_on(h1, *args, env=env)
    attempt = _world_running(job, "cut", 2)
    rank1 = int((job.out / f"running.1.{attempt}").read_text())
    clock = GoneClock([rank1])
    t_cut = time.time()
    job.hosts.cut(h1)
    _, err = cut_off.communicate(timeout=60)
    assert cut_off.returncode == 1, err
    assert "cut off from the rendezvous store" in one_line(err)
    gone = clock.last(10) - t_cut
    assert gone <= STORE_TIMEOUT + SLACK, f"the cut-off host's rank ran on {gone:.2f} s after the cut"
    noticed = _stop_time(job, "cut", h0.name, "node_left")
    assert noticed - t_cut <= KA_TIMEOUT + SLACK, f"noticed {noticed - t_cut:.2f} s after the cut"
    _, err0 = store_host.communicate(timeout=120)
    assert store_host.returncode == 0, err0
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_partition_sigterm_while_cut_off(host_job):
    """Fault: partition, then SIGTERM (e.g. Slurm ending the step) to the cut-off host's agent before its
    store_timeout (30 s here) ran out, while it waits for the unreachable store.
    Outcome: it acts on the signal at once: its ranks get SIGTERM, the agent exits 143 within --term-timeout +
    3 s without the store (was: ignored SIGTERM, retried "No route to host" for minutes). The other host goes on.
    """
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    conf = RDZV_CONF.replace(f"store_timeout={STORE_TIMEOUT}", "store_timeout=30")
    args = _common(job, "term", "1:2", 120, conf=conf)
    env = {"FAULT_STEP_TIME": "0.05"}
    store_host = job.start_on(h0, *args, env=env)
    cut_off = job.start_on(h1, *args, env=env)
    attempt = _world_running(job, "term", 2)
    rank1 = int((job.out / f"running.1.{attempt}").read_text())
    job.hosts.cut(h1)
    # the other host went on without it: the cut-off agent's next store requests can only wait
    noticed = lambda: any(e["ev"] == "rdzv_stop" for e in job.events("term", f"agent-{h0.name}-"))  # noqa: E731
    assert wait_for(noticed, 30)
    t_term = time.time()
    cut_off.terminate()
    _, err = cut_off.communicate(timeout=60)
    took = time.time() - t_term
    assert cut_off.returncode == 143, err
    assert took <= 2 + 3, f"the cut-off agent took {took:.1f} s to act on SIGTERM"
    assert pid_gone(rank1)
    _, err0 = store_host.communicate(timeout=120)
    assert store_host.returncode == 0, err0
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_partition_store_host_cut_off(host_job):
    """Fault: partition: the link of the host holding the rendezvous store is cut for good (elastic --nnodes 1:2).
    Outcome: the other host cannot reach the store: it stops its ranks within store_timeout + 0.5 s and exits 1
    ("cut off from the rendezvous store"; `nvrx resume` continues after a 1); the store's host notices within
    keepalive_timeout + 0.5 s, goes on alone and finishes, exit 0. Nothing is left.
    """
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    args = _common(job, "storecut", "1:2", 120)
    env = {"FAULT_STEP_TIME": "0.05"}
    store_host = job.start_on(h0, *args, env=env)
    other = job.start_on(h1, *args, env=env)
    attempt = _world_running(job, "storecut", 2)
    rank1 = int((job.out / f"running.1.{attempt}").read_text())
    clock = GoneClock([rank1])
    t_cut = time.time()
    job.hosts.cut(h0)
    _, err = other.communicate(timeout=60)
    assert other.returncode == 1, err
    assert "cut off from the rendezvous store" in one_line(err)
    gone = clock.last(10) - t_cut
    assert gone <= STORE_TIMEOUT + SLACK, f"the cut-off host's rank ran on {gone:.2f} s after the cut"
    noticed = _stop_time(job, "storecut", h0.name, "node_left")
    assert noticed - t_cut <= KA_TIMEOUT + SLACK, f"noticed {noticed - t_cut:.2f} s after the cut"
    _, err0 = store_host.communicate(timeout=120)
    assert store_host.returncode == 0, err0
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_partition_shorter_than_keepalive(host_job):
    """Fault: partition: one host's link is cut for less than keepalive_timeout (a flapping NIC), then healed.
    Outcome: nobody is dropped and nothing restarts: both hosts finish the job together, exit 0.
    """
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    conf = RDZV_CONF.replace(f"keepalive_timeout={KA_TIMEOUT}", "keepalive_timeout=4").replace(
        f"store_timeout={STORE_TIMEOUT}", "store_timeout=4")
    args = _common(job, "flap", "2", 60, max_restarts=0, conf=conf)
    env = {"FAULT_STEP_TIME": "0.05"}
    procs = [job.start_on(h, *args, env=env) for h in (h0, h1)]
    _world_running(job, "flap", 2)
    job.hosts.cut(h1)
    time.sleep(1.0)  # the fault itself: how long the link stays down
    job.hosts.heal(h1)
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    stops = [e["kind"] for e in job.events("flap") if e["ev"] == "rdzv_stop"]
    assert set(stops) == {"succeeded"}, stops
    assert job.ledger.finished()
    job.assert_clean()


def test_partition_cut_then_healed_joins_next_round(host_job):
    """Fault: partition: one host's link is cut for longer than keepalive_timeout but shorter than its
    store_timeout, then healed, after the other host went on without it.
    Outcome: the healed host finds its round ended (node_left), stops its ranks and joins a later round, never
    its old one; the job finishes on both hosts, exit 0.
    """
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    conf = RDZV_CONF.replace(f"store_timeout={STORE_TIMEOUT}", "store_timeout=30")
    args = _common(job, "heal", "1:2", 160, conf=conf)
    env = {"FAULT_STEP_TIME": "0.05"}
    procs = [job.start_on(h, *args, env=env) for h in (h0, h1)]
    attempt = _world_running(job, "heal", 2)
    old_round = max(e["round"] for e in job.events("heal", f"agent-{h1.name}-") if e["ev"] == "rdzv_round")
    job.hosts.cut(h1)
    left = lambda: any(e["ev"] == "rdzv_stop" and e["round"] == old_round  # noqa: E731
                       for e in job.events("heal", f"agent-{h0.name}-"))
    assert wait_for(left, 30)
    # the other host trains alone in a newer round before the cable is back
    assert wait_for(lambda: any(e["ev"] == "rdzv_round" and e["round"] > old_round
                                for e in job.events("heal", f"agent-{h0.name}-")), 30)
    job.hosts.heal(h1)
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    h1_rounds = [e["round"] for e in job.events("heal", f"agent-{h1.name}-") if e["ev"] == "rdzv_round"]
    assert h1_rounds[-1] > old_round + 1 and h1_rounds.count(old_round) == 1, h1_rounds
    assert attempt >= 0 and job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_partition_host_frozen_then_thawed(host_job):
    """Fault: a host is frozen (SIGSTOP of its agent, monitors and ranks: a hung kernel, a paused VM) past
    keepalive_timeout and store_timeout, then thawed.
    Outcome: the other host notices within keepalive_timeout + 0.5 s and goes on without it; the thawed host
    finds its round ended and stops its ranks at once: it joins a later round (never its old one) if its store
    connection answers first, else it exits 1 ("cut off from the rendezvous store"). Either way no rank trains on
    in the round the job has left; the job finishes, exit 0. Nothing is left.
    """
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    args = _common(job, "frozen", "1:2", 120)
    env = {"FAULT_STEP_TIME": "0.05"}
    store_host = job.start_on(h0, *args, env=env)
    frozen = job.start_on(h1, *args, env=env)
    attempt = _world_running(job, "frozen", 2)
    old_round = max(e["round"] for e in job.events("frozen", f"agent-{h1.name}-") if e["ev"] == "rdzv_round")
    rank1 = int((job.out / f"running.1.{attempt}").read_text())
    t_freeze = time.time()
    assert rank1 in job.hosts.freeze(h1)
    noticed = lambda: any(e["ev"] == "rdzv_stop" and e["kind"] == "node_left"  # noqa: E731
                          for e in job.events("frozen", f"agent-{h0.name}-"))
    assert wait_for(noticed, 30)
    assert _stop_time(job, "frozen", h0.name, "node_left") - t_freeze <= KA_TIMEOUT + SLACK
    assert wait_for(lambda: time.time() - t_freeze > STORE_TIMEOUT + 1, 10)
    job.hosts.thaw(h1)
    assert wait_for(lambda: pid_gone(rank1), 5), "the thawed host's rank trains on in a round the job left"
    _assert_thawed_agent_ended(job, "frozen", h1, frozen, old_round)
    _, err0 = store_host.communicate(timeout=120)
    assert store_host.returncode == 0, err0
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


FENCE_TRAIN = Path(__file__).parents[1] / "hosts_e2e" / "fence_train.py"  # stalls one publish on request


def _frozen_mid_publish(job, point: str, late: str, jit: bool) -> None:
    """A host frozen while its rank publishes checkpoint LATE (stopped at POINT of the publish: before the
    manifest and the fence check, so that its publication time is later than the survivors' saves; or after the
    check, before the rename), the other host going on alone and saving newer checkpoints, then the thaw: the shared
    checkpoint directory must never offer LATE as the newest, and the job must end on the survivors' lineage.

    The store is on h1 and h0 starts first with a last call of 4 s: the round of both hosts is the first one and
    ranks follow node ids, so h0 holds rank 0 (the periodic saves' coordinator, the lowest survivor for a
    just-in-time save) and the frozen host is not the store's. The stalled rank is thawed alone first and its
    publish attempt is awaited before the rest of h0 is thawed: the worst order (the late publisher runs before
    its agent can stop it), and the one that makes the attempt certain rather than a race with the agent."""
    h0, h1 = job.hosts[0], job.hosts[1]
    steps = 120
    conf = RDZV_CONF.replace("last_call_timeout=1", "last_call_timeout=4")
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"{h1.addr}:{PORT}", "--rdzv-id", "fenced",
            "--max-restarts", "3", "--rdzv-conf", conf, "--term-timeout", "2", "--async-ckpt"]
    env = {"FAULT_STEP_TIME": "0.05", "FENCE_STALL": f"{point}:{late}"}
    if jit:  # h1's rank dies after step 12; h0's rank saves that step just in time, and stalls publishing it
        args += ["--jit-ckpt", "--jit-ckpt-timeout", "300"]  # (no deadline passes while h0 is frozen)
        env["FENCE_CRASH"] = f"{h1.name}:12"
    args += [str(FENCE_TRAIN), str(job.out), str(steps)]
    frozen = job.start_on(h0, *args, env=env)
    survivor = job.start_on(h1, *args, env=env)
    root = job.out / "ckpts"
    marker = job.out / "stalled.json"
    assert wait_for(marker.exists, 120), f"no rank stopped publishing {late}"
    stalled = json.loads(marker.read_text())
    assert stalled["host"] == h0.name and stalled["name"] == late, stalled
    old_round, rank0 = stalled["round"], stalled["pid"]
    assert rank0 in job.hosts.freeze(h0)

    def newer_saves() -> list[dict]:  # the survivor's own saves, in rounds after the one the job left
        return [e for e in job.ledger.entries() if e["ev"] == "saved" and e["round"] > old_round and e["step"] > 12]

    assert wait_for(lambda: len(newer_saves()) >= 2, 90), "the other host did not go on alone and save"
    assert all(e["host"] == h1.name for e in newer_saves())
    # the survivors' rank publishes nothing while the late publish is tried and judged (else a newer save of
    # theirs could hide a late checkpoint taken for the newest): stopped alone, its agent and the store run on
    survivor_rank = newer_saves()[-1]["pid"]
    os.kill(survivor_rank, signal.SIGSTOP)
    try:
        (job.out / "go").write_text("")
        os.kill(rank0, signal.SIGCONT)  # the late publisher first (see above)
        attempt_file = job.out / "attempt.json"
        assert wait_for(attempt_file.exists, 30), "the thawed rank never tried to finish its publish"
        attempt = json.loads(attempt_file.read_text())
        # before: the new round raised the fence before this check, so nothing is published (else, published last,
        # it would be the newest); after: past the check when frozen, renamed after the new round raised the fence
        # without listing it: removed again at once (else `latest` would name it)
        assert attempt["outcome"] == "refused" and "which the job has left" in attempt["error"], attempt
        if point == "after":
            assert "removed after its publication" in attempt["error"], attempt
        assert not (root / late).exists() and read_latest(root) != late
        newest = ckpt.find_latest_checkpoint(root)  # what a resume of the job would take now
        assert newest is not None and newest.path.name != late, newest
        assert newest.manifest["fence"][1] > old_round, newest.manifest.get("fence")
    finally:
        os.kill(survivor_rank, signal.SIGCONT)
    job.hosts.thaw(h0)
    assert wait_for(lambda: pid_gone(rank0), 10), "the thawed host's rank trains on in a round the job left"
    progress = json.loads((job.out / f"progress.{h0.name}.{old_round}").read_text())["done"]
    assert progress == stalled["done"], f"the thawed rank did steps {stalled['done']}..{progress} of its old round"
    _assert_thawed_agent_ended(job, "fenced", h0, frozen, old_round)
    _, err1 = survivor.communicate(timeout=120)
    assert survivor.returncode == 0, err1
    starts = [json.loads(p.read_text()) for p in job.out.glob("start-*.json")]
    assert all(s["newest"] != late for s in starts), starts  # no start of the job took the late checkpoint
    assert json.loads((job.out / "final.json").read_text())["w"] == [float(steps)] * 4  # every step exactly once
    assert json.loads((job.out / "ckpt.json").read_text())["name"] == f"step_{steps:09d}"
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before", "after"])
def test_partition_host_frozen_mid_publish_never_publishes_the_newest(host_job, point):
    """Fault: a host is frozen while its rank (the coordinator) publishes a periodic checkpoint
    (PeriodicCheckpointer, shared directory): stopped once every rank's files are written (before the manifest
    and the fence check), or just after the fence check (before the rename); the other host goes on alone in a
    new round and saves newer checkpoints; then the frozen rank is thawed first and its publish goes on, then the
    rest of its host.
    Outcome: no split brain on disk: stopped before the check, the late publish (the last one: it would be the
    newest) is refused ("which the job has left"); past it, the renamed checkpoint is removed again at once (the
    new round's fence does not list it: no loader would take it), before `latest` moves. Either way the newest
    checkpoint stays the survivors'. The thawed rank trains no further step of its old round; every start of the
    job resumes from the survivors' lineage, which finishes with every step done exactly once, exit 0. Nothing
    saved is lost, nothing is left.
    """
    _frozen_mid_publish(host_job(2), point, "step_000000010", jit=False)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before", "after"])
def test_partition_host_frozen_mid_jit_checkpoint_never_publishes_the_newest(host_job, point):
    """Fault: under --jit-ckpt a rank dies; the survivor on the other host saves its last completed step just in
    time (save_on_failure=True) and its host is frozen while that checkpoint is being published (before its
    manifest and the fence check, or after the check); the dead rank's host goes on alone in a new round and
    saves newer checkpoints; then the frozen rank is thawed first and its publish goes on, then the rest of its
    host.
    Outcome: as for a periodic checkpoint: refused before the check, removed again after it; the job resumes
    from the survivors' lineage and finishes with every step done exactly once, exit 0. Nothing saved is lost,
    nothing is left.
    """
    _frozen_mid_publish(host_job(2), point, "jit_step_000000012", jit=True)


@pytest.mark.slow
def test_partition_store_host_cut_off_then_nvrx_resume_continues(host_job):
    """Fault: partition: the link of the host holding the rendezvous store is cut for good in a fixed-size job
    (--nnodes 2, --max-restarts 0, a job secret) run by `nvrx resume` as in auto_resume.sbatch (one `nvrx launch`
    per host, srun's exit status: the highest); the link is back before the next launch.
    Outcome: the other host stops its ranks within store_timeout + 0.5 s and exits 1 ("cut off from the
    rendezvous store"); the store's host stops its ranks and exits 1 (no restart budget). Nothing is corrupt (every
    published checkpoint verifies), `nvrx resume` decides "continue", launches again and the new launch resumes
    from the newest complete checkpoint and finishes (its state holds exactly every step once), exit 0.
    """
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    steps = 60
    secret = job.tmp_path / "secret"
    secret.write_bytes(b"a-secret-for-this-job-only-0123456789")
    secret.chmod(0o600)
    spec = job.tmp_path / "hosts.json"
    spec.write_text(json.dumps([{"name": h.name, "prefix": h.prefix()} for h in (h0, h1)]))
    launch = [sys.executable, "-m", "nvrx", "launch", "--nnodes", "2", "--nproc-per-node", "1",
              "--rdzv-endpoint", f"{h0.addr}:{PORT}", "--rdzv-id", "resumed", "--max-restarts", "0",
              "--rdzv-conf", RDZV_CONF + ",join_timeout=60", "--term-timeout", "2", str(RESUME_TRAIN),
              str(job.out), str(steps)]
    (job.tmp_path / "resume").mkdir()
    cmd = [sys.executable, "-m", "nvrx", "resume", "--state-dir", str(job.tmp_path / "resume"), "--max-failures", "2",
           "--exec", "--", sys.executable, "-m", "tests.hosts_e2e.srun_hosts", str(spec), "--", *launch]
    env = job.env({"FAULT_STEP_TIME": "0.05", "NVRX_JOB_SECRET_FILE": str(secret)})
    job._shm = job._shm or ShmWatch(job.token)
    resume = subprocess.Popen(cmd, cwd=job.tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    job.procs.append(resume)

    def starts() -> list[dict]:  # each rank's start record, with its launch
        return [json.loads(p.read_text()) | {"launch": p.name.split("-")[1]} for p in job.out.glob("start-*.json")]

    def ends() -> dict[str, dict]:  # how each host's `nvrx launch` of the first attempt ended, and when
        done = spec.with_name(spec.name + ".ends.jsonl")
        return {e["host"]: e for e in map(json.loads, done.read_text().splitlines())} if done.exists() else {}

    def output() -> str:  # what `nvrx resume` and the launches printed (ends the run: for failure messages)
        resume.kill()
        return resume.communicate()[1][-4000:]

    assert wait_for(lambda: len(starts()) == 2 or resume.poll() is not None, 120), output()
    assert len(starts()) == 2, output()
    on_h1 = next(s for s in starts() if s["host"] == h1.name)
    running = job.out / f"running.{on_h1['rank']}.{on_h1['launch']}"
    assert wait_for(lambda: running.exists() and running.read_text().strip().isdigit(), 30)
    # a checkpoint is published before the cut (every 5 steps)
    assert wait_for(lambda: ckpt.find_latest_checkpoint(job.out / "ckpts", verify=None) is not None, 60)
    clock = GoneClock([int(running.read_text())])
    t_cut = time.time()
    job.hosts.cut(h0)
    assert wait_for(lambda: len(ends()) == 2, 60), f"the first launch did not end: {ends()}"
    gone = clock.last(10) - t_cut
    assert gone <= STORE_TIMEOUT + SLACK, f"the cut-off host's rank ran on {gone:.2f} s after the cut"
    assert ends()[h1.name]["rc"] == 1 and ends()[h0.name]["rc"] == 1, ends()
    # nothing corrupt: every published checkpoint verifies; the newest is what the next launch must resume from
    published = ckpt.list_checkpoints(job.out / "ckpts")
    for info in published:
        ckpt.verify_checkpoint(info.path)
    newest = published[0].path.name
    job.hosts.heal(h0)

    _, err = resume.communicate(timeout=240)
    assert resume.returncode == 0, err
    assert "cut off from the rendezvous store" in err
    second = [s for s in starts() if s["launch"] != on_h1["launch"]]
    assert len(second) == 2 and {s["newest"] for s in second} == {newest}, second
    assert second[0]["start"] == second[1]["start"] > 0
    final = json.loads((job.out / "final.json").read_text())
    assert final["w"] == [float(steps * 2)] * 4, final  # every step exactly once across the two launches
    decisions = [e for e in map(json.loads, (job.tmp_path / "resume" / "resume.jsonl").read_text().splitlines())
                 if e["ev"] == "resume_decision"]
    assert [d["action"] for d in decisions] == ["continue", "finished"], decisions
    job.assert_clean()
