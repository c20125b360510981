"""A real Slurm owned by the tests: munged, slurmctld and one slurmd per emulated node.

Everything lives in one temp dir and runs from the project's config in tests/slurm/test_cluster/.
The emulated nodes share this host's name, network and PID namespace; each has its own
loopback address (127.0.0.11, .12, ...) named in /etc/hosts, its own slurmd port, and its
own spool/pid/log files (%n). Only processes started here see SLURM_CONF (via env()).
tests/slurm/hosts_cluster.py runs the same cluster with each node on an emulated host of its own
(command(), node_line() and the ctld_* members are what it changes).
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from nvrx.common.process import die_with_parent
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).resolve().parent / "test_cluster"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_TAG = "# nvrx test cluster"
MARK = "NVRX_SLURM_CLUSTER"  # in every daemon's environment, so leftovers can be found

log = logging.getLogger(__name__)


class ClusterUnavailable(RuntimeError):
    """Slurm cannot run here; the message is the reason the Slurm tests skip."""


def wait_until(what: str, check, timeout: float, interval: float = 0.05,
               error: type[Exception] = ClusterUnavailable):
    """CHECK()'s first true value, polled every INTERVAL s; ERROR("WHAT did not happen...") after TIMEOUT s."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise error(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(interval)


def _bin(name: str) -> str | None:
    """Full path of a Slurm/munge program (daemons live in /usr/sbin, often not on a user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _bin(b) is None]


def _cgroup_freezer_usable() -> str | None:
    """None if proctrack/cgroup can work (cgroup v1 freezer writable), else why not."""
    root = Path("/sys/fs/cgroup/freezer")
    if not root.is_dir():
        return "no cgroup v1 freezer at /sys/fs/cgroup/freezer"
    probe = root / f"nvrx-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot create a freezer cgroup ({exc.strerror})"
    return None


def ensure_hosts(names: dict[str, str]) -> None:
    """Add 'ADDR NAME' lines for the emulated nodes to /etc/hosts, once."""
    text = HOSTS_FILE.read_text() if HOSTS_FILE.exists() else ""
    present = {tuple(line.split()[:2]) for line in text.splitlines() if line.strip() and not line.startswith("#")}
    missing = [f"{addr} {name} {HOSTS_TAG}" for name, addr in names.items() if (addr, name) not in present]
    if missing:
        with HOSTS_FILE.open("a") as fh:
            fh.write(("" if text.endswith("\n") or not text else "\n") + "\n".join(missing) + "\n")


@dataclass
class SlurmCluster:
    """Start with start(), stop with stop(); run Slurm commands with run()/env()."""

    nodes: int = 3
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="nvrx-slurm-")))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    proctrack: str = "proctrack/cgroup"
    proctrack_reason: str | None = None
    bringup_seconds: float = 0.0

    # ---------------------------------------------------------------- names and env

    @property
    def node_names(self) -> list[str]:
        return [f"nvrx-n{i}" for i in range(1, self.nodes + 1)]

    def node_addr(self, name: str) -> str:
        return f"127.0.0.{10 + int(name.rsplit('n', 1)[1])}"

    @property
    def ctld_host(self) -> str:
        return socket.gethostname()

    @property
    def ctld_addr(self) -> str:
        return "127.0.0.1"

    def ctld_port(self) -> int:
        return free_port()

    def node_line(self, name: str) -> str:
        """NAME's NodeName line in slurm.conf (the emulated nodes share this host's name and network)."""
        return (f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr={self.node_addr(name)} "
                f"Port={free_port()} CPUs=2 RealMemory=2000 State=UNKNOWN")

    def command(self, cmd: list[str], where: str | None = None) -> list[str]:
        """CMD as run on node WHERE (a node name, "slurmctld", None for a client): here, as it is."""
        return cmd

    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The calling environment plus SLURM_CONF of this cluster (never empty)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def run(self, *cmd: str, timeout: float = 30, check: bool = True,
            env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster, bounded in time."""
        out = subprocess.run(self.command(list(cmd)), check=False, env=self.env(env), capture_output=True, text=True,
                             timeout=timeout, **kw)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
        return out

    # ---------------------------------------------------------------- bring-up

    def start(self) -> "SlurmCluster":
        missing = missing_binaries()
        if missing:
            raise ClusterUnavailable(f"Slurm is not installed (missing {', '.join(missing)}); run scripts/install_slurm.sh as root")
        if os.geteuid() != 0:
            raise ClusterUnavailable("the test Slurm needs root (munged runs as the munge user, slurmd as root)")
        t0 = time.monotonic()
        try:
            self._layout()
            self._name_nodes()
            self._start_munge()
            self._write_config()
            self._start_daemons()
        except BaseException:
            self.stop()
            raise
        self.bringup_seconds = time.monotonic() - t0
        return self

    def _name_nodes(self) -> None:
        try:
            ensure_hosts({n: self.node_addr(n) for n in self.node_names})
        except OSError as exc:
            raise ClusterUnavailable(f"cannot name the emulated nodes in {HOSTS_FILE} ({exc.strerror})") from None

    def _layout(self) -> None:
        self.base.chmod(0o711)  # munged (another user) must reach its own subdir
        for sub in ("etc", "state", "run", "log", "tmp", "spool", "jobs"):
            (self.base / sub).mkdir(mode=0o700, exist_ok=True)
        (self.base / "jobs").chmod(0o755)

    def _start_munge(self) -> None:
        try:
            munge = pwd.getpwnam("munge")
        except KeyError:
            raise ClusterUnavailable("there is no munge user (is the munge package installed?)") from None
        mdir = self.base / "munge"
        mdir.mkdir(mode=0o700)
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for path in (mdir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        cmd = [_bin("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
               f"--pid-file={mdir / 'munged.pid'}", f"--log-file={mdir / 'munged.log'}",
               f"--seed-file={mdir / 'munged.seed'}", "--num-threads=2"]
        self._spawn("munged", cmd, user=munge.pw_uid, group=munge.pw_gid, extra_groups=[])
        wait_until("munged creating its socket", lambda: self._check_alive("munged") and self.munge_socket.exists(), 10)

    def _write_config(self) -> None:
        reason = _cgroup_freezer_usable()
        if reason:
            self.proctrack, self.proctrack_reason = "proctrack/linuxproc", reason
            log.warning("test Slurm uses proctrack/linuxproc: %s", reason)
        node_lines = [self.node_line(name) for name in self.node_names]
        # Job ids name cgroups and rendezvous ports: a random start keeps two test clusters apart.
        fields = {"base": str(self.base), "ctld_host": self.ctld_host, "ctld_addr": self.ctld_addr,
                  "ctld_port": str(self.ctld_port()), "first_job_id": str(random.randrange(10_000, 2_000_000)),
                  "munge_socket": str(self.munge_socket), "proctrack": self.proctrack, "nodes": "\n".join(node_lines),
                  "node_names": ",".join(self.node_names)}
        text = string.Template((TEMPLATES / "slurm.conf.in").read_text()).substitute(fields)
        self.conf.write_text(text)
        shutil.copy(TEMPLATES / "cgroup.conf", self.conf.parent / "cgroup.conf")
        self.conf.parent.chmod(0o755)  # job steps and clients read the config
        self.conf.chmod(0o644)

    def _start_daemons(self) -> None:
        self._spawn("slurmctld", self.command([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld"))
        wait_until("slurmctld answering", lambda: self._check_alive("slurmctld") and self._ping(), 20)
        for name in self.node_names:
            self._spawn(f"slurmd-{name}", self.command([_bin("slurmd"), "-D", "-N", name, "-f", str(self.conf)], name))
        wait_until("all emulated nodes idle", self._all_idle, 30, interval=0.1)

    def _spawn(self, name: str, cmd: list[str], **kw) -> None:
        env = self.env({MARK: str(self.base)})
        out = open(self.base / "log" / f"{name}.out", "ab")
        try:
            self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True,
                                                # the daemons die with the test process even when it is SIGKILLed
                                                # (a killed run left whole test clusters behind)
                                                preexec_fn=functools.partial(die_with_parent, os.getpid()), **kw)
        finally:
            out.close()

    def _check_alive(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            tail = (self.base / "log" / f"{name}.out").read_text(errors="replace").strip().splitlines()[-3:]
            raise ClusterUnavailable(f"{name} exited with {proc.returncode} at start-up: {' | '.join(tail)}")
        return True

    def _ping(self) -> bool:
        out = self.run("scontrol", "ping", check=False, timeout=10)
        return "UP" in out.stdout

    def _all_idle(self) -> bool:
        for name in self.node_names:
            self._check_alive(f"slurmd-{name}")
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.node_names)

    # ---------------------------------------------------------------- jobs

    def sbatch(self, *args: str, env: dict[str, str] | None = None, **kw) -> str:
        """Submit; return the job id."""
        out = self.run("sbatch", "--parsable", *args, env=env, **kw)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (KEY=VALUE fields); {} if Slurm forgot the job."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        if out.returncode != 0:
            return {}
        fields: dict[str, str] = {}
        for m in re.finditer(r"(\S+?)=(.*?)(?=\s+\S+?=|$)", out.stdout.strip()):
            fields.setdefault(m.group(1), m.group(2))
        return fields

    def wait_job(self, job_id: str, timeout: float = 90) -> dict[str, str]:
        """Block until the job is in a final state; return its fields."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                 "BOOT_FAIL", "DEADLINE"}
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in final:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False, timeout=10)
                raise AssertionError(f"job {job_id} not finished after {timeout:.0f} s: {info.get('JobState')}")
            time.sleep(0.2)

    def cancel_all(self, timeout: float = 20) -> None:
        out = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
        ids = out.stdout.split()
        if not ids:
            return
        self.run("scancel", *ids, check=False, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.strip():
            time.sleep(0.2)

    # ---------------------------------------------------------------- tear-down

    def leftovers(self) -> list[psutil.Process]:
        """Live processes started by this cluster's daemons (slurmstepd, job tasks, daemons)."""
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                env = proc.environ()
                if (env.get(MARK) == str(self.base) or env.get("SLURM_CONF") == str(self.conf)) \
                        and proc.status() != psutil.STATUS_ZOMBIE and proc.pid != os.getpid():
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def stop(self, keep_dir: bool = False) -> list[str]:
        """Cancel jobs, stop every daemon, kill anything left; return descriptions of what had to be killed."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.cancel_all()
            except (subprocess.TimeoutExpired, OSError):
                log.warning("could not cancel the test jobs", exc_info=True)
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        killed = []
        for proc in self.leftovers():
            try:
                killed.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
                proc.kill()
            except psutil.Error:
                pass
        self._remove_cgroups()
        if not keep_dir:
            shutil.rmtree(self.base, ignore_errors=True)
        return killed

    def _remove_cgroups(self) -> None:
        """Empty per-node cgroup dirs slurmd created (deepest first)."""
        for ctl in Path("/sys/fs/cgroup").glob("*"):
            for name in self.node_names:
                top = ctl / f"slurm_{name}"
                if top.is_dir():
                    for sub in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                        try:
                            sub.rmdir()
                        except OSError:
                            pass
                    try:
                        top.rmdir()
                    except OSError:
                        pass
