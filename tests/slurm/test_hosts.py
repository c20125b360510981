"""The multi-node template on a test Slurm whose nodes are emulated hosts (tests/slurm/hosts_cluster.py).

Every Slurm node is a network namespace with its own address (198.18.0.0/15), host name and /etc/hosts, with
one slurmd; slurmctld and sbatch run on host 0. So the job's agents, the rendezvous store and the ranks can
reach each other only by the hosts' real addresses, as on a cluster: a 127.x address or a wildcard listener
that the loopback-alias cluster of tests/slurm/conftest.py would let pass fails here.
Skips with the reason where namespaces or Slurm cannot be made (fails under NVRX_REQUIRE_NETNS=1 or
NVRX_REQUIRE_SLURM=1).
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import psutil
import pytest

from nvrx.slurm.environment import rdzv_port_for_job
from tests.conftest import pid_gone, run_events, tagged_processes, wait_for
from tests.faults.test_partitions import GoneClock
from tests.hosts import require_hosts
from tests.slurm.cluster import ClusterUnavailable, wait_until
from tests.slurm.conftest import REQUIRE_ENV, slurm_required
from tests.slurm.hosts_cluster import HostsSlurmCluster
from tests.slurm.test_sbatch import Job


@pytest.fixture(scope="module")
def hosts_slurm():
    """A test Slurm on 2 emulated hosts; torn down (daemons, cgroups, namespaces) also when a test fails,
    with a check that nothing of it is left running."""
    # node names are random: the nodes' cgroups (slurm_<name>) are the machine's, shared with other test Slurms
    hosts = require_hosts(2, stem=f"nvrx{uuid.uuid4().hex[:4]}h")
    cluster = HostsSlurmCluster(hosts=hosts)
    try:
        try:
            cluster.start()
        except ClusterUnavailable as exc:
            if slurm_required(os.environ):
                pytest.fail(f"{REQUIRE_ENV}=1 but the test Slurm on emulated hosts did not come up: {exc}",
                            pytrace=False)
            pytest.skip(f"no test Slurm on emulated hosts: {exc}")
        yield cluster
        killed = cluster.stop()
        left = cluster.leftovers()
        assert not killed, f"processes of the test Slurm were still running at tear-down: {killed}"
        assert not left, f"processes of the test Slurm survived tear-down: {[p.pid for p in left]}"
    finally:
        cluster.stop()
        hosts.close()


def _listeners(cluster, host, port: int) -> set[str]:
    """ADDR:PORT of every TCP socket listening on PORT on HOST."""
    out = cluster.hosts.run(host, "ss", "-Hltn", f"sport = :{port}")
    assert out.returncode == 0, out.stderr
    return {line.split()[3] for line in out.stdout.splitlines() if line.strip()}


def _connects(cluster, host, addr: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=3).close()"
    return cluster.hosts.run(host, sys.executable, "-c", code).returncode == 0


def test_two_node_job_on_emulated_hosts_recovers_a_crash_in_place(hosts_slurm, tmp_path):
    """Fault: a rank crashes (exit 3) in a 2-node job submitted with multi_node.sbatch on a Slurm whose nodes are
    emulated hosts (one slurmd per network namespace, own address and host name; sbatch --nodes 2, 2 ranks per
    node, --max-restarts 1).
    Outcome: the job restarts in place and completes (exit 0, every rank in restart 1); the rendezvous store and
    the process-group store listen only on the first node's 198.18 address (not the wildcard, not loopback),
    MASTER_ADDR resolves to it on both hosts, each rank's connections go to the hosts' real addresses, among
    them the other host's. Nothing is left on either host but the Slurm daemons.
    """
    cluster = hosts_slurm
    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    job = Job(cluster, tmp_path, "multi_node.sbatch")
    marker, hold = tmp_path / "crashed.marker", tmp_path / "go"
    job_id = job.submit("--nodes=2", NVRX_NPROC_PER_NODE="2", NVRX_MAX_RESTARTS="1", EXAMPLE_CRASH_RANK="3",
                        EXAMPLE_CRASH_MARKER=str(marker), EXAMPLE_HOLD_FILE=str(hold))
    try:
        # every rank of the restarted round has reported and waits for HOLD: the job is running
        wait_until(f"4 rank reports of job {job_id}", lambda: len(job.ranks()) == 4
                   and {r["restart"] for r in job.ranks()} == {1}, 120, interval=0.1, error=AssertionError)
        ranks = job.ranks()
        rdzv_port = rdzv_port_for_job(job_id)
        master_port = ranks[0]["master_port"]
        for port in (rdzv_port, master_port):
            assert _listeners(cluster, h0, port) == {f"{h0.addr}:{port}"}, port
            assert not _listeners(cluster, h1, port), port
            assert not _connects(cluster, h0, "127.0.0.1", port), port
        assert _connects(cluster, h1, h0.addr, rdzv_port) and _connects(cluster, h1, h0.addr, master_port)
    finally:
        hold.touch()
    info = job.finish(job_id)
    out = job.output()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert marker.read_text() == "0" and "crashing on purpose" in out, out  # rank 3 crashed in the first attempt

    by_name = {h.name: h for h in cluster.hosts}
    assert [(r["rank"], r["node"], r["hostname"]) for r in ranks] == [
        (0, h0.name, h0.name), (1, h0.name, h0.name), (2, h1.name, h1.name), (3, h1.name, h1.name)], out
    subnet = h0.addr.rsplit(".", 1)[0] + "."
    for r in ranks:
        assert (r["world"], r["sum"], r["run_id"]) == (4, 6.0, job_id), r
        assert r["master_ip"] == h0.addr, r
        other = h1 if by_name[r["node"]] is h0 else h0
        assert other.addr in r["peers"], r
        assert all(p.startswith(subnet) for p in r["peers"]), r["peers"]
    logs = (tmp_path / "nvrx_logs" / job_id).glob("agent-*.jsonl")
    assert sorted(p.name.removeprefix("agent-").rsplit("-", 1)[0] for p in logs) == [h0.name, h1.name]

    _assert_only_daemons_left(cluster)


def _assert_only_daemons_left(cluster) -> None:
    """The job's steps are gone from every host: only the daemons run there (slurmctld's own child, slurmscriptd,
    is one of them; a slurmd's children are the job's slurmstepds)."""
    ctld = cluster.procs["slurmctld"].pid
    daemons = {p.pid for p in cluster.procs.values()} | {c.pid for c in psutil.Process(ctld).children()}
    others = lambda: {pid: _cmdline(pid) for h in cluster.hosts for pid in h.pids() if pid not in daemons}
    assert wait_for(lambda: not others(), 30), f"left on the hosts: {others()}"


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.Error:
        return "(gone)"


KA_TIMEOUT, STORE_TIMEOUT, SLACK = 3.0, 3.0, 0.5  # as in tests/faults/test_partitions.py
CUT_LAUNCH_ARGS = (f"--rdzv-conf last_call_timeout=1,keepalive_interval=1,keepalive_timeout={KA_TIMEOUT},"
                   f"store_timeout={STORE_TIMEOUT} --term-timeout 2")


def test_second_node_cut_off_mid_job_on_emulated_hosts(hosts_slurm, tmp_path):
    """Fault: partition on Slurm: the link of the second node (an emulated host with its own slurmd) is cut while
    a 2-node multi_node.sbatch job (--max-restarts 0) runs; healed once the cut-off agent has exited (before
    Slurm's SlurmdTimeout, so the node stays up).
    Outcome: the cut-off node stops its own ranks within store_timeout + 0.5 s and its agent exits 1 ("cut off
    from the rendezvous store"); the first node's agent notices within keepalive_timeout + 0.5 s and stops its
    ranks (no restart budget). Once the link is back srun collects both exits and Slurm ends the job FAILED
    1:0 (`nvrx resume` continues after a 1). Nothing is left on either host.
    """
    cluster = hosts_slurm
    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    job = Job(cluster, tmp_path, "multi_node.sbatch")
    hold = tmp_path / "go"  # never made: the ranks hold until the fault ends them
    job_id = job.submit("--nodes=2", NVRX_NPROC_PER_NODE="2", NVRX_MAX_RESTARTS="0", EXAMPLE_HOLD_FILE=str(hold),
                        NVRX_LAUNCH_ARGS=CUT_LAUNCH_ARGS)
    wait_until(f"4 rank reports of job {job_id}", lambda: len(job.ranks()) == 4, 120, interval=0.1,
               error=AssertionError)
    ranks = job.ranks()
    assert [r["node"] for r in ranks] == [h0.name, h0.name, h1.name, h1.name], job.output()
    cut_off = GoneClock([r["pid"] for r in ranks if r["node"] == h1.name])
    t_cut = time.time()
    cluster.hosts.cut(h1)
    try:
        gone = cut_off.last(30) - t_cut
        assert gone <= STORE_TIMEOUT + SLACK, f"the cut-off node's ranks ran on {gone:.2f} s after the cut"
        on_h1 = lambda: [p for p in tagged_processes(job.token) if p.pid in set(h1.pids())]
        assert wait_for(lambda: not on_h1(), 30), f"still on the cut-off node: {on_h1()}"
    finally:
        cluster.hosts.heal(h1)
    info = job.finish(job_id)
    out = job.output()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), out
    assert "cut off from the rendezvous store" in out, out
    stops = [e for e in run_events(tmp_path / "nvrx_logs" / job_id, f"agent-{h0.name}-")
             if e["ev"] == "rdzv_stop" and e["kind"] == "node_left"]
    assert stops, out
    noticed = min(e["t"] for e in stops) - t_cut
    assert noticed <= KA_TIMEOUT + SLACK, f"the first node noticed {noticed:.2f} s after the cut"
    assert all(pid_gone(r["pid"]) for r in ranks)
    _assert_only_daemons_left(cluster)
    # both nodes are back to idle: the cut was shorter than SlurmdTimeout
    wait_until("both nodes idle", cluster._all_idle, 30, error=AssertionError)
