"""Ranks on different emulated hosts reach each other and the rendezvous store by the hosts' real addresses.

Every host is a network namespace with its own address and host name (tests/hosts.py), so an agent or a rank
that uses 127.0.0.1, the wildcard address or a name that resolves elsewhere fails here as on a cluster.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


from tests.conftest import wait_for


PORT = 29400
RANKS = Path(__file__).with_name("addr_ranks.py")


def _launch_all(job, endpoint: str, extra: dict[int, list[str]] | None = None) -> list[dict]:
    """`nvrx launch` on every host (1 rank each) against ENDPOINT; each rank's report, in rank order."""
    procs = []
    for h in job.hosts:
        args = ["--nnodes", str(len(job.hosts)), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                "--rdzv-id", "addr", *(extra or {}).get(h.index, []), str(RANKS), str(job.out)]
        procs.append(job.start_on(h, *args))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    n = len(job.hosts)
    reports = [json.loads((job.out / f"rank{r}.json").read_text()) for r in range(n)]
    assert all(r["sum"] == n * (n + 1) / 2 for r in reports)  # the collective ran across the hosts
    assert sorted(r["host"] for r in reports) == sorted(h.name for h in job.hosts)
    return reports


def _connects(job, host, addr: str, port: int) -> bool:
    """Whether a TCP connection from HOST to ADDR:PORT is accepted."""
    code = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=3).close()"
    return job.hosts.run(host, sys.executable, "-c", code).returncode == 0


def test_endpoint_by_host_name_and_real_addresses(host_job):
    """The endpoint named by host name: every rank gets MASTER_ADDR naming the first host's real address (its
    name, which resolves to that address on every host), and the gloo all-reduce crosses the hosts."""
    job = host_job(2)
    reports = _launch_all(job, f"{job.hosts[0].name}:{PORT}")
    assert {r["MASTER_ADDR"] for r in reports} <= {job.hosts[0].name, job.hosts[0].addr}
    job.assert_clean()


def test_host_name_resolving_elsewhere(host_job):
    """The store's host resolves its own name to 127.0.1.1 (Debian's /etc/hosts): MASTER_ADDR must not be that
    name (the other host's ranks would reach it, this host's would not find the process-group store there): it
    is the address the process-group store listens on."""
    job = host_job(2)
    h0 = job.hosts[0]
    job.hosts.set_hosts_file(h0, ["127.0.0.1 localhost", f"127.0.1.1 {h0.name}",
                                  *[f"{h.addr} {h.name}" for h in job.hosts if h is not h0]])
    reports = _launch_all(job, f"{h0.addr}:{PORT}")
    assert {r["MASTER_ADDR"] for r in reports} == {h0.addr}
    job.assert_clean()


def test_local_addr_is_what_ranks_use(host_job):
    """--local-addr on the first host (a second address on its link): the process-group store listens there and
    every rank, on both hosts, gets it as MASTER_ADDR."""
    job = host_job(2)
    h0 = job.hosts[0]
    second = job.hosts.add_address(h0, 101)
    reports = _launch_all(job, f"{h0.addr}:{PORT}", {0: ["--local-addr", second], 1: []})
    assert {r["MASTER_ADDR"] for r in reports} == {second}
    job.assert_clean()


def test_store_listens_only_on_the_address_it_serves(host_job):
    """The rendezvous store of an endpoint given by one of two addresses of its host is reachable from the other
    host at that address, and refuses connections at the host's other address (never the wildcard)."""
    job = host_job(2)
    h0, h1 = job.hosts[0], job.hosts[1]
    second = job.hosts.add_address(h0, 101)
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"{h0.addr}:{PORT}", "--rdzv-id", "bind",
            str(RANKS), str(job.out)]
    host = job.start_on(h0, *args)
    assert wait_for(lambda: _connects(job, h1, h0.addr, PORT), 60)
    assert not _connects(job, h1, second, PORT)
    assert not _connects(job, h0, "127.0.0.1", PORT)
    other = job.start_on(h1, *args)
    for proc in (host, other):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    job.assert_clean()
