"""Fault matrix: faults of an agent or a node (SIGKILL, killed during start-up, node lost, preemption signals)."""

from __future__ import annotations

import signal

import pytest

from tests.conftest import STARTUP_WAIT, free_port, listening, wait_for
from tests.faults.conftest import children_named, kill



def test_agent_sigkilled(job):
    """Fault: the agent is SIGKILLed while its ranks train.
    Outcome: its ranks, fork server and monitors die with it (parent-death signal); nothing is left. Resume it.
    """
    proc = job.start("--nproc-per-node", "2", *job.train(1000), env={"FAULT_STEP_TIME": "0.1"})
    job.wait_running(rank=1)
    assert wait_for(lambda: children_named(proc.pid, "nvrx.monitors.rank_monitor"), STARTUP_WAIT)
    kill(proc)
    proc.wait()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_agent_sigkilled_during_start_up(job):
    """Fault: the agent is SIGKILLed during start-up (in its first second, before any rank runs).
    Outcome: nothing is left: no process, and no empty monitor directory in TMPDIR.
    """
    proc = job.start("--nproc-per-node", "2", "--rdzv-id", "early", *job.train(5))
    # the agent is up: it started its fork server (which is still importing torch; no rank exists yet)
    assert wait_for(lambda: children_named(proc.pid, "nvrx.launcher.agent.fork_server"), STARTUP_WAIT)
    kill(proc)
    proc.wait()
    assert job.ledger.entries() == []
    job.assert_clean()


def test_node_lost_elastic(job):
    """Fault: one node of an elastic (--nnodes 1:2) job is lost (its agent SIGKILLed).
    Outcome: the other node notices (keepalive), goes on alone from the last checkpoint and finishes, exit 0.
    """
    port = free_port()
    job.ports.append(port)
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "elastic", "--max-restarts", "2",
              "--rdzv-conf", "last_call_timeout=2,keepalive_interval=0.2,keepalive_timeout=1"]
    # the ranks train once both nodes run: else, on a loaded machine, a round 0 closed with the first node alone
    # can finish the job before the second agent has imported torch
    gate = job.out / "both-nodes-run"
    env = {"FAULT_STEP_TIME": "0.05", "FAULT_GATE": str(gate)}
    host = job.start(*common, *job.train(60), env=env)
    assert wait_for(lambda: any(e["ev"] == "rdzv_join" for e in job.events("elastic")), STARTUP_WAIT)
    other = job.start(*common, *job.train(60), env=env)  # joins round 0, or asks it to make room (scale_up)
    job.wait_running(rank=1, attempt=None)  # attempt 0, or 1 if round 0 closed before this node joined
    gate.touch()
    kill(other)
    other.wait()
    _, err = host.communicate(timeout=120)
    assert host.returncode == 0, err
    assert "restarting the job (restart 1)" in err  # node left, or its peer's collective failed first
    rounds = sorted((e["t"], e["world_size"]) for e in job.events("elastic") if e["ev"] == "rdzv_round")
    worlds = [w for _, w in rounds]
    assert 2 in worlds and worlds[-1] == 1  # (round 0 may have closed with one node, then scaled up)
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_store_host_ends_the_job_before_a_node_read_its_end(job):
    """Fault: the job succeeds, but the store host's agent ends it and exits while another node's agent, its ranks
    done and its success recorded, has not read the end yet (paused here by SIGSTOP past the host's linger).
    Outcome: that agent finds the store gone; its ranks all exited 0, so it ends with 0 and one warning line (as
    torchrun's agent when its exit barrier fails); the host ends with 0. Nothing is left.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    job.ports.append(port)
    gate = job.out / "host-may-finish"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "early_end", "--max-restarts", "0", "--rdzv-conf", "keepalive_interval=0.5,keepalive_timeout=10"]
    host = job.start(*common, *job.train(5), env={"FAULT_STEP_TIME": "0.01", "FAULT_END_GATE": str(gate)})
    assert wait_for(lambda: listening(port), STARTUP_WAIT)
    other = job.start(*common, *job.train(5), env={"FAULT_STEP_TIME": "0.01"})
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    done = [f"nvrx/early_end/r0/succeeded/{g}" for g in (0, 1)]
    # the host's rank waits at its exit for the gate: the success recorded first is the other node's
    assert wait_for(lambda: store.check(done[:1]) or store.check(done[1:]), STARTUP_WAIT)
    del store
    other.send_signal(signal.SIGSTOP)
    gate.touch()
    try:
        _, err_host = host.communicate(timeout=120)
    finally:
        other.send_signal(signal.SIGCONT)
    _, err = other.communicate(timeout=120)
    assert host.returncode == 0, err_host
    assert other.returncode == 0, err
    assert "Traceback" not in err and "exited 0, but the job's end could not be read" in err
    assert job.ledger.finished()
    job.assert_clean()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["sigterm", "sigusr1"])
def test_preemption_signal(job, sig):
    """Fault: preemption: SIGTERM or SIGUSR1 (Slurm's --signal) reaches the agent.
    Outcome: ranks agree on one step, save it and exit; the agent exits 128+signal (143, 138); the next
    launch resumes from that step and finishes.
    """
    args = ["--nproc-per-node", "2", "--term-timeout", "10", *job.train(60, "graceful")]
    proc = job.start(*args, env={"FAULT_STEP_TIME": "0.05"})
    for rank in (0, 1):
        job.wait_running(rank=rank)  # past job_control.install(): the signal is a stop request, not a kill
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    stopped_at = job.ledger.saved()
    assert 0 < stopped_at < 60 and not job.ledger.finished()
    again = job.run(*args, env={"FAULT_STEP_TIME": "0.01"}, timeout=120)
    assert again.returncode == 0, again.stderr
    assert job.ledger.resumes()[-1] == stopped_at and job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()
