"""The launch configuration: one typed, validated object built once and passed down.

The CLI collects raw values; :func:`build_launch_config` turns them (plus the environment
it is handed) into a frozen :class:`LaunchConfig`. Nothing below the CLI reads argv or the
environment on its own, so every decision about a value is made here, once.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import math
import os
import re
import resource
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nvrx.launcher.agent.rdzv_auth import SECRET_FILE_ENV, load_secret
from nvrx.monitors.ft_config import FaultToleranceConfig
from nvrx.common.errors import ConfigError
from nvrx.common.files import file_kind
from nvrx.common.signals import DEFAULT_SIGNALS, parse_signals
from nvrx.slurm.environment import SlurmEnvError, SlurmTopology, slurm_topology

log = logging.getLogger(__name__)

DEFAULT_RDZV_PORT = 29400
STATE_DIR_ENV = "NVRX_STATE_DIR"  # state kept across the jobs of an auto-resume chain (--state-dir)
RESUME_STATE_DIR_ENV = "NVRX_RESUME_STATE_DIR"  # exported by `nvrx resume` to the command it runs
RESUME_FT_SUBDIR = "ft_state"  # under the resume state dir: the rank monitors' learned timeouts

# rdzv-conf keys we read, with their defaults (seconds). Other keys are accepted and ignored,
# as torchrun's c10d backend ignores keys it does not know.
RDZV_CONF_DEFAULTS: dict[str, float] = {
    "join_timeout": 600.0,  # how long to wait for a round to reach min nodes / for the endpoint
    "last_call_timeout": 30.0,  # after min nodes joined, how long to wait for more (up to max)
    "keepalive_interval": 1.0,  # agent liveness beat in the store
    "keepalive_timeout": 15.0,  # a node silent this long is dropped
    # no answer from the rendezvous store this long (a partition): this node stops its ranks and exits 1;
    # 0 = keepalive_timeout, so a cut-off node stops no later than the others go on without it
    "store_timeout": 0.0,
}
# Any seconds value: beyond this it is a typo, and far beyond it (inf, 1e308) it overflows the timers that
# use it (OverflowError from the first deadline computed, after the job started).
MAX_SECONDS = 30 * 86400.0
MIN_KEEPALIVE_INTERVAL = 0.05  # a beat per agent this often is already a busy store; 0 would spin
MAX_RESTARTS = 1_000_000  # a restart budget beyond this is a typo (and the store's counters are 64-bit)
MAX_NODES = 65_536  # the agents scan join slots up to twice the maximum: an absurd --nnodes would stall them
# What one rank costs this machine at the least, to bound --nproc-per-node by what the machine can hold:
RANK_MIN_MEMORY_MB = 64  # a Python rank that imported torch, forked from the template (shared pages not counted)
AGENT_FDS_PER_RANK = 8  # the agent's fds per rank: output pipes, pidfd, monitor socket and pipe, error file
TASKS_PER_RANK = 4  # processes and threads per rank counted by RLIMIT_NPROC and pid_max: rank, monitor, threads
# Mount types that are the kernel's view, not storage: checkpoints written there are lost or refused.
PSEUDO_FILESYSTEMS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                                "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs",
                                "binfmt_misc", "autofs", "efivarfs", "rpc_pipefs", "nsfs"})


class Std(enum.IntFlag):
    """Which standard streams of a rank are redirected (torchrun's 0/1/2/3 values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class RdzvSettings:
    """How this agent finds the other agents and forms rounds."""

    host: str
    port: int
    run_id: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    node_rank: int | None  # fixed group rank (static style) or None (assigned per round)
    local_addr: str | None  # address ranks of this node advertise; None = route to the endpoint
    standalone: bool = False
    join_timeout: float = RDZV_CONF_DEFAULTS["join_timeout"]
    last_call_timeout: float = RDZV_CONF_DEFAULTS["last_call_timeout"]
    keepalive_interval: float = RDZV_CONF_DEFAULTS["keepalive_interval"]
    keepalive_timeout: float = RDZV_CONF_DEFAULTS["keepalive_timeout"]
    store_timeout: float = RDZV_CONF_DEFAULTS["keepalive_timeout"]  # see RDZV_CONF_DEFAULTS["store_timeout"]
    master_addr: str | None = None  # --master-addr: overrides the process-group host
    master_port: int | None = None  # --master-port: fixed process-group port
    # Slurm's emulated or real nodes may all resolve the endpoint as local: only node 0 hosts the store.
    hosts_only_as_node0: bool = False
    # The job secret that signs the control records (docs/security.md); None: generated (--standalone) or none
    job_secret_file: str | None = None
    job_secret: bytes | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class WorkerSettings:
    """What each rank runs and how its output and termination are handled."""

    entrypoint: str
    args: tuple[str, ...]
    nproc_per_node: int
    module: bool = False
    no_python: bool = False
    python: str = sys.executable
    role: str = "default"
    redirects: Mapping[int, Std] = field(default_factory=dict)
    tee: Mapping[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    term_timeout: float = 30.0  # SIGTERM -> SIGKILL grace
    kill_timeout: float = 5.0  # after SIGKILL, how long before a rank is reported stuck and abandoned
    fork_server: bool = True  # fork ranks from a pre-imported template process when safe
    fast_exit: bool = True  # ranks skip the interpreter teardown after atexit handlers and flushes
    inprocess: bool = False  # --inprocess: ranks run the script in an in-process restart Wrapper
    inprocess_spares: int = 0  # --inprocess-spares: ranks kept idle until active ranks are lost
    # --virtual-local-rank: every rank sees LOCAL_RANK=0 and only its own GPU (CUDA_VISIBLE_DEVICES)
    virtual_local_rank: bool = False
    base_env: Mapping[str, str] = field(default_factory=dict)  # environment ranks inherit


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `nvrx launch` needs, validated."""

    rdzv: RdzvSettings
    workers: WorkerSettings
    max_restarts: int
    signals_to_handle: tuple[signal.Signals, ...]
    run_log_dir: Path  # where this run's JSON-lines event files go
    ft: FaultToleranceConfig | None = None  # built by the caller (layered sources); None: no rank monitors
    node_name: str = field(default_factory=socket.gethostname)  # per-node names/paths (Slurm: SLURMD_NODENAME)
    slurm: SlurmTopology | None = None  # set when the topology came from the Slurm environment
    state_dir: Path | None = None  # learned timeouts etc., kept across jobs (default <run_log_dir>/ft_state)
    jit_ckpt_timeout: float | None = None  # --jit-ckpt: seconds a just-in-time checkpoint may take (None: off)


# ---------------------------------------------------------------- parsing helpers


def jit_timeout(enabled: Any, timeout: Any) -> float | None:
    """--jit-ckpt / --jit-ckpt-timeout as the bound in seconds of a just-in-time checkpoint (None: off)."""
    if not enabled:
        if timeout is not None:
            raise ConfigError("--jit-ckpt-timeout needs --jit-ckpt")
        return None
    return positive_float(5.0 if timeout is None else timeout, "--jit-ckpt-timeout")


def local_ckpt_dir(value: str) -> str:
    """--local-ckpt-dir as an absolute path whose nearest existing ancestor is a directory we can write.

    Refused: the root directory (the job's session directories would be made, and removed, at the top of
    the file system) and paths on the kernel's pseudo file systems (/proc, /sys, /dev): nothing written
    there is a checkpoint.
    """
    hint = "choose node-local space you can write (e.g. /dev/shm/$USER or $SLURM_TMPDIR)"
    path = Path(value).expanduser().resolve()
    if path == path.parent:
        raise ConfigError(f"--local-ckpt-dir {value}: the root directory is not a checkpoint directory; {hint}")
    fstype = mount_type(path)
    if fstype in PSEUDO_FILESYSTEMS:
        raise ConfigError(f"--local-ckpt-dir {value}: {path} is on the kernel's {fstype} file system, not storage; "
                          f"{hint}")
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--local-ckpt-dir {value}: {probe} is not a writable directory; {hint}")
    return str(path)


MAX_NAME_CHARS = 128  # a run id names a directory and store keys; a role is shown and exported to ranks


def check_name(value: str, flag: str, allowed: str = r"[A-Za-z0-9_.\-]+") -> str:
    """VALUE of FLAG (--rdzv-id, --role) as a safe single path component: not empty, not '.' or '..', no path
    separator or control character, at most MAX_NAME_CHARS, and made only of ALLOWED characters.

    The run id names ``<log dir>/<run id>`` and ``<local ckpt dir>/<run id>``: '..' would write the job's
    files into the parent directory, a separator anywhere else."""
    text = str(value)
    if text in ("", ".", ".."):
        shown = "empty" if not text else repr(text)
        raise ConfigError(f"{flag} {shown} is not a usable name (it would name a directory of the job or "
                          "its parent); use letters, digits, '.', '_' or '-', e.g. the Slurm job id")
    if len(text) > MAX_NAME_CHARS:
        raise ConfigError(f"{flag} is {len(text)} characters long; use at most {MAX_NAME_CHARS}")
    if "/" in text or "\\" in text or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ConfigError(f"{flag} {text!r} contains a path separator or a control character; use letters, "
                          "digits, '.', '_' or '-'")
    if not re.fullmatch(allowed, text):
        raise ConfigError(f"{flag} {text!r}: use letters, digits, '.', '_' or '-' only")
    return text


def mount_type(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The file system type of the mount holding PATH (the longest mount point that is a prefix of it), from
    MOUNTINFO; None if it cannot be read."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    best, kind = -1, None
    for line in lines:
        fields_, sep, rest = line.partition(" - ")
        parts = fields_.split()
        if not sep or len(parts) < 5 or not rest.split():
            continue
        point = Path(parts[4].replace("\\040", " "))
        if (path == point or point in path.parents) and len(point.parts) > best:
            best, kind = len(point.parts), rest.split()[0]
    return kind


def parse_nnodes(value: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' -> (min, max)."""
    text = str(value).strip()
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise ConfigError(f"--nnodes {value!r} is not N or MIN:MAX with whole numbers, e.g. --nnodes 2 or --nnodes 1:4")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1:
        raise ConfigError(f"--nnodes {value!r}: the minimum number of nodes must be at least 1")
    if lo > hi:
        raise ConfigError(f"--nnodes {value!r}: MIN ({lo}) is larger than MAX ({hi}); write it as {hi}:{lo}")
    if hi > MAX_NODES:
        raise ConfigError(f"--nnodes {value!r}: at most {MAX_NODES} nodes; give the number of nodes the job runs on")
    return lo, hi


def parse_nproc(value: str | int) -> int:
    """torchrun's --nproc-per-node: an integer, or 'cpu'/'auto' (one per CPU here, no GPU)."""
    text = str(value).strip().lower()
    if text in ("cpu", "auto"):
        return os.cpu_count() or 1
    if text == "gpu":
        raise ConfigError("--nproc-per-node gpu: no GPU is visible on this machine; give a number instead")
    if not re.fullmatch(r"\d+", text):
        raise ConfigError(f"--nproc-per-node {value!r} is not a positive whole number (or 'cpu'/'auto')")
    n = int(text)
    if n < 1:
        raise ConfigError(f"--nproc-per-node {value!r} must be at least 1")
    return n


def machine_rank_capacity(meminfo: str = "/proc/meminfo", pid_max: str = "/proc/sys/kernel/pid_max") -> tuple[int, str]:
    """How many ranks this machine can hold, and the limit that says so (for the message).

    A bound, not a tuning: memory available at RANK_MIN_MEMORY_MB per rank, the agent's file descriptors
    (hard RLIMIT_NOFILE; the launch raises its soft limit to what it needs) and the tasks the kernel lets
    this user and the machine have (RLIMIT_NPROC, pid_max). Limits that cannot be read do not count.
    """
    found: list[tuple[int, str]] = []
    try:
        avail = next(int(line.split()[1]) for line in Path(meminfo).read_text().splitlines()
                     if line.startswith("MemAvailable:")) // 1024
        found.append((avail // RANK_MIN_MEMORY_MB, f"{avail} MiB of memory available, {RANK_MIN_MEMORY_MB} MiB "
                                                   "per rank at the least"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    for res, name, per in ((resource.RLIMIT_NOFILE, "open files (ulimit -Hn)", AGENT_FDS_PER_RANK),
                           (resource.RLIMIT_NPROC, "processes (ulimit -Hu)", TASKS_PER_RANK)):
        hard = resource.getrlimit(res)[1]
        if hard != resource.RLIM_INFINITY:
            found.append((hard // per, f"a hard limit of {hard} {name}, {per} per rank"))
    try:
        pids = int(Path(pid_max).read_text())
        found.append((pids // TASKS_PER_RANK, f"pid_max {pids}, {TASKS_PER_RANK} tasks per rank"))
    except (OSError, ValueError):
        pass
    if not found:
        return sys.maxsize, "no readable limit"
    return min(found)


def check_nproc_fits(nproc: int, capacity: tuple[int, str] | None = None) -> None:
    """--nproc-per-node within what this machine can hold: 100000 ranks were accepted, and the agent spawned
    until the machine ran out of memory or processes."""
    most, why = capacity or machine_rank_capacity()
    if nproc > most:
        raise ConfigError(f"--nproc-per-node {nproc}: this machine can hold at most {max(most, 0)} ranks ({why}); "
                          "give the number of ranks one node runs (e.g. its GPUs)")


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def check_host(value: str, flag: str) -> str:
    """VALUE is an IP address or a host name (dot-separated labels of letters, digits, '-' and '_'):
    'bad host!' went to the resolver and the launch sat silent until the join timeout."""
    text = str(value).strip()
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if not text or len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(f"{flag} {value!r} is not a host name or IP address (letters, digits, '-' and '.', "
                          "e.g. node001 or 10.0.0.1)")
    return text


def check_hosts_resolve(rdzv: RdzvSettings, timeout: float = 30.0) -> None:
    """Every host name the job needs (the endpoint, --master-addr, --local-addr) resolves, checked once before the
    first round: a name that does not would otherwise keep the agent trying, silent, until the join timeout.

    Bounded: a resolver that does not answer within TIMEOUT counts as failed; a temporary failure (EAI_AGAIN) is
    retried until then.
    """
    hosts = {name: flag for name, flag in ((rdzv.master_addr, "--master-addr"), (rdzv.local_addr, "--local-addr"))
             if name}
    if not rdzv.standalone:
        hosts.setdefault(rdzv.host, "--rdzv-endpoint")
    deadline = time.monotonic() + timeout
    for host, flag in hosts.items():
        why = _resolve_failure(host, deadline)
        if why is not None:
            raise ConfigError(f"{flag} host {host!r} does not resolve ({why}); check the name (e.g. with getent hosts "
                              f"{host}) or give an IP address")


def _resolve_failure(host: str, deadline: float) -> str | None:
    """None if HOST resolves before DEADLINE (an IP address always does), else why not."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    while True:
        outcome: list[BaseException | None] = []

        def lookup() -> None:
            try:
                socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
                outcome.append(None)
            except (OSError, UnicodeError) as exc:
                outcome.append(exc)

        worker = threading.Thread(target=lookup, name="nvrx-resolve", daemon=True)  # getaddrinfo has no timeout
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if not outcome:
            return "the resolver did not answer in time"
        exc = outcome[0]
        if exc is None:
            return None
        temporary = isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_AGAIN
        if not temporary or time.monotonic() + 1.0 > deadline:
            return getattr(exc, "strerror", None) or str(exc)
        time.sleep(1.0)  # a temporary resolver failure: ask again, within the bound


def check_backend(value: str | None) -> str:
    """--rdzv-backend: nvrx runs its own rendezvous, which takes torchrun's c10d and static endpoints. etcd
    was accepted and nvrx's rendezvous then ran against what the user believes is an etcd server."""
    backend = (value or "c10d").strip().lower()
    if backend in ("etcd", "etcd-v2"):
        raise ConfigError(f"--rdzv-backend {backend}: nvrx has no etcd rendezvous; use --rdzv-backend c10d with "
                          "--rdzv-endpoint HOST:PORT of one of the job's nodes (nvrx hosts the store there)")
    if backend not in ("c10d", "static", "nvrx"):
        raise ConfigError(f"--rdzv-backend {backend!r} is not supported; use c10d or static (nvrx runs its own)")
    return backend


def check_max_restarts(value: Any) -> int:
    """--max-restarts: a whole number up to MAX_RESTARTS (10**30 was taken as is)."""
    if not re.fullmatch(r"\d+", str(value).strip()):
        raise ConfigError(f"--max-restarts {value!r} must be a whole number >= 0")
    n = int(str(value).strip())
    if n > MAX_RESTARTS:
        raise ConfigError(f"--max-restarts {value}: at most {MAX_RESTARTS}; give the restarts the job may spend")
    return n


def check_signals(value: str | None) -> tuple[signal.Signals, ...]:
    """--signals-to-handle: None means the default; an empty or blank value was silently the default too,
    but names no signal: refused."""
    if value is None:
        return parse_signals(DEFAULT_SIGNALS)
    if not str(value).strip(" ,"):
        raise ConfigError(f"--signals-to-handle {value!r} names no signal; give e.g. {DEFAULT_SIGNALS} or leave "
                          "the option out")
    return parse_signals(value)


def check_script(entry: str, module: bool, no_python: bool) -> None:
    """The training script exists and, for python, is a file (a directory or a fifo is one line here, instead of
    a failure in every rank)."""
    if module:
        return
    try:
        mode = Path(entry).stat().st_mode
    except OSError:
        if no_python:
            return  # a program found on PATH
        raise ConfigError(f"training script {entry!r} does not exist (relative to {os.getcwd()})") from None
    if not stat.S_ISREG(mode) and not no_python:
        raise ConfigError(f"training script {entry!r} is {file_kind(mode)}, not a script file")


def empty_script_note(workers: WorkerSettings) -> str | None:
    """A warning when the training script is an empty file: it runs (as under torchrun), every rank exits 0 at
    once and the job 'succeeds' having done nothing, which deserves a word rather than silence."""
    if workers.module:
        return None
    try:
        empty = os.stat(workers.entrypoint).st_size == 0
    except OSError:
        return None
    if not empty:
        return None
    return (f"training script {workers.entrypoint} is empty: each rank runs nothing and exits 0 at once; "
            "check the path if that is not what you meant")


def parse_endpoint(value: str, default_port: int = DEFAULT_RDZV_PORT) -> tuple[str, int]:
    """'HOST', 'HOST:PORT', '[v6]:PORT' -> (host, port)."""
    text = str(value).strip()
    bad = ConfigError(f"--rdzv-endpoint {value!r} is not HOST[:PORT] (e.g. node001:29400 or [::1]:29400)")
    if not text:
        raise bad
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?", text)
    if m:
        host, port = m.group(1), m.group(2)
    elif text.count(":") > 1:  # only a bare IPv6 address may carry several colons
        try:
            host, port = str(ipaddress.IPv6Address(text)), None
        except ValueError:
            raise bad from None
    else:
        host, _, port = text.partition(":")
        port = port if _ else None
        if port == "":
            raise bad
    if not host or not re.fullmatch(r"[A-Za-z0-9_.:\-]+", host):
        raise bad
    if port is None:
        return host, default_port
    if not re.fullmatch(r"\d+", port) or not (1 <= int(port) <= 65535):
        raise ConfigError(f"--rdzv-endpoint {value!r}: port {port!r} is not a number in 1..65535")
    return host, int(port)


def parse_rdzv_conf(value: str | None) -> dict[str, float]:
    """'k1=v1,k2=v2' -> the keys we use, as floats; unknown keys are ignored like torchrun does."""
    out = dict(RDZV_CONF_DEFAULTS)
    if not value:
        return out
    for item in str(value).split(","):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf item {item!r} is not KEY=VALUE (e.g. join_timeout=900,last_call_timeout=5)")
        if key == "timeout":  # torchrun's generic name for the join timeout
            key = "join_timeout"
        if key in RDZV_CONF_DEFAULTS:
            out[key] = _rdzv_seconds(key, raw)
    return out


def _rdzv_seconds(key: str, raw: str) -> float:
    """One --rdzv-conf value in seconds: finite, within MAX_SECONDS; the keepalive interval not below
    MIN_KEEPALIVE_INTERVAL (0 would beat in a busy loop)."""
    try:
        num = float(raw)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}={raw!r}: expected a number of seconds") from None
    if not math.isfinite(num) or num < 0:
        raise ConfigError(f"--rdzv-conf {key}={raw!r}: must be a finite, non-negative number of seconds "
                          f"(at most {MAX_SECONDS:.0f})")
    if num > MAX_SECONDS:
        raise ConfigError(f"--rdzv-conf {key}={raw!r}: at most {MAX_SECONDS:.0f} seconds (30 days)")
    if key == "keepalive_interval" and num < MIN_KEEPALIVE_INTERVAL:
        raise ConfigError(f"--rdzv-conf keepalive_interval={raw!r}: the agents' beat needs at least "
                          f"{MIN_KEEPALIVE_INTERVAL:g} s between beats (default {RDZV_CONF_DEFAULTS[key]:g})")
    return num


def parse_std_map(value: str | None, nproc: int, flag: str) -> dict[int, Std]:
    """torchrun's redirect/tee syntax: '3' for every rank, or '0:1,1:2' per local rank."""
    if value is None or str(value).strip() == "":
        return {}
    text = str(value).strip()
    bad = f"{flag} {value!r}: expected 0-3 (1=stdout, 2=stderr, 3=both) or LOCAL_RANK:N pairs like 0:3,1:1"
    if re.fullmatch(r"[0-3]", text):
        return {r: Std(int(text)) for r in range(nproc)}
    out: dict[int, Std] = {}
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*([0-3])\s*", item)
        if not m:
            raise ConfigError(bad)
        out[int(m.group(1))] = Std(int(m.group(2)))
    return out


def parse_ranks_filter(value: str | None) -> frozenset[int] | None:
    if value is None or str(value).strip() == "":
        return None
    try:
        return frozenset(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--local-ranks-filter {value!r}: expected comma-separated local ranks, e.g. 0,1") from None


def positive_float(value: Any, what: str, allow_zero: bool = False, high: float = MAX_SECONDS) -> float:
    """A number of seconds: finite, positive (or zero with ALLOW_ZERO), at most HIGH. inf was accepted here
    and ended in an OverflowError traceback the first time a deadline was computed from it."""
    try:
        num = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} {value!r} is not a number") from None
    if not math.isfinite(num) or num < 0 or (num == 0 and not allow_zero):
        raise ConfigError(f"{what} {value!r} must be a finite, {'non-negative' if allow_zero else 'positive'} "
                          f"number of seconds (at most {high:.0f})")
    if num > high:
        raise ConfigError(f"{what} {value!r} is too large: at most {high:.0f} seconds")
    return num


# ---------------------------------------------------------------- Slurm


RDZV_FLAGS = ("rdzv_endpoint", "standalone", "master_addr")


def apply_slurm_env(raw: Mapping[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], SlurmTopology | None]:
    """Inside a Slurm job with no rendezvous flags: fill nnodes, node rank, endpoint and run id from Slurm.

    Only values the user did not give are filled (explicit flags win). One node needs no
    endpoint: it runs like --standalone, with the job id as run id.
    """
    if any(raw.get(k) for k in RDZV_FLAGS):
        return dict(raw), None
    try:
        topo = slurm_topology(env)
    except SlurmEnvError as err:
        raise ConfigError(str(err)) from None
    if topo is None:
        return dict(raw), None
    if topo.tasks_per_node > 1:
        raise ConfigError(f"one nvrx launch per node: use srun --ntasks-per-node=1 nvrx launch ... (this step runs "
                          f"{topo.tasks_per_node} tasks per node; nvrx starts --nproc-per-node ranks on each node itself)")
    out = dict(raw)
    if not out.get("nnodes"):
        if not topo.in_step and topo.nnodes > 1:
            raise ConfigError(f"nvrx launch is running in the batch script of a {topo.nnodes}-node job: start one agent "
                              "per node with srun --ntasks-per-node=1 nvrx launch ... (or pass --nnodes 1)")
        out["nnodes"] = str(topo.nnodes)
    out["rdzv_id"] = out.get("rdzv_id") or topo.job_id
    lo, hi = parse_nnodes(out["nnodes"])
    if out.get("node_rank") is None and lo == hi == topo.nnodes:
        out["node_rank"] = str(topo.node_rank)
    if hi > 1:
        out["rdzv_endpoint"] = f"{topo.rdzv_host}:{topo.rdzv_port}"
    return out, topo


def parse_inprocess(raw: Mapping[str, Any], min_world_size: int) -> dict[str, Any]:
    """--inprocess / --inprocess-spares N: in-process restart, with N idle spare ranks."""
    inprocess = bool(raw.get("inprocess"))
    spares = str(raw.get("inprocess_spares") or "0").strip()
    if not re.fullmatch(r"\d+", spares):
        raise ConfigError(f"--inprocess-spares {spares!r} must be a whole number >= 0")
    n = int(spares)
    if n and not inprocess:
        raise ConfigError("--inprocess-spares needs --inprocess (spares wait inside the in-process restart Wrapper)")
    if inprocess and raw.get("no_python"):
        raise ConfigError("--inprocess runs a Python script inside the ranks; it cannot be used with --no-python")
    if n >= min_world_size:
        raise ConfigError(f"--inprocess-spares {n} leaves no active rank in a job of {min_world_size} ranks; "
                          f"use at most {min_world_size - 1}")
    return {"inprocess": inprocess, "inprocess_spares": n}


def visible_device(parent: str | None, local_rank: int) -> str:
    """torchrun's --virtual-local-rank: the one GPU of LOCAL_RANK, from the agent's CUDA_VISIBLE_DEVICES if set."""
    if parent is None:
        return str(local_rank)
    return parent.split(",")[local_rank].strip()


def check_virtual_local_rank(raw: Mapping[str, Any], env: Mapping[str, str], nproc: int) -> bool:
    """--virtual-local-rank needs one visible GPU per rank when CUDA_VISIBLE_DEVICES limits them."""
    if not raw.get("virtual_local_rank"):
        return False
    parent = env.get("CUDA_VISIBLE_DEVICES")
    if parent is not None and nproc > len(parent.split(",")):
        raise ConfigError(f"--virtual-local-rank gives each of the {nproc} ranks one GPU, but "
                          f"CUDA_VISIBLE_DEVICES={parent} lists {len(parent.split(','))}")
    return True


# ---------------------------------------------------------------- the builder


def job_secret(flag: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """--job-secret-file, else $NVRX_JOB_SECRET_FILE: the path and the secret it holds (checked: owner-only)."""
    path = flag or env.get(SECRET_FILE_ENV) or None
    if path is None:
        return {}
    path = str(Path(path).expanduser())
    return {"job_secret_file": path, "job_secret": load_secret(path)}


def resolve_state_dir(flag: str | None, env: Mapping[str, str], run_log_dir: Path) -> Path:
    """Where rank monitors keep learned timeouts, first match wins:

    ``--state-dir``, ``$NVRX_STATE_DIR``, ``$NVRX_RESUME_STATE_DIR/ft_state`` (set by ``nvrx resume``, so
    every job of an auto-resume chain shares it without extra flags), else ``<run_log_dir>/ft_state``
    (this run only: a new run id starts from the configured timeouts).
    """
    resume_dir = env.get(RESUME_STATE_DIR_ENV)
    chosen = (flag or env.get(STATE_DIR_ENV)
              or (Path(resume_dir) / RESUME_FT_SUBDIR if resume_dir else None)
              or run_log_dir / "ft_state")
    return Path(chosen).expanduser().resolve()


def check_no_shadowing_nvrx(main_dir: Path) -> None:
    """Refuse a script directory holding its own `nvrx` module: a rank runs with that directory first on
    sys.path, so the user's code would import nvrx's package where under torchrun it imports the user's."""
    ours = Path(__file__).resolve().parents[2]  # the nvrx package directory
    for candidate in (main_dir / "nvrx.py", main_dir / "nvrx" / "__init__.py"):
        if candidate.exists() and candidate.resolve().parent != ours:
            raise ConfigError(f"{candidate} shadows the nvrx package in the ranks (its directory is first on their "
                              f"sys.path): rename it")


def build_launch_config(raw: Mapping[str, Any], env: Mapping[str, str],
                        ft: FaultToleranceConfig | None = None) -> LaunchConfig:
    """Validate raw CLI values (keys as the click parameter names) into a LaunchConfig.

    Raises ConfigError with a one-line message for anything the user must fix.
    """
    for key, flag in (("rdzv_id", "--rdzv-id"), ("role", "--role")):
        if raw.get(key) is not None:  # given (even empty): checked before Slurm or a default could replace it
            check_name(raw[key], flag, allowed=r"[A-Za-z0-9_.\-]+" if key == "rdzv_id" else r"[^\s/\\]+")
    raw, slurm = apply_slurm_env(raw, env)
    entry = raw.get("training_script")
    if not entry:
        raise ConfigError("missing the training script: nvrx launch [OPTIONS] SCRIPT [ARGS]... (or -m MODULE)")
    module = bool(raw.get("module"))
    no_python = bool(raw.get("no_python"))
    if module and no_python:
        raise ConfigError("-m/--module and --no-python cannot be used together")
    nproc = parse_nproc(raw.get("nproc_per_node") or "1")
    check_nproc_fits(nproc)
    standalone = bool(raw.get("standalone"))
    min_nodes, max_nodes = parse_nnodes(raw.get("nnodes") or "1")
    conf = parse_rdzv_conf(raw.get("rdzv_conf"))
    backend = check_backend(raw.get("rdzv_backend"))

    node_rank = raw.get("node_rank")
    if node_rank is not None:
        if not re.fullmatch(r"\d+", str(node_rank)):
            raise ConfigError(f"--node-rank {node_rank!r} must be a whole number >= 0")
        node_rank = int(node_rank)
        if min_nodes != max_nodes:
            raise ConfigError("--node-rank needs a fixed --nnodes N, not a MIN:MAX range")
        if node_rank >= max_nodes:
            raise ConfigError(f"--node-rank {node_rank} is out of range for --nnodes {max_nodes} (valid: 0..{max_nodes - 1})")

    master_addr = check_host(raw["master_addr"], "--master-addr") if raw.get("master_addr") else None
    master_port = raw.get("master_port")
    if master_port is not None:
        if not re.fullmatch(r"\d+", str(master_port)) or not 1 <= int(master_port) <= 65535:
            raise ConfigError(f"--master-port {master_port!r} is not a port number in 1..65535")
        master_port = int(master_port)

    run_id = raw.get("rdzv_id") or "none"
    if standalone:
        if min_nodes != 1 or max_nodes != 1:
            raise ConfigError("--standalone runs a single node; drop --nnodes or use --rdzv-endpoint for several nodes")
        host, port = "127.0.0.1", 0  # 0 = pick a free port ourselves
        run_id = raw.get("rdzv_id") or f"standalone-{os.getpid()}"
    elif raw.get("rdzv_endpoint"):
        host, port = parse_endpoint(raw["rdzv_endpoint"])
    elif backend == "static" or master_addr:
        host = master_addr or "127.0.0.1"
        port = DEFAULT_RDZV_PORT
    elif max_nodes == 1:
        host, port = "127.0.0.1", 0  # single node without an endpoint: behave like --standalone
        standalone = True
    else:
        raise ConfigError("several nodes need --rdzv-endpoint HOST:PORT (the host of one of the nodes)")

    check_name(str(run_id), "--rdzv-id")

    rdzv = RdzvSettings(
        host=host,
        port=port,
        run_id=str(run_id),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        node_rank=node_rank,
        local_addr=check_host(raw["local_addr"], "--local-addr") if raw.get("local_addr") else None,
        standalone=standalone,
        join_timeout=conf["join_timeout"],
        last_call_timeout=conf["last_call_timeout"],
        keepalive_interval=conf["keepalive_interval"],
        keepalive_timeout=max(conf["keepalive_timeout"], 3 * conf["keepalive_interval"]),
        store_timeout=conf["store_timeout"] or max(conf["keepalive_timeout"], 3 * conf["keepalive_interval"]),
        master_addr=master_addr or None,
        master_port=master_port,
        hosts_only_as_node0=slurm is not None,
        **job_secret(raw.get("job_secret_file"), env),
    )

    check_script(str(entry), module, no_python)
    if not no_python:
        check_no_shadowing_nvrx(Path.cwd() if module else Path(entry).resolve().parent)

    log_dir = Path(raw["log_dir"]).expanduser().resolve() if raw.get("log_dir") else None
    redirects = parse_std_map(raw.get("redirects"), nproc, "--redirects")
    tee = parse_std_map(raw.get("tee"), nproc, "--tee")
    base_env = dict(env)
    if "OMP_NUM_THREADS" not in base_env and nproc > 1:
        # torchrun's rule: several ranks on a node would each start one OpenMP thread per core
        log.info("setting OMP_NUM_THREADS=1 for each rank (%d ranks on this node); set it to tune", nproc)
        base_env["OMP_NUM_THREADS"] = "1"
    if raw.get("async_ckpt"):
        base_env["NVRX_ASYNC_CKPT"] = "1"  # read by the rank bootstrap (nvrx.ckpt.async_ckpt.writer_process)
    jit_ckpt_timeout = jit_timeout(raw.get("jit_ckpt"), raw.get("jit_ckpt_timeout"))
    if jit_ckpt_timeout is not None:
        base_env["NVRX_JIT_CKPT"] = f"{jit_ckpt_timeout:g}"  # read by the rank bootstrap and nvrx.ckpt.jit
    if raw.get("local_ckpt_dir"):
        base_env["NVRX_LOCAL_CKPT_DIR"] = local_ckpt_dir(raw["local_ckpt_dir"])  # read by nvrx.ckpt.local.default_root()
    workers = WorkerSettings(
        entrypoint=str(entry),
        args=tuple(raw.get("training_script_args") or ()),
        nproc_per_node=nproc,
        module=module,
        no_python=no_python,
        role=raw.get("role") or "default",
        redirects=redirects,
        tee=tee,
        local_ranks_filter=parse_ranks_filter(raw.get("local_ranks_filter")),
        term_timeout=positive_float(raw.get("term_timeout", 30.0), "--term-timeout", allow_zero=True),
        kill_timeout=positive_float(raw.get("kill_timeout", 5.0), "--kill-timeout"),
        fork_server=bool(raw.get("fork_server", True)) and not no_python,
        fast_exit=bool(raw.get("fast_exit", True)),
        base_env=base_env,
        virtual_local_rank=check_virtual_local_rank(raw, env, nproc),
        **parse_inprocess(raw, nproc * min_nodes),
    )

    # torchrun's --monitor-interval: checked for torchrun compatibility, unused (rank exits wake the agent at once)
    positive_float(raw.get("monitor_interval", 0.1), "--monitor-interval")
    max_restarts = check_max_restarts(raw.get("max_restarts", 0))
    run_log_dir = (log_dir or Path(raw.get("events_dir") or Path.cwd() / "nvrx_logs")) / rdzv.run_id
    return LaunchConfig(
        rdzv=rdzv,
        workers=workers,
        max_restarts=max_restarts,
        signals_to_handle=check_signals(raw.get("signals_to_handle")),
        run_log_dir=run_log_dir,
        state_dir=resolve_state_dir(raw.get("state_dir"), env, run_log_dir),
        ft=ft,
        node_name=(slurm.node_name if slurm else None) or socket.gethostname(),
        slurm=slurm,
        jit_ckpt_timeout=jit_ckpt_timeout,
    )
