"""Emulated hosts for multi-node tests: Linux network namespaces the test makes itself.

Each host is a network namespace with one link (``eth0``, a veth pair) into a bridge that lives in a "switch"
namespace of its own, an address from 198.18.0.0/15 (RFC 2544's benchmarking range: no real network uses it,
and only these namespaces hold it here), and its own host name: ``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts`` over ``/etc/hosts`` in a private mount namespace, and every command runs in a UTS
namespace of its own where ``hostname`` is set first. Nothing is added to the machine's own network namespace
(the veth ends are created directly inside the test's namespaces), so no traffic can leave them.

Faults: ``cut(host)`` / ``heal(host)`` set the switch's port of a host down / up (a pulled cable or a dead
switch port: the host's processes live on, its packets go nowhere, connects end in "No route to host");
``freeze(host)`` / ``thaw(host)`` SIGSTOP / SIGCONT every process inside the host (a hung kernel, a VM pause).

Everything is removed afterwards, also when the test fails (``close()``, called by the fixture's teardown and
at interpreter exit); namespaces left by a test process that was SIGKILLed are removed by the next run.
Where namespaces cannot be made (not root, no ``ip``, a container without CAP_SYS_ADMIN) the tests skip with
the reason, unless ``NVRX_REQUIRE_NETNS=1`` (CI) turns that into a failure.

    python -m tests.hosts 2       # make two hosts, print how to use them, remove them on Enter
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import psutil

PREFIX = "nvt"  # every namespace this module makes: nvt-<owner pid>-<tag>-<role>
NETNS_ETC = Path("/etc/netns")
RUN_NETNS = Path("/var/run/netns")
REQUIRE_ENV = "NVRX_REQUIRE_NETNS"


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made on this machine, or None when they can (tried for real once)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (ip netns add)"
    if shutil.which("ip") is None:
        return "emulated hosts need iproute2's `ip` (apt-get install iproute2)"
    if shutil.which("unshare") is None:
        return "emulated hosts need util-linux's `unshare`"
    probe = f"{PREFIX}-{os.getpid()}-probe{uuid.uuid4().hex[:4]}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Namespaces (and their /etc/netns files) of test processes that are gone: a SIGKILLed test's leftovers."""
    res = _ip("netns", "list", check=False)
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if psutil.pid_exists(int(parts[1])):
            continue
        _kill_all_in(name)
        _ip("netns", "del", name, check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def _pids_in(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _monitor_dirs_in(namespaces: list[str]) -> set[Path]:
    """The private socket directories of the rank monitors running inside NAMESPACES (the hosts share /tmp)."""
    from tests.conftest import monitor_dirs

    procs = []
    for ns in namespaces:
        for pid in _pids_in(ns):
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
    return monitor_dirs(procs)


def _kill_all_in(ns: str, sig: int = signal.SIGKILL) -> None:
    for pid in _pids_in(ns):
        try:
            if sig == signal.SIGKILL:
                os.kill(pid, signal.SIGCONT)  # a frozen process still dies of SIGKILL; harmless otherwise
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, host name and address."""

    index: int
    ns: str
    name: str
    addr: str
    port_on_switch: str  # the bridge port (in the switch namespace) this host's cable plugs into

    def prefix(self) -> list[str]:
        """The command prefix that runs a program on this host (own network, /etc/hosts and host name)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name]

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        return [*self.prefix(), *cmd]

    def pids(self) -> list[int]:
        """Every process whose network namespace is this host's."""
        return _pids_in(self.ns)


class Hosts:
    """N emulated hosts on one switch; ``hosts[i]`` is host i (0-based), named ``<stem>i`` (default node0...)."""

    def __init__(self, n: int, stem: str = "node", subnet: int | None = None,
                 aliases: dict[str, str] | None = None) -> None:
        """SUBNET: the third byte of 198.18.SUBNET.0/24 (random by default); ALIASES: extra /etc/hosts lines
        (name -> address), the same on every host, for tests of names that resolve elsewhere."""
        reason = unavailable_reason()
        if reason is not None:
            raise HostsUnavailable(reason)
        remove_stale()
        self.tag = uuid.uuid4().hex[:4]
        base = f"{PREFIX}-{os.getpid()}-{self.tag}"
        self.switch = f"{base}-sw"
        self.subnet = subnet if subnet is not None else int(uuid.uuid4().int % 250) + 1
        self.hosts: list[Host] = [
            Host(i, f"{base}-h{i}", f"{stem}{i}", f"198.18.{self.subnet}.{i + 1}", f"p{i}") for i in range(n)]
        self._closed = False
        atexit.register(self.close)
        try:
            self._build(aliases or {})
        except BaseException:
            self.close()
            raise

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    # ------------------------------------------------------------ building and removing

    def _build(self, aliases: dict[str, str]) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        lines = ["127.0.0.1 localhost"] + [f"{h.addr} {h.name}" for h in self.hosts]
        lines += [f"{addr} {name}" for name, addr in aliases.items()]
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            # both ends are made inside the test's namespaces: the machine's own namespace never sees them
            _ip("link", "add", "eth0", "netns", h.ns, "type", "veth", "peer", "name", h.port_on_switch,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", h.port_on_switch, "master", "br0")
            _ip("-n", self.switch, "link", "set", h.port_on_switch, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            etc = NETNS_ETC / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            (etc / "hostname").write_text(h.name + "\n")

    def close(self) -> None:
        """Kill every process inside the hosts, remove the namespaces (their links and the bridge go with
        them) and the /etc/netns files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        monitors = _monitor_dirs_in([h.ns for h in self.hosts])
        for h in self.hosts:
            _kill_all_in(h.ns)
        deadline = time.monotonic() + 10
        while any(h.pids() for h in self.hosts) and time.monotonic() < deadline:
            time.sleep(0.05)
        for gone in monitors:  # SIGKILLed with their hosts: nothing was left to remove their socket directories
            shutil.rmtree(gone, ignore_errors=True)
        for ns in [h.ns for h in self.hosts] + [self.switch]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        try:
            NETNS_ETC.rmdir()  # only when no other namespace has files there
        except OSError:
            pass

    # ------------------------------------------------------------ faults

    def cut(self, host: Host) -> None:
        """Pull HOST's cable: its switch port goes down; its processes keep running, cut off from the others."""
        _ip("-n", self.switch, "link", "set", host.port_on_switch, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port_on_switch, "up")

    def freeze(self, host: Host) -> list[int]:
        """SIGSTOP every process on HOST (its agent, monitors, ranks...); returns the pids stopped."""
        pids = host.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        return pids

    def thaw(self, host: Host) -> None:
        for pid in host.pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def add_address(self, host: Host, last_byte: int) -> str:
        """A second address for HOST on its link (198.18.<subnet>.LAST_BYTE); returns it."""
        addr = f"198.18.{self.subnet}.{last_byte}"
        _ip("-n", host.ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        return addr

    def set_hosts_file(self, host: Host, lines: Sequence[str]) -> None:
        """Replace HOST's /etc/hosts (read by the programs started on it from now on)."""
        (NETNS_ETC / host.ns / "hosts").write_text("\n".join(lines) + "\n")

    def hosts_lines(self) -> list[str]:
        """The /etc/hosts every host starts with."""
        return ["127.0.0.1 localhost"] + [f"{h.addr} {h.name}" for h in self.hosts]

    def run(self, host: Host, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run CMD on HOST to completion (text output)."""
        return subprocess.run(host.wrap(cmd), capture_output=True, text=True, timeout=timeout)


def require_hosts(n: int, **kw) -> Hosts:
    """Hosts(N), or a pytest skip with the reason (a failure when NVRX_REQUIRE_NETNS=1)."""
    import pytest

    try:
        return Hosts(n, **kw)
    except HostsUnavailable as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{exc} ({REQUIRE_ENV}=1: emulated hosts are required here)")
        pytest.skip(str(exc))


def main(argv: list[str]) -> int:
    n = int(argv[1]) if len(argv) > 1 else 2
    hosts = Hosts(n)
    for h in hosts:
        print(f"{h.name} {h.addr}: {' '.join(h.prefix())} CMD")
    try:
        input("Enter removes them> ")
    finally:
        hosts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))


# ---------------------------------------------------------------- pytest side


def host_job_factory(tmp_path: Path):
    """(make, close): make(N, **Hosts kwargs) -> a HostJob on N fresh hosts; close() removes all of them."""
    made: list = []

    def make(n: int, **kw):
        from tests.faults.conftest import FaultJob

        hosts = require_hosts(n, **kw)
        job = _host_job_class(FaultJob)(tmp_path / f"hosts{len(made)}" if made else tmp_path, hosts)
        made.append(job)
        return job

    def close() -> None:
        for job in made:
            try:
                job.cleanup()
            finally:
                job.hosts.close()

    return make, close


def _host_job_class(base):
    class HostJob(base):
        """A FaultJob whose `nvrx launch` processes run on emulated hosts: ``start_on(host, *args)``."""

        def __init__(self, tmp_path: Path, hosts: Hosts) -> None:
            tmp_path.mkdir(parents=True, exist_ok=True)
            super().__init__(tmp_path)
            self.hosts = hosts

        def start_on(self, host: Host, *args: str, env: dict[str, str] | None = None,
                     subcommand: str = "launch") -> subprocess.Popen:
            if self._shm is None:
                from tests.faults.conftest import ShmWatch

                self._shm = ShmWatch(self.token)
            cmd = host.wrap([sys.executable, "-m", "nvrx", subcommand, *args])
            proc = subprocess.Popen(cmd, cwd=self.tmp_path, env=self.env(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            self.procs.append(proc)
            return proc

    return HostJob
