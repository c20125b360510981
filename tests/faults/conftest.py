"""The fault matrix's harness: run a job under a fault and check the three promises of every row.

1. the job ends as documented (finishes, or one clear line and the documented exit code): each test;
2. no work reported saved is lost: ``Ledger.assert_no_saved_work_lost`` (train.py's ledger);
3. nothing of the job is left: no process (tagged by environment), no temp dir or Unix socket in the
   job's own TMPDIR, no shared-memory file its processes used, no listener on the job's ports:
   ``FaultJob.assert_clean``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from nvrx.common.net import port_in_use
from tests.conftest import STARTUP_WAIT, Launcher, free_port, listening, run_events, tagged_processes, wait_for

TRAIN = Path(__file__).with_name("train.py")
SHM = Path("/dev/shm")


TORCH_CACHES = ("torchinductor_",)  # torch's compile cache under TMPDIR: meant to outlive jobs


def shm_paths(procs: list[psutil.Process]) -> set[str]:
    """The files under /dev/shm that PROCS hold open or mapped (other tests' shm is not this job's)."""
    found: set[str] = set()
    for p in procs:
        try:
            paths = [f.path for f in p.open_files()] + [m.path for m in p.memory_maps(grouped=True)]
        except (psutil.Error, OSError):
            continue
        found.update(x.split(" (deleted)")[0] for x in paths if x.startswith(str(SHM) + "/"))
    return found


class ShmWatch:
    """Samples, while the job runs, the shared-memory files its processes use, so that the end of the job can
    be checked for exactly those (a concurrent test's /dev/shm files are not this job's leftovers)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shm-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            self.seen |= shm_paths(tagged_processes(self.token))

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join(5)
        return self.seen


class Ledger:
    """train.py's ledger: "saved" once a checkpoint is durable, "resumed" at each start, "finished"."""

    def __init__(self, out: Path) -> None:
        self.path = out / "ledger.jsonl"

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def saved(self) -> int:
        return max((e["step"] for e in self.entries() if e["ev"] == "saved"), default=0)

    def resumes(self) -> list[int]:
        return [e["step"] for e in self.entries() if e["ev"] == "resumed"]

    def finished(self) -> bool:
        return any(e["ev"] == "finished" for e in self.entries())

    def assert_no_saved_work_lost(self) -> None:
        """Every start resumed from at least the newest step reported saved before it, and the checkpoint
        on disk at the end holds at least the newest step ever reported saved."""
        best = 0
        for e in self.entries():
            if e["ev"] == "resumed":
                assert e["step"] >= best, f"resumed from step {e['step']} after step {best} was reported saved"
            elif e["ev"] == "saved":
                best = max(best, e["step"])
        ckpt = self.path.with_name("ckpt.json")
        on_disk = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
        assert on_disk >= best, f"checkpoint holds step {on_disk}, step {best} was reported saved"


class FaultJob(Launcher):
    """`nvrx launch` (or SUBCOMMAND) processes of one matrix row, with their own short TMPDIR."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        # short: Unix socket paths under it must stay below 108 bytes
        self.tmpdir = Path(tempfile.mkdtemp(prefix="nvf-", dir="/tmp"))
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.ledger = Ledger(self.out)
        self.ports: list[int] = []
        self._shm: ShmWatch | None = None

    def start(self, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        if self._shm is None:
            self._shm = ShmWatch(self.token)
        return super().start(*args, env=env, **kw)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = super().env(extra)
        env.setdefault("TMPDIR", str(self.tmpdir))
        return env

    def train(self, steps: int, fault: str = "none") -> list[str]:
        """The training script's part of the command line."""
        return [str(TRAIN), str(self.out), str(steps), fault]

    def run_dir(self, run_id: str) -> Path:
        return self.tmp_path / "nvrx_logs" / run_id

    def events(self, run_id: str, prefix: str = "agent-") -> list[dict[str, Any]]:
        return run_events(self.run_dir(run_id), prefix)

    def run_inspect(self, run_id: str, *args: str) -> subprocess.CompletedProcess:
        """`nvrx inspect` on this job's run directory (plain text unless ARGS say otherwise)."""
        cmd = [sys.executable, "-m", "nvrx", "inspect", str(self.run_dir(run_id)), *args]
        return subprocess.run(cmd, cwd=self.tmp_path, env=self.env({"COLUMNS": "200"}), capture_output=True,
                              text=True, timeout=60)

    def wait_running(self, rank: int = 0, attempt: int | None = 0, timeout: float = STARTUP_WAIT) -> int:
        """The pid of RANK once train.py runs its steps in ATTEMPT (None: in whichever attempt comes first,
        for jobs whose first round may close without every node and scale up)."""
        pattern = f"running.{rank}.{'*' if attempt is None else attempt}"
        found = lambda: next(iter(sorted(self.out.glob(pattern))), None)  # noqa: E731
        assert wait_for(lambda: found() is not None, timeout), f"rank {rank} did not start attempt {attempt}"
        path = found()
        assert wait_for(lambda: path.read_text().strip().isdigit(), 5)
        return int(path.read_text())

    def assert_clean(self) -> None:
        """Nothing of the job is left: processes, temp dirs and sockets, shared memory, listening ports."""
        left = self.leftovers(wait=15.0)
        assert left == [], f"processes left behind: {[(p.pid, p.name()) for p in left]}"
        assert wait_for(lambda: not self._tmp_left(), 5), f"left in the job's TMPDIR: {self._tmp_left()}"
        used = self._shm.stop() if self._shm is not None else set()
        left_shm = sorted(p for p in used if os.path.exists(p))
        assert not left_shm, f"shared memory left behind: {left_shm}"
        for port in self.ports:
            assert wait_for(lambda: port_in_use(port) is None, 5), f"port {port} is still held"

    def _tmp_left(self) -> list[str]:
        return sorted(p.name for p in self.tmpdir.iterdir() if not p.name.startswith(TORCH_CACHES))

    def cleanup(self) -> None:
        if self._shm is not None:
            self._shm.stop()
        super().cleanup()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture
def job(tmp_path: Path):
    fj = FaultJob(tmp_path)
    yield fj
    fj.cleanup()


def secret_file(path: Path, content: bytes = b"s3cret-for-this-job-only-0123456789", mode: int = 0o600) -> Path:
    """A job secret file (private unless MODE says otherwise)."""
    path.write_bytes(content)
    path.chmod(mode)
    return path


def two_agents(job: FaultJob, run_id: str, secret: Path, steps: int, fault: str, *extra: str
               ) -> tuple[int, subprocess.Popen, subprocess.Popen]:
    """Two agents of one job on 127.0.0.1 with a job secret: (port, the store host's process, the other's)."""
    port = free_port()
    job.ports.append(port)
    args = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--nproc-per-node", "1",
            "--term-timeout", "5", *extra, *job.train(steps, fault)]
    env = {"FAULT_STEP_TIME": "0.1", "NVRX_JOB_SECRET_FILE": str(secret)}
    host = job.start(*args, env=env)
    assert wait_for(lambda: listening(port), 60)  # hosting the store, not only started
    return port, host, job.start(*args, env=env)


def one_line(stderr: str) -> str:
    """The job's one clear line: the last non-empty stderr line. No traceback of nvrx's own anywhere (a rank's
    traceback is the training script's output, shown as torch prefixes it: ``[rank1]: Traceback ...``)."""
    ours = [ln for ln in stderr.splitlines() if "Traceback" in ln and "[rank" not in ln]
    assert not ours, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


def kill(proc: subprocess.Popen | int, sig: int = signal.SIGKILL) -> None:
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def children_named(pid: int, needle: str) -> list[psutil.Process]:
    """Live descendants of PID whose command line contains NEEDLE."""
    found = []
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for p in kids:
        try:
            if needle in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found

