"""WorkerGroup with real processes: forked from the template and plain-spawned ranks."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from nvrx.launcher.agent.config import Std, WorkerSettings
from nvrx.launcher.agent.worker_group import RankExit, RankSpec, WorkerGroup
from nvrx.events import EventLog

RANK_SCRIPT = textwrap.dedent(
    """
    import os, pickle, signal, subprocess, sys, time

    class Payload:
        pass

    def fail():
        raise ValueError("boom from rank " + os.environ["RANK"])

    def mark_ready():
        open(os.path.join(os.environ["READY_DIR"], "ready-" + os.environ["RANK"]), "w").close()

    def allreduce():
        from datetime import timedelta
        import torch
        import torch.distributed as dist
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        print(f"sum={value.item()}")
        dist.destroy_process_group()

    def main():
        mode = os.environ.get("MODE", "exit")
        print(f"start rank={os.environ['RANK']} name={__name__} argv={sys.argv[1:]}")
        if mode == "env":
            print("FOO=" + os.environ.get("FOO", "<unset>"))
            print("injected=" + str(any(k.startswith("NVRX_BOOTSTRAP") for k in os.environ)))
            print("path0=" + sys.path[0])
            print("pickle=" + type(pickle.loads(pickle.dumps(Payload()))).__module__)
        elif mode == "exit":
            print("last words", file=sys.stderr)
            sys.exit(int(os.environ["CODE"]))
        elif mode == "raise":
            fail()
        elif mode == "interrupt":
            raise KeyboardInterrupt
        elif mode == "segv":
            print("about to crash", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        elif mode == "sleep":
            mark_ready()
            time.sleep(60)
        elif mode == "ignore_term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            mark_ready()
            time.sleep(60)
        elif mode == "grandchild":
            sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
            kids = [subprocess.Popen(sleeper), subprocess.Popen(sleeper, start_new_session=True)]
            with open(os.path.join(os.environ["READY_DIR"], "kids"), "w") as fh:
                fh.write(" ".join(str(k.pid) for k in kids))
            mark_ready()
            time.sleep(60)
        elif mode == "orphan":  # leaves a child that keeps our stdout open
            kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            with open(os.path.join(os.environ["READY_DIR"], "kids"), "w") as fh:
                fh.write(str(kid.pid))
            print("parent done", flush=True)
            os._exit(0)
        elif mode == "output":
            print(f"out line {os.environ['RANK']}")
            print(f"err line {os.environ['RANK']}", file=sys.stderr)
            sys.stdout.flush()
            sys.stdout.buffer.write(b"bad \\xff bytes\\n")
            sys.stdout.buffer.write(b"no newline at the end")
        elif mode == "allreduce":
            allreduce()

    if __name__ == "__main__":
        main()
    """
)

_attempts = itertools.count()


# ---------------------------------------------------------------- helpers


def _settings(script: Path, fork: bool, **overrides: Any) -> WorkerSettings:
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    base.pop("PYTHONPATH", None)
    values: dict[str, Any] = dict(entrypoint=str(script), args=("--flag", "x y"), nproc_per_node=2, fork_server=fork, base_env=base)
    values.update(overrides)
    return WorkerSettings(**values)


class Harness:
    """A WorkerGroup plus the events it emitted and the directory ranks signal readiness in."""

    def __init__(self, settings: WorkerSettings, root: Path, **group_kwargs: Any) -> None:
        self.settings = settings
        self.events: list[dict[str, Any]] = []
        log = EventLog(None, "test")
        log.subscribe(self.events.append)
        self.root = root
        self.ready_dir = self._new_ready_dir()
        self.group = WorkerGroup(settings, log, root / "logs", **group_kwargs)
        self.group.prepare()

    def _new_ready_dir(self) -> Path:
        path = self.root / f"ready-{next(_attempts)}"
        path.mkdir(parents=True)
        return path

    def specs(self, modes: list[dict[str, str]], world: int | None = None) -> list[RankSpec]:
        world = world or len(modes)
        out = []
        for i, extra in enumerate(modes):
            env = {**self.settings.base_env, "RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": str(world), "READY_DIR": str(self.ready_dir)}
            out.append(RankSpec(local_rank=i, global_rank=i, env={**env, **extra}))
        return out

    def start(self, modes: list[dict[str, str]]) -> int:
        attempt = next(_attempts)
        self.ready_dir = self._new_ready_dir()
        self.group.start(self.specs(modes), attempt)
        return attempt

    def collect(self, n: int, timeout: float = 30.0) -> dict[int, RankExit]:
        exits: dict[int, RankExit] = {}
        deadline = time.monotonic() + timeout
        while len(exits) < n and time.monotonic() < deadline:
            for ex in self.group.wait(timeout=deadline - time.monotonic()):
                exits[ex.local_rank] = ex
        assert len(exits) == n, f"only {sorted(exits)} exited"
        return exits

    def wait_ready(self, ranks: list[int], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.ready_dir / f"ready-{r}").exists() for r in ranks):
            assert time.monotonic() < deadline, "ranks did not become ready"
            time.sleep(0.02)

    def pids(self, attempt: int) -> dict[int, int]:
        return {e["local_rank"]: e["pid"] for e in self.events if e["ev"] == "rank_start" and e["attempt"] == attempt}

    def hows(self, attempt: int) -> set[str]:
        return {e["how"] for e in self.events if e["ev"] == "rank_start" and e["attempt"] == attempt}


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scripts") / "rank.py"
    path.write_text(RANK_SCRIPT)
    return path


@pytest.fixture(scope="module", params=["fork", "spawn"])
def harness(request: pytest.FixtureRequest, script: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """One group per mode shared by the tests (one fork server start for all of them)."""
    h = Harness(_settings(script, request.param == "fork"), tmp_path_factory.mktemp(request.param))
    yield h
    h.group.close()


@pytest.fixture
def fork_harness(script: Path, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(_settings(script, True), tmp_path)
    yield h
    h.group.close()


def _mode(harness: Harness) -> str:
    return "fork" if harness.settings.fork_server else "spawn"


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """Dead (or a zombie nobody reaped yet) within TIMEOUT."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- tests


def test_rank_sees_its_env_name_and_argv(harness: Harness, script: Path) -> None:
    attempt = harness.start([{"MODE": "env", "FOO": "bar-0"}, {"MODE": "env", "FOO": "bar-1"}])
    exits = harness.collect(2)
    assert harness.hows(attempt) == {_mode(harness)}
    for lr, ex in exits.items():
        assert ex.exitcode == 0 and not ex.failed, ex
        assert f"start rank={lr} name=__main__ argv=['--flag', 'x y']" in ex.tail
        assert f"FOO=bar-{lr}" in ex.tail
        assert "injected=False" in ex.tail  # the launcher's own plumbing is invisible
        assert f"path0={script.parent}" in ex.tail
        assert "pickle=__main__" in ex.tail


def test_exit_codes_exceptions_and_signals(harness: Harness, script: Path) -> None:
    harness.start(
        [
            {"MODE": "exit", "CODE": "0"},
            {"MODE": "exit", "CODE": "3"},
            {"MODE": "raise"},
            {"MODE": "segv"},
            {"MODE": "interrupt"},
        ]
    )
    exits = harness.collect(5)
    assert (exits[0].exitcode, exits[0].signal, exits[0].failed) == (0, None, False)
    assert (exits[1].exitcode, exits[1].signal) == (3, None)
    assert exits[1].tail[-1] == "last words"
    assert exits[1].describe() == "rank 1 (local 1) exited with code 3"

    raised = exits[2]
    assert raised.exitcode == 1
    tb = list(raised.tail)
    start = tb.index("Traceback (most recent call last):")
    assert tb[start + 1].startswith(f'  File "{script}", line ')
    assert tb[start + 1].endswith(", in <module>")
    assert tb[-1] == "ValueError: boom from rank 2"
    assert not any("launcher" in line or "runpy" in line for line in tb), tb

    assert (exits[3].exitcode, exits[3].signal) == (None, "SIGSEGV")
    assert "about to crash" in exits[3].tail
    assert exits[3].describe() == "rank 3 (local 3) was killed by SIGSEGV"

    assert (exits[4].exitcode, exits[4].signal) == (None, "SIGINT")  # like python: dies by SIGINT
    assert exits[4].tail[-1] == "KeyboardInterrupt"


def test_wait_returns_promptly_when_one_rank_dies(harness: Harness) -> None:
    attempt = harness.start([{"MODE": "sleep"}, {"MODE": "sleep"}])
    harness.wait_ready([0, 1])
    assert harness.group.wait(timeout=0.05) == []  # timeout, nothing exited
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        assert harness.group.wait(wake_fds=[r], timeout=5) == []  # woken by the caller's fd
    finally:
        os.close(r)
        os.close(w)
    os.kill(harness.pids(attempt)[0], signal.SIGKILL)
    exits = harness.group.wait(timeout=10)
    assert [(e.local_rank, e.signal) for e in exits] == [(0, "SIGKILL")]
    assert harness.group.alive() == [1]
    rest = harness.group.stop(grace=5)
    assert [(e.local_rank, e.signal) for e in rest] == [(1, "SIGTERM")]
    assert harness.group.alive() == []


def test_stop_kills_a_rank_that_ignores_sigterm(harness: Harness) -> None:
    harness.start([{"MODE": "ignore_term"}, {"MODE": "sleep"}])
    harness.wait_ready([0, 1])
    began = time.monotonic()
    exits = {e.local_rank: e for e in harness.group.stop(grace=0.5)}
    elapsed = time.monotonic() - began
    assert exits[0].signal == "SIGKILL" and exits[0].failed
    assert exits[1].signal == "SIGTERM"
    assert elapsed >= 0.5, elapsed  # SIGKILL only after the grace (load can only make this longer)
    assert harness.group.stop() == []  # nothing live any more


def test_signal_all_forwards_with_python_default_handlers(harness: Harness) -> None:
    harness.start([{"MODE": "sleep"}, {"MODE": "sleep"}])
    harness.wait_ready([0, 1])
    harness.group.signal_all(signal.SIGINT)  # the fork server ignores SIGINT; its ranks must not
    # the default bound: a fork server sends exit statuses between warm-up steps, and each step takes
    # several seconds on a loaded machine (the flake hunt at load 12 saw nothing within 10 s)
    exits = harness.collect(2)
    for ex in exits.values():
        assert ex.signal == "SIGINT" and ex.tail[-1] == "KeyboardInterrupt", ex


def test_gloo_all_reduce_from_forked_ranks(fork_harness: Harness) -> None:
    port = str(_free_port())
    common = {"MODE": "allreduce", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    attempt = fork_harness.start([common, common])
    exits = fork_harness.collect(2, timeout=40)
    assert fork_harness.hows(attempt) == {"fork"}
    for ex in exits.values():
        assert ex.exitcode == 0, ex.tail
        assert "sum=3.0" in ex.tail


def test_gloo_all_reduce_from_spawned_ranks(script: Path, tmp_path: Path) -> None:
    h = Harness(_settings(script, False), tmp_path)
    try:
        common = {"MODE": "allreduce", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        h.start([common, common])
        assert all(ex.exitcode == 0 and "sum=3.0" in ex.tail for ex in h.collect(2, timeout=60).values())
    finally:
        h.group.close()


def test_module_entrypoint_with_its_own_pythonpath(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import os, sys\nprint('argv0=' + sys.argv[0])\nprint('name=' + __name__)\nsys.exit(7)\n")
    settings = _settings(Path("mypkg.train"), True, module=True, args=("a",))
    h = Harness(settings, tmp_path)
    try:
        # the template was started without this PYTHONPATH: the forked rank must still find the module
        h.group.start([RankSpec(0, 0, {**settings.base_env, "PYTHONPATH": str(tmp_path / "src")})], next(_attempts))
        ex = h.collect(1)[0]
        assert ex.exitcode == 7, ex.tail
        assert f"argv0={pkg / 'train.py'}" in ex.tail and "name=__main__" in ex.tail
    finally:
        h.group.close()


def test_redirects_tee_and_filter(script: Path, tmp_path: Path) -> None:
    console_out, console_err = tmp_path / "console.out", tmp_path / "console.err"
    settings = _settings(
        script,
        False,
        nproc_per_node=3,
        redirects={0: Std.ALL},
        tee={1: Std.ALL},
        local_ranks_filter=frozenset({0, 1}),
    )
    with open(console_out, "wb") as out, open(console_err, "wb") as err:
        h = Harness(settings, tmp_path, console_out=out, console_err=err)
        try:
            attempt = h.start([{"MODE": "output"}] * 3)
            exits = h.collect(3)
        finally:
            h.group.close()
    shown_out, shown_err = console_out.read_text(errors="replace"), console_err.read_text(errors="replace")
    logs = tmp_path / "logs" / f"attempt_{attempt}"

    assert "out line 0" in (logs / "0" / "stdout.log").read_text(errors="replace")  # redirected: file only
    assert "err line 0" in (logs / "0" / "stderr.log").read_text(errors="replace")
    assert "out line 0" not in shown_out and "err line 0" not in shown_err

    assert "out line 1" in (logs / "1" / "stdout.log").read_text(errors="replace")  # tee: file and prefixed console
    assert "[1]:out line 1\n" in shown_out
    assert "[1]:err line 1\n" in shown_err
    assert "[1]:no newline at the end\n" in shown_out  # partial last line shown, terminated

    assert not (logs / "2").exists()  # not redirected: console only, but filtered out
    assert "out line 2" not in shown_out and "err line 2" not in shown_err

    for lr, ex in exits.items():  # the tail has everything regardless of where output went
        assert ex.exitcode == 0
        assert f"out line {lr}" in ex.tail and f"err line {lr}" in ex.tail
        assert "bad \ufffd bytes" in ex.tail
        assert "no newline at the end" in ex.tail  # a partial last line still counts


def test_default_console_output_is_unprefixed(script: Path, tmp_path: Path) -> None:
    console_out = tmp_path / "console.out"
    with open(console_out, "wb") as out, open(os.devnull, "wb") as err:
        h = Harness(_settings(script, False, nproc_per_node=1), tmp_path, console_out=out, console_err=err)
        try:
            h.start([{"MODE": "output"}])
            h.collect(1)
        finally:
            h.group.close()
    assert console_out.read_bytes().startswith(b"start rank=0")
    assert b"out line 0\n" in console_out.read_bytes()


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "spawn"])
def test_close_leaves_no_descendants(script: Path, tmp_path: Path, fork: bool) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. other fixtures' groups
    h = Harness(_settings(script, fork), tmp_path)
    h.start([{"MODE": "grandchild"}, {"MODE": "sleep"}])
    h.wait_ready([0, 1])
    h.group.close()
    h.group.close()  # idempotent
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []
    for pid in map(int, (h.ready_dir / "kids").read_text().split()):  # including the one in its own session
        assert _gone(pid)
    rank_exits = [e for e in h.events if e["ev"] == "rank_exit"]
    assert len(rank_exits) == 2


def test_killing_the_fork_server_reports_exits_then_falls_back(fork_harness: Harness) -> None:
    h = fork_harness
    first = h.start([{"MODE": "sleep"}, {"MODE": "sleep"}])
    h.wait_ready([0, 1])
    assert h.hows(first) == {"fork"}
    servers = [p for p in psutil.Process().children() if "nvrx.launcher.agent.fork_server" in " ".join(p.cmdline())]
    assert len(servers) == 1
    servers[0].kill()
    exits = h.collect(2, timeout=15)
    assert all(ex.failed and ex.signal == "SIGKILL" for ex in exits.values()), exits
    fallbacks = [e for e in h.events if e["ev"] == "fork_server_fallback"]
    assert len(fallbacks) == 1 and "fork server" in fallbacks[0]["reason"]
    for pid in h.pids(first).values():
        assert _gone(pid)

    second = h.start([{"MODE": "exit", "CODE": "0"}, {"MODE": "exit", "CODE": "4"}])
    exits = h.collect(2)
    assert h.hows(second) == {"spawn"}
    assert (exits[0].exitcode, exits[1].exitcode) == (0, 4)


def test_entrypoint_that_cannot_start_is_reported(tmp_path: Path) -> None:
    settings = _settings(Path("/nonexistent/binary"), False, no_python=True, args=())
    h = Harness(settings, tmp_path)
    try:
        h.start([{}])
        ex = h.collect(1)[0]
        assert ex.exitcode == 127 and "could not start" in ex.tail[-1]
    finally:
        h.group.close()


def test_rank_surviving_sigkill_is_reported_stuck_and_abandoned(script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nvrx.launcher.agent.worker_group as worker_group

    real_killpg = worker_group._killpg
    monkeypatch.setattr(worker_group, "_killpg", lambda pgid, sig: None if sig == signal.SIGKILL else real_killpg(pgid, sig))
    h = Harness(_settings(script, False, kill_timeout=0.3), tmp_path)
    try:
        attempt = h.start([{"MODE": "ignore_term"}])
        h.wait_ready([0])
        (ex,) = h.group.stop(grace=0.2)  # returns although the rank never dies
        assert ex.abandoned and ex.failed and ex.exitcode is None
        assert ex.describe() == "rank 0 (local 0) stuck (state S) and abandoned"
        stuck = [e for e in h.events if e["ev"] == "rank_stuck"]
        assert len(stuck) == 1 and stuck[0]["state"] == "S" and stuck[0]["status"] == "sleeping"
    finally:
        monkeypatch.undo()
        h.group.close()  # the real SIGKILL now reaches it
    assert h.pids(attempt)[0] not in {p.pid for p in psutil.Process().children(recursive=True)}


def test_rank_with_different_import_time_env_is_spawned(script: Path, tmp_path: Path) -> None:
    h = Harness(_settings(script, True), tmp_path)
    try:
        attempt = h.start([{"MODE": "env", "OMP_NUM_THREADS": "2"}])  # libgomp reads it when torch loads
        assert h.collect(1)[0].exitcode == 0
        assert h.hows(attempt) == {"spawn"}
        assert not [e for e in h.events if e["ev"] == "fork_server_fallback"]
    finally:
        h.group.close()


def test_exit_is_reported_although_a_grandchild_holds_the_pipes(script: Path, tmp_path: Path) -> None:
    h = Harness(_settings(script, False), tmp_path)
    try:
        h.start([{"MODE": "orphan"}])
        (ex,) = h.group.wait(timeout=10)  # the grandchild sleeps 60 s: waiting for its pipes would time out
        kid = psutil.Process(int((h.ready_dir / "kids").read_text()))
        assert kid.status() != psutil.STATUS_ZOMBIE  # reported while it still holds them
        assert ex.exitcode == 0 and "parent done" in ex.tail
        assert h.group.stop() == []
        assert _gone(int((h.ready_dir / "kids").read_text()))  # killed with the rank's process group
    finally:
        h.group.close()


def test_fork_server_that_cannot_import_torch_falls_back_to_spawn(script: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    settings = _settings(script, True)
    settings = _settings(script, True, base_env={**settings.base_env, "PYTHONPATH": str(broken)})
    h = Harness(settings, tmp_path)
    try:
        attempt = h.start([{"MODE": "exit", "CODE": "0"}])
        assert h.collect(1)[0].exitcode == 0
        assert h.hows(attempt) == {"spawn"}
        (fallback,) = [e for e in h.events if e["ev"] == "fork_server_fallback"]
        assert "no torch here" in fallback["reason"]
    finally:
        h.group.close()
