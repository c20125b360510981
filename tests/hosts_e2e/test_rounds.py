"""Multi-node rounds on emulated hosts (tests/hosts.py): every agent on a host of its own, with its own address
and host name, as on a cluster (the 127.0.0.1 versions of these live in tests/faults and tests/integration)."""

from __future__ import annotations


from nvrx.slurm.nodes import find_bad_node
from tests.conftest import wait_for, write_script
from tests.faults.conftest import kill


PORT = 29400
CONF = "last_call_timeout=1,keepalive_interval=0.5,keepalive_timeout=2"


def _args(job, run_id: str, nnodes: str, steps: int, fault: str = "none") -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", f"{job.hosts[0].addr}:{PORT}",
            "--rdzv-id", run_id, "--max-restarts", "2", "--rdzv-conf", CONF, "--term-timeout", "2",
            *job.train(steps, fault)]


def test_rank_crash_restarts_across_hosts(host_job):
    """A rank on the second host crashes once: every host restarts its ranks in place and the job finishes."""
    job = host_job(2)
    procs = [job.start_on(h, *_args(job, "crash", "2", 30, "crash"), env={"FAULT_STEP_TIME": "0.05"})
             for h in job.hosts]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    rounds = [e for e in job.events("crash") if e["ev"] == "rdzv_round"]
    assert max(e["restart_count"] for e in rounds) == 1
    assert {e["world_size"] for e in rounds} == {2}
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_standby_host_takes_a_lost_hosts_place(host_job):
    """Three hosts, --nnodes 2:2: the third waits as a standby; a member host's agent is SIGKILLed and the
    standby takes its place; the job finishes with two nodes, exit 0."""
    job = host_job(3)
    env = {"FAULT_STEP_TIME": "0.05"}
    procs = {h.name: job.start_on(h, *_args(job, "standby", "2:2", 120), env=env) for h in job.hosts}
    assert wait_for(lambda: any(e["ev"] == "rdzv_standby" for e in job.events("standby")), 90)
    standby = next(e["node_id"] for e in job.events("standby") if e["ev"] == "rdzv_standby")
    member = next(h for h in job.hosts[1:] if not standby.startswith(h.name + "-"))
    job.wait_running(rank=1)
    kill(procs[member.name])
    procs[member.name].wait()
    for name, proc in procs.items():
        if name != member.name:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err
    last = max((e for e in job.events("standby") if e["ev"] == "rdzv_round"), key=lambda e: e["round"])
    assert last["world_size"] == 2 and any(n.startswith(standby.split("-")[0] + "-") for n in last["nodes"])
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


HEALTH_RANK = r'''
import json, os, socket, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
while not os.path.exists(os.path.join(sys.argv[1], "..", "health-gate")):  # the test says when (no race on start-up)
    time.sleep(0.05)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump({"world": dist.get_world_size(), "host": socket.gethostname()}, fh)
dist.barrier()
dist.destroy_process_group()
'''


def test_a_host_failing_its_health_hook_sits_out_and_the_job_goes_on(host_job):
    """--nnodes 1:2: the second host's health hook fails before it joins: that agent exits 16 ("failed its health
    checks", the hook's words) while the first host runs the job alone (its rank waits for the test's gate), which
    then finishes, exit 0; `nvrx inspect` says so, and the host `nvrx resume` would exclude is the sick one, by its
    host name."""
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    out = job.out / "health"
    out.mkdir()
    script = write_script(job.tmp_path / "rank.py", HEALTH_RANK)
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"{h0.addr}:{PORT}",
              "--rdzv-id", "health", "--rdzv-conf", "join_timeout=60,last_call_timeout=2",
              "--ft-param-node_health_check_hook", "sh -c 'test -z \"$NVRX_TEST_SICK\" || { echo disk smoking; exit 1; }'"]
    good = job.start_on(h0, *common, str(script), str(out))
    assert wait_for(lambda: any(e["ev"] == "rdzv_join" for e in job.events("health")), 60)
    sick = job.start_on(h1, *common, str(script), str(out), env={"NVRX_TEST_SICK": "1"})
    _, err = sick.communicate(timeout=60)
    assert sick.returncode == 16, err
    assert "failed its health checks (hook: hook exited 1: disk smoking)" in err
    (job.out / "health-gate").touch()  # the first host's job may end now
    gout, err = good.communicate(timeout=60)
    assert good.returncode == 0, err + gout
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json"]
    assert (out / "rank0.json").read_text().count(h0.name) == 1
    health = {e["ok"]: e for e in job.events("health") if e["ev"] == "node_health"}
    assert sorted(health) == [False, True]
    assert find_bad_node(job.tmp_path / "nvrx_logs", "health") == h1.name
    report = job.run_inspect("health")
    assert "failed its health checks" in report.stdout + report.stderr, report.stdout + report.stderr
    job.assert_clean()
