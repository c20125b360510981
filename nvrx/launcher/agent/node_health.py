"""Node health checks the agent runs before it joins each rendezvous round.

A node that fails one sits the round out (the others go on within ``--nnodes MIN:MAX``, a standby takes
its place) instead of costing the job a restart it would fail again. Every check is bounded in time (a
check that does not finish in ``node_health_check_timeout`` seconds counts as failed) and the checks run
in parallel, so one round pays for the slowest check only.

Built-in checks: GPUs (``nvidia-smi``; "skipped: no GPU" without one), free memory and free disk of the
run's log directory, shared storage (``enable_dist_storage_healthcheck`` with ``storage_healthcheck_path``:
write, fsync, read back, delete), InfiniBand links (``enable_nic_healthcheck``: sysfs port states), and
the user's hook (``node_health_check_hook``: a command, or ``module:function`` for a Python callable;
both run in a child process so that a hung hook can be killed).
"""

from __future__ import annotations

import glob
import logging
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from nvrx.monitors.ft_config import FaultToleranceConfig

log = logging.getLogger("nvrx.node_health")

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
WARNING = "warning"  # said, but not a failure: the node joins (e.g. little space left for the run's logs)
DEFAULT_IB_STATES = "/sys/class/infiniband/*/ports/*/state"
# Checks of storage every node shares (storage_healthcheck_path): failing them says the storage is full or broken,
# usually for every node at once, so the verdict is exit 18 (nvrx.common.exit_codes), never a node exclusion.
STORAGE_CHECKS = frozenset({"storage"})
KILL_WAIT = 5.0  # after SIGKILL to a health hook's group: how long its leader and output may take to go


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: ``status`` is ok / failed / skipped; ``detail`` says why, in a few words."""

    name: str
    status: str
    detail: str
    seconds: float


@dataclass(frozen=True)
class HealthReport:
    """All checks of one pass."""

    results: tuple[CheckResult, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.status != FAILED for r in self.results)

    @property
    def node_ok(self) -> bool:
        """No check of the node itself failed (a failed shared-storage check is the storage's fault, not its)."""
        return all(r.status != FAILED for r in self.results if r.name not in STORAGE_CHECKS)

    def storage_failures(self) -> list[CheckResult]:
        return [r for r in self.failures() if r.name in STORAGE_CHECKS]

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAILED]

    def warnings(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == WARNING]

    def summary(self) -> str:
        return "; ".join(f"{r.name}: {r.detail}" for r in self.failures()) or "all checks passed"


Check = Callable[[float], tuple[str, str]]  # timeout -> (status, detail)


class NodeHealthChecks:
    """The configured set of checks; ``run()`` runs them all, in parallel, each within the timeout."""

    def __init__(self, ft: FaultToleranceConfig, log_dir: Path) -> None:
        self.timeout = ft.node_health_check_timeout
        self.checks: dict[str, Check] = {
            "gpu": check_gpus,
            "memory": lambda _t: check_free_memory(ft.node_health_min_free_memory_mb),
            "disk": lambda _t: check_free_disk(log_dir, ft.node_health_min_free_disk_mb),
        }
        if ft.enable_dist_storage_healthcheck:
            self.checks["storage"] = lambda t: check_storage(ft.storage_healthcheck_path, t)
        if ft.enable_nic_healthcheck:
            self.checks["nic"] = lambda _t: check_ib_links(ft.link_state_path_template)
        if ft.node_health_check_hook:
            self.checks["hook"] = lambda t: run_hook(ft.node_health_check_hook, t)

    def run(self) -> HealthReport:
        t0 = time.monotonic()
        pool = ThreadPoolExecutor(max_workers=len(self.checks), thread_name_prefix="nvrx-health")
        futures = {name: pool.submit(_timed, name, check, self.timeout) for name, check in self.checks.items()}
        results = []
        for name, future in futures.items():
            left = max(0.0, self.timeout - (time.monotonic() - t0)) + 0.5  # subprocess checks time out first
            try:
                results.append(future.result(timeout=left))
            except TimeoutError:
                results.append(CheckResult(name, FAILED, f"did not finish in {self.timeout:g} s",
                                           round(time.monotonic() - t0, 3)))
        pool.shutdown(wait=False)  # a check stuck in the kernel (a dead NFS mount) is left behind, not waited for
        return HealthReport(tuple(results), round(time.monotonic() - t0, 3))


def _timed(name: str, check: Check, timeout: float) -> CheckResult:
    t0 = time.monotonic()
    try:
        status, detail = check(timeout)
    except Exception as exc:  # a check's own error is a failed check, said in one line
        status, detail = FAILED, f"{type(exc).__name__}: {exc}"
    return CheckResult(name, status, detail, round(time.monotonic() - t0, 3))


# ---------------------------------------------------------------- built-in checks


def check_gpus(timeout: float, smi: str | None = None) -> tuple[str, str]:
    """Every GPU answers ``nvidia-smi`` (the NVML query of the driver), within TIMEOUT."""
    smi = smi or shutil.which("nvidia-smi")
    if smi is None:
        if glob.glob("/dev/nvidia[0-9]*"):
            return FAILED, "GPU device nodes exist but nvidia-smi is not installed"
        return SKIPPED, "no GPU"
    code, out = _run([smi, "--query-gpu=index,name,pci.bus_id", "--format=csv,noheader"], timeout)
    if code != 0:
        return FAILED, f"nvidia-smi exited {code}: {out or 'no output'}"
    gpus = [line for line in out.splitlines() if line.strip()]
    return (OK, f"{len(gpus)} GPU(s) answer") if gpus else (FAILED, "nvidia-smi lists no GPU")


def check_free_memory(min_mb: float) -> tuple[str, str]:
    free = psutil.virtual_memory().available / 2**20
    if free < min_mb:
        return FAILED, f"{free:.0f} MiB memory available, below {min_mb:g} MiB"
    return OK, f"{free:.0f} MiB memory available"


def check_free_disk(path: Path, min_mb: float) -> tuple[str, str]:
    """Free space where the run's logs go. Little space is a warning, never a failure: events and logs are
    diagnostics (the event writer drops what it cannot write and says so), and that file system is usually
    shared, so its being full says nothing about this node."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**20
    if free < min_mb:
        return WARNING, f"{free:.0f} MiB free at {probe}, below {min_mb:g} MiB: events and logs may be dropped"
    return OK, f"{free:.0f} MiB free at {probe}"


def check_storage(path: str | None, timeout: float) -> tuple[str, str]:
    """PATH takes a small write, fsync, read back and delete within TIMEOUT."""
    if not path:
        return FAILED, "enable_dist_storage_healthcheck needs storage_healthcheck_path"
    t0 = time.monotonic()
    payload = os.urandom(4096)
    fd, probe = tempfile.mkstemp(prefix=".nvrx-health-", dir=path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if Path(probe).read_bytes() != payload:
            return FAILED, f"{path}: read back differs from what was written"
    finally:
        Path(probe).unlink(missing_ok=True)
    took = time.monotonic() - t0
    if took > timeout:
        return FAILED, f"{path}: write+fsync+read took {took:.2f} s, over {timeout:g} s"
    return OK, f"{path} writable ({took * 1000:.0f} ms)"


def check_ib_links(template: str | None) -> tuple[str, str]:
    """Every InfiniBand port's sysfs state is ACTIVE (``link_state_path_template``, ``{}`` -> every device)."""
    pattern = template.replace("{}", "*") if template else DEFAULT_IB_STATES
    ports = sorted(glob.glob(pattern))
    if not ports:
        return SKIPPED, "no InfiniBand port found"
    down = [p for p in ports if "ACTIVE" not in Path(p).read_text(errors="replace").upper()]
    if down:
        return FAILED, f"{len(down)} of {len(ports)} link(s) not ACTIVE: {', '.join(down[:3])}"
    return OK, f"{len(ports)} link(s) ACTIVE"


def run_hook(hook: str, timeout: float) -> tuple[str, str]:
    """The user's check: exit 0 means healthy. ``module:function`` runs that function in a child Python."""
    if _is_callable_ref(hook):
        module, func = hook.split(":", 1)
        code = f"import sys, {module} as m; r = m.{func}(); sys.exit(0 if r is None or r is True else 1)"
        argv = [sys.executable, "-c", code]
    else:
        argv = shlex.split(hook)
    code, out = _run(argv, timeout)
    last = out.splitlines()[-1] if out else ""
    if code == 0:
        return OK, last or "hook passed"
    return FAILED, f"hook exited {code}" + (f": {last}" if last else "")


def _is_callable_ref(hook: str) -> bool:
    head, sep, tail = hook.partition(":")
    return bool(sep) and " " not in hook and "/" not in head and all(
        part.isidentifier() for part in [*head.split("."), tail])


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run ARGV in its own process group; (exit code, output) or TimeoutError after killing the group.

    The group (nothing the check started may outlive it) is killed while its leader is still unreaped, alive or
    a zombie: until we reap it, its pid, which is the group's id, cannot be given to another process, so the
    signal cannot reach a recycled group. Only then is the leader reaped.
    """
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace")
    except OSError as exc:
        return 127, f"cannot run {argv[0]}: {exc.strerror or exc}"
    output: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()), name="health-hook-output",
                              daemon=True)
    reader.start()
    exited = _wait_unreaped(proc.pid, timeout)
    _kill_group(proc.pid)
    if not exited:
        _wait_unreaped(proc.pid, KILL_WAIT)
    proc.wait()  # reaped only now that the group was signalled
    reader.join(KILL_WAIT)  # EOF once every holder of the pipe died; one that left the group is not waited for
    if not exited:
        raise TimeoutError(f"did not finish in {timeout:g} s")
    return proc.returncode, (output[0] if output else "").strip()[-500:]


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Whether PID exited within TIMEOUT, without reaping it (its pidfd turns readable on exit)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # no pidfd (old kernel): poll the state instead, still without reaping
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _exited(pid):
                return True
            time.sleep(0.05)
        return _exited(pid)
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _exited(pid: int) -> bool:
    """PID (our unreaped child) is a zombie or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
