"""Shared helpers: run `nvrx launch` as a real subprocess and check the process tree afterwards."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]

# The suite's tiers, parallel-run rules and timeouts (docs/development.md, "Testing").
pytest_plugins = ("tests.tiers", "tests.timeouts", "tests.durations")


def tagged_processes(token: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment carries NVRX_TEST_TOKEN=token."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("NVRX_TEST_TOKEN") == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def monitor_dirs(procs: list[psutil.Process]) -> set[Path]:
    """The private /tmp/nvrx-mon-* directories of the rank monitors among PROCS. A monitor removes its own on
    every exit but a SIGKILL of itself: a test that kills a whole node at once removes them afterwards (a lost
    node's /tmp is gone with it)."""
    found = set()
    for proc in procs:
        try:
            cmd = proc.cmdline()
        except (psutil.Error, OSError):
            continue
        if "nvrx.monitors.rank_monitor" in cmd and "--socket" in cmd[:-1]:
            found.add(Path(cmd[cmd.index("--socket") + 1]).parent)
    return found


class Launcher:
    """Starts `nvrx launch` processes tagged with a token, so leftovers can be found by environment.
    Subclasses run another nvrx command (SUBCOMMAND) the same way."""

    subcommand = "launch"
    default_timeout = 120.0

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.token = uuid.uuid4().hex
        self.procs: list[subprocess.Popen] = []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # A test run inside a Slurm job must not hand the job's topology to these single-machine launches.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env["NVRX_TEST_TOKEN"] = self.token
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(extra or {})
        return env

    def start(self, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "nvrx", self.subcommand, *args]
        proc = subprocess.Popen(cmd, cwd=self.tmp_path, env=self.env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        timeout = self.default_timeout if timeout is None else timeout
        proc = self.start(*args, env=env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"nvrx {self.subcommand} did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def leftovers(self, wait: float = 5.0) -> list[psutil.Process]:
        """Processes from this test still alive after `wait` seconds (ranks die asynchronously)."""
        deadline = time.monotonic() + wait
        while True:
            left = tagged_processes(self.token)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in tagged_processes(self.token):
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


@pytest.fixture
def launcher(tmp_path: Path):
    lau = Launcher(tmp_path)
    yield lau
    lau.cleanup()


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Assert the bad-input contract: exit 2, no traceback, ONE stderr line holding every NEEDLE; that line."""
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def write_script(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


# How long a test waits for a process it started to get somewhere (an agent joining, a fork server or monitor
# appearing): generous, because wait_for returns as soon as it happens and a loaded 2-core machine takes tens of
# seconds to start interpreters; never a bound the test asserts about the product.
STARTUP_WAIT = 120.0


def wait_for(pred, timeout: float, interval: float = 0.05) -> bool:
    """Poll PRED until it is true (True) or TIMEOUT seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def pid_gone(pid: int) -> bool:
    """PID has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Something accepts connections on HOST:PORT: the agent that hosts a rendezvous store is serving it.

    Tests that start one agent as the store's host must wait for this, not for its log directory: that
    exists before the agent binds the port, and a second agent started in between would host instead.
    """
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


# Ports handed to tests: below the kernel's ephemeral range (32768+), so no outgoing connection anywhere on the
# machine can take one between free_port() and the bind it is meant for, and below nvrx.slurm's rendezvous ports
# (20000-29999). Each xdist worker of a session gets its own block, so parallel tests never get the same port.
PORT_FIRST, PORT_BLOCK, PORT_BLOCKS = 10000, 500, 20
_port_cursor: list[int] = []


def _port_block() -> int:
    """This process's block: its xdist worker number, offset by the session (two sessions rarely share one)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
    return (int(worker) if worker.isdigit() else 0) + int(uuid.uuid5(uuid.NAMESPACE_OID, session)) % PORT_BLOCKS


def free_port() -> int:
    """A TCP port nothing on this machine is bound to (any address), from this process's block."""
    if not _port_cursor:
        _port_cursor.append(int.from_bytes(os.urandom(2), "big") % PORT_BLOCK)
    base = PORT_FIRST + (_port_block() % PORT_BLOCKS) * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        _port_cursor[0] = (_port_cursor[0] + 1) % PORT_BLOCK
        port = base + _port_cursor[0]
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + PORT_BLOCK - 1}")


def run_events(run_dir: Path, prefix: str = "") -> list[dict]:
    """Every event in RUN_DIR's JSON-lines files whose name starts with PREFIX (agent-, monitor-)."""
    return [json.loads(line) for f in sorted(run_dir.glob(f"{prefix}*.jsonl")) for line in f.read_text().splitlines()]


def package_modules() -> list[tuple[str, Path]]:
    """Every module of the installed nvrx package: (dotted name, file). Read where nvrx is imported from,
    so the walk checks what users install (the wheel in CI), not the checkout."""
    import nvrx

    root = Path(nvrx.__file__).resolve().parent
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = ("nvrx", *path.relative_to(root).with_suffix("").parts)
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


@pytest.fixture
def host_job(tmp_path: Path):
    """make(N) -> a FaultJob whose agents run on N emulated hosts (tests/hosts.py); all removed afterwards."""
    from tests.hosts import host_job_factory

    make, close = host_job_factory(tmp_path)
    yield make
    close()


# A test that leaves a signal ignored or blocked in this process passes it on to every process a later test starts
# (an ignored disposition and the mask survive exec): a later `nvrx inspect --follow` or rank then never sees its
# SIGINT, an order-dependent failure (seen in loaded parallel runs). Each test gets the state back, and the one
# that changed it is named in a warning.
_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _signal_state() -> tuple[dict[int, object], set[int]]:
    return ({int(s): signal.getsignal(s) for s in _WATCHED_SIGNALS},
            set(signal.pthread_sigmask(signal.SIG_BLOCK, ())))


@pytest.fixture(autouse=True)
def _signal_state_kept(request: pytest.FixtureRequest):
    """Restore the main thread's signal dispositions and mask after each test; warn naming a test that left them
    changed."""
    import threading
    import warnings

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers, mask = _signal_state()
    yield
    now_handlers, now_mask = _signal_state()
    changed = {signal.Signals(s).name for s, h in now_handlers.items() if h != handlers[s]}
    changed |= {f"{signal.Signals(s).name} blocked" for s in now_mask ^ mask}
    if not changed:
        return
    for s, h in handlers.items():
        if h is not None and now_handlers[s] != h:
            signal.signal(s, h)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    warnings.warn(f"{request.node.nodeid} left the test process's signal state changed ({', '.join(sorted(changed))});"
                  " restored", stacklevel=1)
