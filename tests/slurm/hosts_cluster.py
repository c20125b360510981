"""The test Slurm on emulated hosts (tests/hosts.py): one network namespace per Slurm node.

slurmctld runs on host 0, one slurmd on every host (NodeName = the host's name, NodeAddr = its 198.18 address),
and every Slurm command (sbatch, squeue, scontrol...) runs on host 0: jobs, their steps and the ranks live in
the hosts' namespaces and reach each other only by the hosts' addresses, as on a cluster. munged stays in the
machine's namespace: its socket is a file, which every namespace sees. Nothing is added to the machine's own
network or /etc/hosts (each host has its own, /etc/netns/<ns>/hosts). The daemons all use Slurm's usual
ports: every host has a network of its own.

`ip netns exec` gives each command a fresh /sys without the cgroup hierarchies; a slurmd mounts the cgroup v1
freezer again in its own mount namespace, so proctrack/cgroup works as in SlurmCluster (the hierarchy is the
machine's: the cgroups slurmd makes are removed by stop() as there).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.hosts import Host, Hosts
from tests.slurm.cluster import SlurmCluster

CTLD_PORT, SLURMD_PORT = 6817, 6818  # Slurm's defaults: no other program shares the hosts' networks
# Before slurmd: its own /sys/fs/cgroup with the machine's freezer hierarchy (a mount namespace of its own).
MOUNT_FREEZER = ('mount -t tmpfs -o mode=755 nvrx-cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/freezer'
                 ' && mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer && exec "$@"')


@dataclass
class HostsSlurmCluster(SlurmCluster):
    """A SlurmCluster whose nodes are HOSTS (one slurmd each), with slurmctld and the clients on hosts[0]."""

    hosts: Hosts | None = None

    def __post_init__(self) -> None:
        if self.hosts is None or len(self.hosts) < 1:
            raise ValueError("HostsSlurmCluster needs hosts")
        self.nodes = len(self.hosts)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @property
    def node_names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def node_addr(self, name: str) -> str:
        return self.host(name).addr

    @property
    def ctld_host(self) -> str:
        return self.hosts[0].name

    @property
    def ctld_addr(self) -> str:
        return self.hosts[0].addr

    def ctld_port(self) -> int:
        return CTLD_PORT

    def node_line(self, name: str) -> str:
        # NodeHostname defaults to NodeName: the host's own name (its UTS namespace)
        return f"NodeName={name} NodeAddr={self.node_addr(name)} Port={SLURMD_PORT} CPUs=2 RealMemory=2000 State=UNKNOWN"

    def command(self, cmd: list[str], where: str | None = None) -> list[str]:
        """CMD on the host of node WHERE; slurmctld and the clients (WHERE None) on hosts[0]."""
        if where is None or where == "slurmctld":
            return self.hosts[0].wrap(cmd)
        host = self.host(where)
        if self.proctrack == "proctrack/cgroup":
            cmd = ["sh", "-c", MOUNT_FREEZER, "sh", *cmd]
        return host.wrap(cmd)

    def _name_nodes(self) -> None:
        """Nothing: every host names the others in its own /etc/hosts."""
