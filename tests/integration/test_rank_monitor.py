"""Rank monitor end to end: a real `python -m nvrx.monitors.rank_monitor` process and real rank processes."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import tagged_processes
import pytest

ft_config = pytest.importorskip("nvrx.monitors.ft_config")

from nvrx.monitors.client import RankMonitorClient  # noqa: E402
from nvrx.events import read_events  # noqa: E402
from nvrx.monitors.timeouts import TimeoutTracker, Timeouts  # noqa: E402
from nvrx.common.files import load_json, save_json_atomic  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SLACK = 0.25  # allowed detection overshoot (s)

# A scripted rank: each argv item is one action; results go to stdout as "RESULT <json>".
RANK_SCRIPT = r'''
import json, os, signal, subprocess, sys, time
from nvrx.monitors.client import RankMonitorClient

def out(kind, value=None):
    print("RESULT " + json.dumps({"kind": kind, "value": value}), flush=True)

c = RankMonitorClient()
for action in sys.argv[1:]:
    name, _, arg = action.partition(":")
    try:
        if name == "init":
            c.init_workload_monitoring(sections=[s for s in arg.split(",") if s])
            out("init", c.timeouts)
        elif name == "hb":
            n, _, dt = (arg or "1@0").partition("@")
            for _ in range(int(n)):
                c.send_heartbeat()
                time.sleep(float(dt or 0))
        elif name == "loop":
            n, _, dt = arg.partition("@")
            for _ in range(int(n)):
                c.start_section("step"); time.sleep(float(dt)); c.end_section("step"); c.send_heartbeat()
        elif name == "sleep":
            time.sleep(float(arg))
        elif name == "start":
            c.start_section(arg)
        elif name == "end":
            c.end_section(arg)
        elif name == "calc":
            out("calc", {"updated": c.calculate_and_set_timeouts(), "timeouts": c.timeouts})
        elif name == "state":
            out("state", c.state_dict())
        elif name == "hang":
            time.sleep(60)
        elif name == "touch":
            open(arg, "w").close()
        elif name == "waitfile":
            while not os.path.exists(arg):
                time.sleep(0.02)
        elif name == "ignore_term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif name == "token_in_env":
            out("token_in_env", "NVRX_MONITOR_TOKEN" in os.environ)
        elif name == "child_init":  # a child process started the usual way inherits os.environ
            child = subprocess.run([sys.executable, "-c", "from nvrx.monitors.client import RankMonitorClient; "
                                    "RankMonitorClient().init_workload_monitoring()"],
                                   capture_output=True, text=True)
            out("child_init", {"rc": child.returncode, "err": child.stderr.strip().splitlines()[-1:]})
        elif name == "shutdown":
            c.shutdown_workload_monitoring()
        elif name == "exit":
            sys.exit(int(arg or 0))
    except ValueError as exc:
        out("ValueError", str(exc))
    except RuntimeError as exc:
        out("RuntimeError", str(exc))
        sys.exit(3)
'''

PARENT_SCRIPT = r'''
import subprocess, sys, time
proc = subprocess.Popen(sys.argv[1:])
print(proc.pid, flush=True)
time.sleep(60)
'''


class Harness:
    """One monitor per test (restartable), scripted ranks, and the files they leave."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.run_dir = tmp_path / "run"
        self.state_dir = tmp_path / "state"
        self.socket = self.run_dir / "rank0.sock"
        self.shm = self.run_dir / "rank0.slot"
        self.events_path = tmp_path / "monitor-0.jsonl"
        self.token = secrets.token_hex(16)
        self.tag = uuid.uuid4().hex
        self.script = tmp_path / "rank.py"
        self.script.write_text(RANK_SCRIPT)
        self.procs: list[subprocess.Popen] = []
        self.monitor: subprocess.Popen | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(NVRX_TEST_TOKEN=self.tag, PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                   NVRX_MONITOR_SOCKET=str(self.socket), NVRX_MONITOR_SHM=str(self.shm),
                   NVRX_MONITOR_TOKEN=self.token)
        env.update(extra)
        return env

    def monitor_cmd(self, *extra: str, **cfg: Any) -> list[str]:
        cfg.setdefault("workload_check_interval", 1.0)
        config = ft_config.FaultToleranceConfig(**cfg).to_dict()
        return [sys.executable, "-m", "nvrx.monitors.rank_monitor", "--rank", "0", "--state-dir", str(self.state_dir),
                "--socket", str(self.socket), "--shm", str(self.shm), "--config-json", json.dumps(config),
                "--events", str(self.events_path), *extra]

    def start_monitor(self, *extra: str, **cfg: Any) -> subprocess.Popen:
        proc = subprocess.Popen(self.monitor_cmd(*extra, **cfg), env=self.env(), cwd=self.tmp, stderr=subprocess.PIPE,
                                text=True)
        self.procs.append(proc)
        self.monitor = proc
        self.wait_for(self.socket.exists, 10, "monitor socket")
        return proc

    def stop_monitor(self) -> int:
        assert self.monitor is not None
        self.monitor.send_signal(signal.SIGTERM)
        return self.monitor.wait(10)

    def rank(self, *actions: str, **env: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(self.script), *actions], env=self.env(**env), cwd=self.tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen, timeout: float = 8.0) -> tuple[int, list[dict[str, Any]], str]:
        out, err = proc.communicate(timeout=timeout)
        results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        return proc.returncode, results, err

    @staticmethod
    def wait_for(pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        evs = [e for e in read_events(self.events_path) if isinstance(e, dict)]
        return [e for e in evs if name is None or e["ev"] == name]

    def last_hang(self) -> dict[str, Any]:
        """The monitor's last hang_detected event: the one record of a hang's cause."""
        hangs = self.events("hang_detected")
        assert hangs, "no hang_detected event"
        return hangs[-1]

    def cleanup(self) -> list[psutil.Process]:
        if self.monitor is not None and self.monitor.poll() is None:
            self.stop_monitor()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        deadline = time.monotonic() + 3
        left = tagged_processes(self.tag)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = tagged_processes(self.tag)
        for p in left:
            p.kill()
        return left


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    yield harness
    left = harness.cleanup()
    assert not left, f"orphaned processes: {left}"


def _assert_killed(h: Harness, proc: subprocess.Popen, reason: str, timeout: float) -> dict[str, Any]:
    rc, _, err = h.finish(proc)
    assert rc == -signal.SIGKILL, f"rank was not killed (rc={rc}):\n{err}"
    hang = h.last_hang()
    assert hang["reason"] == reason
    assert hang["timeout"] == pytest.approx(timeout)
    assert timeout <= hang["elapsed"] <= timeout + SLACK
    assert hang["pid"] == proc.pid
    detected = h.events("hang_detected")
    assert detected and detected[-1]["reason"] == reason
    # rank_terminated is written just after the signal: the rank may be gone (and reaped) before it is
    h.wait_for(lambda: h.events("rank_terminated"), 10, "the rank_terminated event")
    assert h.events("rank_terminated")[-1]["pid"] == proc.pid
    return hang


# ---------------------------------------------------------------- detection


def test_no_first_heartbeat_kills_rank(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=1.0, rank_heartbeat_timeout=1.0)
    hang = _assert_killed(h, h.rank("init", "hang"), "no_first_heartbeat", 1.0)
    assert hang["timeouts"]["initial_heartbeat"] == 1.0
    assert h.events("monitor_connect")
    assert h.monitor.poll() is None


def test_heartbeat_timeout_kills_rank(h: Harness) -> None:
    # a long check interval must not delay detection: the monitor wakes by the shortest timeout
    h.start_monitor(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=1.0, workload_check_interval=30.0)
    _assert_killed(h, h.rank("init", "hb:5@0.1", "hang"), "heartbeat_timeout", 1.0)
    assert h.events("first_heartbeat")


def test_section_timeout_kills_rank(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=5.0,
                    rank_section_timeouts={"step": 1.0})
    hang = _assert_killed(h, h.rank("init", "hb", "start:step", "hang"), "section_timeout", 1.0)
    assert hang["section"] == "step"


def test_out_of_section_timeout_kills_rank(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
                    rank_section_timeouts={"step": 5.0}, rank_out_of_section_timeout=1.0)
    _assert_killed(h, h.rank("init", "start:step", "sleep:0.2", "end:step", "hang"), "out_of_section_timeout", 1.0)


def test_long_checkpoint_section_pauses_heartbeat_timeout(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=1.0,
                    rank_section_timeouts={"checkpointing": 5.0})
    proc = h.rank("init", "hb:3@0.1", "start:checkpointing", "sleep:2", "end:checkpointing", "hb:3@0.1",
                  "shutdown", "exit:0")
    rc, _, err = h.finish(proc)
    assert rc == 0, err
    assert not h.events("hang_detected")
    h.stop_monitor()
    closes = [e for e in h.events("section_close") if e["section"] == "checkpointing"]
    assert closes and closes[0]["max_duration"] >= 2.0


# ---------------------------------------------------------------- learned timeouts


def test_computed_timeouts_persist_into_next_monitor(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None, safety_factor=5.0,
                    rank_section_timeouts={"step": None})
    rc, results, err = h.finish(h.rank("init", "loop:4@0.3", "calc", "state", "shutdown"))
    assert rc == 0, err
    calc = next(r["value"] for r in results if r["kind"] == "calc")
    assert calc["updated"]
    learned = calc["timeouts"]
    assert 1.5 <= learned["sections"]["step"] < 3.0  # observed ~0.3 s * safety_factor 5
    assert learned["initial_heartbeat"] >= 1.0 and learned["heartbeat"] >= 1.0  # floor: MIN_LEARNED_TIMEOUT
    state = next(r["value"] for r in results if r["kind"] == "state")
    assert state["nvrx_monitor_state"]["computed"]["sections"]["step"] == learned["sections"]["step"]
    assert state["current_timeouts"]["section"]["section"]["step"] == learned["sections"]["step"]  # NVRx's shape
    assert h.stop_monitor() == 0
    assert (h.state_dir / "rank0.timeouts.json").exists()

    h.start_monitor(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
                    rank_section_timeouts={"step": None})
    rc, results, err = h.finish(h.rank("init", "shutdown"))
    assert rc == 0, err
    assert results[0]["kind"] == "init" and results[0]["value"] == learned
    assert h.events("timeouts_loaded")


def test_tracker_state_roundtrip(tmp_path: Path) -> None:
    tracker = TimeoutTracker(Timeouts(heartbeat=10.0), safety_factor=2.0, min_timeout=0.1)
    assert not tracker.calculate_and_set()
    from nvrx.monitors.sections import SectionStats
    from nvrx.monitors.timeouts import HeartbeatStats
    sections = SectionStats()
    sections.observe_section("ckpt", 3.0)
    tracker.set_run_observations(HeartbeatStats(1.0, 0.5), sections)
    assert tracker.calculate_and_set()
    assert tracker.in_force() == Timeouts(2.0, 1.0, {"ckpt": 6.0}, None)
    save_json_atomic(tmp_path / "s.json", tracker.state_dict())
    other = TimeoutTracker(Timeouts(), safety_factor=2.0, min_timeout=0.1)
    other.load_state_dict(load_json(tmp_path / "s.json"))
    assert other.in_force() == tracker.in_force()
    with pytest.raises(ValueError):
        other.load_state_dict({"version": 1, "computed": {"heartbeat": -1}})


# ---------------------------------------------------------------- protocol and errors


def test_wrong_token_rejected_and_monitor_keeps_serving(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=5.0)
    rc, results, _ = h.finish(h.rank("init", "hb", NVRX_MONITOR_TOKEN="f" * 32))
    assert rc == 3
    assert results[0]["kind"] == "RuntimeError" and "invalid monitor token" in results[0]["value"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # garbage is answered, not fatal
        sock.settimeout(5)
        sock.connect(str(h.socket))
        sock.sendall(b"\x80not json\n")
        assert b'"ok":false' in sock.recv(4096)
    assert h.monitor.poll() is None
    rc, results, err = h.finish(h.rank("init", "hb:3@0.01", "shutdown", "exit:0"))
    assert rc == 0 and results[0]["kind"] == "init", err
    assert h.events("monitor_auth_failed")


def test_end_section_errors_raise_value_error_in_rank(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=5.0,
                    rank_section_timeouts={"step": 5.0})
    rc, results, err = h.finish(h.rank("init", "end:nope", "end:step", "start:step", "end:step", "start:mine",
                                       "end:mine", "hb", "shutdown", "exit:0"))
    assert rc == 0, err
    errors = [r["value"] for r in results if r["kind"] == "ValueError"]
    assert len(errors) == 2
    assert "never started" in errors[0] and "not open" in errors[1]
    assert h.monitor.poll() is None


def test_client_outside_nvrx_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NVRX_MONITOR_SOCKET", "NVRX_MONITOR_TOKEN", "NVRX_MONITOR_SHM"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="nvrx launch"):
        RankMonitorClient().init_workload_monitoring()


# ---------------------------------------------------------------- process lifecycle


def test_rank_restart_reuses_monitor_and_resets_run(h: Harness) -> None:
    mon = h.start_monitor(initial_rank_heartbeat_timeout=1.0, rank_heartbeat_timeout=1.0)
    rc, _, err = h.finish(h.rank("init", "hb:3@0.05", "exit:0"))  # exits without shutdown
    assert rc == 0, err
    second = h.rank("init", "hang")
    _assert_killed(h, second, "no_first_heartbeat", 1.0)
    assert mon.poll() is None
    assert [e["generation"] for e in h.events("monitor_connect")] == [1, 2]
    assert h.last_hang()["generation"] == 2


def test_monitor_exits_when_parent_dies(h: Harness) -> None:
    parent_script = h.tmp / "parent.py"
    parent_script.write_text(PARENT_SCRIPT)
    cmd = h.monitor_cmd(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=5.0,
                        workload_check_interval=30.0)
    parent = subprocess.Popen([sys.executable, str(parent_script), *cmd], env=h.env(), stdout=subprocess.PIPE,
                              text=True)
    h.procs.append(parent)
    monitor_pid = int(parent.stdout.readline())
    h.wait_for(h.socket.exists, 10, "monitor socket")
    monitor = psutil.Process(monitor_pid)
    parent.kill()
    parent.wait()
    monitor.wait(5)  # raises TimeoutExpired if it outlives its parent
    assert not h.socket.exists() and not h.shm.exists()
    assert h.events("monitor_exit")


def test_socket_slot_and_dirs_are_private(h: Harness) -> None:
    h.start_monitor()
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert stat.S_ISSOCK(os.stat(h.socket).st_mode)
    assert mode(h.socket) == 0o600
    assert mode(h.shm) == 0o600
    assert mode(h.run_dir) == 0o700
    assert mode(h.state_dir) == 0o700
    assert h.stop_monitor() == 0
    assert not h.socket.exists() and not h.shm.exists()


# ---------------------------------------------------------------- session token


def test_token_leaves_the_environment_and_children_cannot_attach(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=5.0)
    rc, results, err = h.finish(h.rank("init", "token_in_env", "child_init", "hb", "shutdown", "exit:0"), timeout=30)
    assert rc == 0, err
    got = {r["kind"]: r["value"] for r in results}
    assert got["token_in_env"] is False  # read once, then removed: subprocesses do not inherit it
    assert got["child_init"]["rc"] != 0 and "NVRX_MONITOR_TOKEN" in got["child_init"]["err"][0]
    assert [e["generation"] for e in h.events("monitor_connect")] == [1]  # the child never got a session


def test_live_session_cannot_be_taken_over_by_another_process(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=5.0)
    go = h.tmp / "go"
    first = h.rank("init", "touch:" + str(h.tmp / "ready"), "waitfile:" + str(go), "hb", "shutdown", "exit:0")
    h.wait_for((h.tmp / "ready").exists, 15, "first rank")
    # a process holding the token (e.g. it copied the environment before the rank removed it)
    rc, results, _ = h.finish(h.rank("init", "hb"), timeout=15)
    assert rc == 3 and results[0]["kind"] == "RuntimeError"
    assert f"already watching pid {first.pid}" in results[0]["value"] and "still running" in results[0]["value"]
    assert h.events("monitor_takeover_refused")
    go.touch()
    rc, _, err = h.finish(first)
    assert rc == 0, err  # the live rank kept its session
    assert not h.events("hang_detected")
    # once the rank process has exited, its successor (a restarted rank) attaches as usual
    rc, results, err = h.finish(h.rank("init", "hb", "shutdown", "exit:0"))
    assert rc == 0 and results[0]["kind"] == "init", err
    assert h.monitor.poll() is None


# ---------------------------------------------------------------- termination escalation


def test_rank_ignoring_sigterm_is_killed_after_the_grace(h: Harness) -> None:
    h.start_monitor("--term-grace", "1", initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=1.0,
                    rank_termination_signal="SIGTERM", workload_check_interval=0.5)
    proc = h.rank("ignore_term", "init", "hb:3@0.05", "hang")
    t0 = time.monotonic()
    rc, _, err = h.finish(proc, timeout=15)
    assert rc == -signal.SIGKILL, f"rank was not killed (rc={rc}):\n{err}"
    assert time.monotonic() - t0 < 6
    term = h.events("rank_terminated")
    assert term and term[-1]["signal"] == "SIGTERM" and term[-1]["pid"] == proc.pid
    killed = h.events("rank_killed")
    assert killed and killed[-1]["pid"] == proc.pid and killed[-1]["after"] == "SIGTERM"
    assert killed[-1]["t"] - term[-1]["t"] == pytest.approx(1.0, abs=SLACK)
    assert h.last_hang()["signal"] == "SIGTERM"
    assert h.monitor.poll() is None


# ---------------------------------------------------------------- surviving a monitor restart


def test_control_request_retries_after_the_monitor_restarts(h: Harness) -> None:
    h.start_monitor(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None)
    go = h.tmp / "go"
    proc = h.rank("init", "hb:3@0.05", "touch:" + str(h.tmp / "ready"), "waitfile:" + str(go), "hb:3@0.05",
                  "calc", "shutdown", "exit:0")
    h.wait_for((h.tmp / "ready").exists, 15, "rank")
    h.monitor.send_signal(signal.SIGKILL)  # as if it crashed; the agent would start a new one
    h.monitor.wait(5)
    h.start_monitor(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None)
    go.touch()
    rc, results, err = h.finish(proc, timeout=30)
    assert rc == 0, err
    calc = next(r for r in results if r["kind"] in ("calc", "RuntimeError", "ValueError"))
    assert calc["kind"] == "calc" and calc["value"]["updated"], results
    assert any(e.get("reattach") for e in h.events("monitor_attach"))


# ---------------------------------------------------------------- learned timeouts follow the global rank


def test_learned_timeouts_are_keyed_by_global_rank(h: Harness) -> None:
    """A continuation job may place global rank 5 on another node (other local rank, other monitor)."""
    shared = h.tmp / "shared-timeouts"
    h.start_monitor("--timeouts-dir", str(shared), initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None)
    rc, results, err = h.finish(h.rank("init", "hb:5@0.2", "calc", "shutdown", "exit:0", RANK="5"))
    assert rc == 0, err
    learned = next(r["value"] for r in results if r["kind"] == "calc")["timeouts"]
    assert learned["heartbeat"] is not None
    assert (shared / "rank5.timeouts.json").exists() and not (shared / "rank0.timeouts.json").exists()
    h.stop_monitor()

    # another node's local rank 1 now runs global rank 5 (a repeated option: argparse takes the last value)
    h.start_monitor("--timeouts-dir", str(shared), "--rank", "1", "--state-dir", str(h.tmp / "other-node-state"),
                    initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None)
    rc, results, err = h.finish(h.rank("init", "shutdown", "exit:0", RANK="5"))
    assert rc == 0, err
    assert results[0]["kind"] == "init" and results[0]["value"]["heartbeat"] == learned["heartbeat"]
    loaded = h.events("timeouts_loaded")
    assert loaded and loaded[-1]["global_rank"] == 5
    # a different global rank does not inherit rank 5's learning
    rc, results, err = h.finish(h.rank("init", "shutdown", "exit:0", RANK="6"))
    assert rc == 0, err
    assert results[0]["value"]["heartbeat"] is None
