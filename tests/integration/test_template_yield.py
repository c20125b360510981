"""A spawn request that arrives while the template warms up waits for one warm-up step, not for all of them, and
the rank forked in between sees a plain interpreter's torch with the steps done so far, none half-done: no thread
in the template, the RNG freshly seeded and untouched, torch's thread settings, CUDA not initialised, and
torch._dynamo / an optimizer importable as usual. The template resumes its warm-up afterwards.

The fork server is driven through its real socket protocol; the test stops it (SIGSTOP) in the middle of a
step, sends the request, and lets it go on: the server must fork right after the step it was in."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvrx.launcher.agent import fork_server
from nvrx.common.process import python_module_command
from tests.conftest import pid_gone, wait_for, write_script

RANK = r'''
import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
parent = os.getppid()

def comm(pid):
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()

info = {"template_comm": comm(parent)}
if mode == "report":
    info["modules"] = sorted(m for m in sys.modules if m.startswith(("torch", "sympy", "mpmath")))
    info["template_threads"] = len(os.listdir(f"/proc/{parent}/task"))
    import torch
    info["untouched"] = torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(torch.initial_seed()).get_state())
    info["initial_seed"] = torch.initial_seed()
    info["num_threads"] = [torch.get_num_threads(), torch.get_num_interop_threads()]
    info["cuda_initialized"] = torch.cuda.is_initialized()
    import torch._dynamo
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    opt.param_groups[0]["params"][0].sum().backward()
    opt.step()
    info["optimizer_ok"] = True
with open(out + ".tmp", "w") as fh:
    json.dump(info, fh)
os.rename(out + ".tmp", out)
release = os.path.join(os.path.dirname(out), "release")
deadline = time.monotonic() + 120
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.02)
'''

ENV = {"OMP_NUM_THREADS": "1"}


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()


class _Template:
    """One fork server process and our end of its socket."""

    def __init__(self, env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = python_module_command(sys.executable, "nvrx.launcher.agent.fork_server", "--fd", str(theirs.fileno()),
                                    "--parent", str(os.getpid()))
        self.proc = subprocess.Popen(cmd, env=dict(env), pass_fds=(theirs.fileno(),), process_group=0)
        theirs.close()
        self.sock.settimeout(120)
        self.env = env
        self.exits: list[dict] = []

    def receive(self, op: str) -> tuple[dict, list[int]]:
        while True:
            msg, fds = fork_server.recv_msg(self.sock, 1)
            assert msg is not None, "the fork server closed its socket"
            if msg["op"] == op:
                return msg, fds
            fork_server.close_fds(fds)
            assert msg["op"] == "exit", msg
            self.exits.append(msg)

    def collect_exits(self, count: int) -> None:
        while len(self.exits) < count:
            msg, fds = fork_server.recv_msg(self.sock, 1)
            fork_server.close_fds(fds)
            assert msg is not None and msg["op"] == "exit", msg
            self.exits.append(msg)

    def spawn(self, rid: int, script: Path, args: list[str], log: Path) -> None:
        with open(log, "wb") as out:
            fork_server.send_msg(self.sock, {"op": "spawn", "id": rid, "entry": str(script), "args": args, "module": False,
                                             "env": self.env}, [out.fileno(), out.fileno()])

    def spawned(self, rid: int) -> int:
        msg, fds = self.receive("spawned")
        fork_server.close_fds(fds)
        assert msg["id"] == rid
        return int(msg["pid"])

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def mid_warm_up(tmp_path_factory) -> dict:
    """Rank A runs (so the template warms up); rank B is asked for while the template is stopped inside a step."""
    tmp = tmp_path_factory.mktemp("yield")
    script = write_script(tmp / "rank.py", RANK)
    env = {**os.environ, **ENV}
    tmpl = _Template(env)
    try:
        ready, _ = tmpl.receive("ready")
        assert ready["op"] == "ready"
        tmpl.spawn(1, script, [str(tmp / "a.json"), "hold"], tmp / "a.log")
        a_pid = tmpl.spawned(1)
        assert wait_for(lambda: _comm(tmpl.proc.pid).startswith(fork_server.WARMING_NAME), 120, interval=0.001), \
            "the template never started warming up"
        os.kill(tmpl.proc.pid, signal.SIGSTOP)
        try:
            stopped_in = _comm(tmpl.proc.pid)
            tmpl.spawn(2, script, [str(tmp / "b.json"), "report"], tmp / "b.log")
        finally:
            os.kill(tmpl.proc.pid, signal.SIGCONT)
        b_pid = tmpl.spawned(2)
        assert wait_for((tmp / "b.json").exists, 120), (tmp / "b.log").read_text()[-3000:]
        resumed = wait_for(lambda: _comm(tmpl.proc.pid) == fork_server.WARM_NAME, 120)
        (tmp / "release").touch()
        tmpl.collect_exits(2)
    finally:
        (tmp / "release").touch()
        tmpl.close()
    assert wait_for(lambda: pid_gone(a_pid) and pid_gone(b_pid), 30)
    plain = subprocess.run([sys.executable, "-c", "import json, torch; print(json.dumps([torch.get_num_threads(), "
                            "torch.get_num_interop_threads()]))"], env=env, capture_output=True, text=True, timeout=120)
    return {"stopped_in": stopped_in, "b": json.loads((tmp / "b.json").read_text()), "resumed": resumed,
            "exits": tmpl.exits, "plain_threads": json.loads(plain.stdout), "a_pid": a_pid}


def test_the_request_is_served_right_after_the_step_in_progress(mid_warm_up) -> None:
    stopped_in = mid_warm_up["stopped_in"]
    assert stopped_in.startswith(fork_server.WARMING_NAME), f"stopped too late to test (template was {stopped_in!r})"
    assert mid_warm_up["b"]["template_comm"] == stopped_in  # forked between that step and the next one


def test_the_rank_has_the_steps_done_so_far_and_no_later_one(mid_warm_up) -> None:
    step = int(mid_warm_up["stopped_in"][len(fork_server.WARMING_NAME):])
    names = [s for s in fork_server.WARM_UP_STEPS if isinstance(s, str)]
    done = [s for s in fork_server.WARM_UP_STEPS[:step + 1] if isinstance(s, str) and s.startswith(("torch", "sympy", "mpmath"))]
    modules = set(mid_warm_up["b"]["modules"])
    assert set(done) <= modules
    if step < fork_server.WARM_UP_STEPS.index("torch._dynamo"):
        assert "torch._dynamo" not in modules
    assert names  # (the step list is not empty)


def test_the_rank_forked_mid_warm_up_sees_a_plain_interpreter(mid_warm_up) -> None:
    b = mid_warm_up["b"]
    assert b["template_threads"] == 1
    assert b["untouched"]
    assert b["num_threads"] == mid_warm_up["plain_threads"]
    assert b["cuda_initialized"] is False
    assert b["optimizer_ok"]  # torch._dynamo and the optimizer import and work: nothing half-imported


def test_the_template_resumes_its_warm_up_and_the_ranks_end_normally(mid_warm_up) -> None:
    assert mid_warm_up["resumed"]
    assert sorted(e["exitcode"] for e in mid_warm_up["exits"]) == [0, 0]


def test_a_failing_step_ends_the_warm_up_and_names_the_step() -> None:
    def broken() -> None:
        raise RuntimeError("no")

    steps = fork_server.WarmUp(["json", broken, "this_module_does_not_exist_anywhere", "csv"])
    steps.step()
    assert (steps.position, steps.failed, steps.done) == (1, None, False)
    steps.step()
    assert steps.done and steps.failed == "broken"


def test_a_missing_optional_module_is_skipped() -> None:
    steps = fork_server.WarmUp(["this_module_does_not_exist_anywhere", "json"])
    steps.run_all()
    assert steps.done and steps.failed is None


def test_after_a_rank_exit_the_warm_up_waits_for_the_respawn(tmp_path: Path) -> None:
    """A rank's exit means a respawn is likely: the template takes no further step until the next request comes,
    so that request finds it idle. (The pause before the request gives a template that went on the time to.)"""
    script = write_script(tmp_path / "rank.py", RANK)
    tmpl = _Template({**os.environ, **ENV})
    try:
        tmpl.receive("ready")
        tmpl.spawn(1, script, [str(tmp_path / "a.json"), "hold"], tmp_path / "a.log")
        tmpl.spawned(1)
        tmpl.spawn(2, script, [str(tmp_path / "b.json"), "hold"], tmp_path / "b.log")
        b_pid = tmpl.spawned(2)
        assert wait_for(lambda: _comm(tmpl.proc.pid).startswith(fork_server.WARMING_NAME), 120, interval=0.001)
        os.kill(tmpl.proc.pid, signal.SIGSTOP)
        try:
            os.kill(b_pid, signal.SIGKILL)
            assert wait_for(lambda: _zombie_or_gone(b_pid), 30)
        finally:
            os.kill(tmpl.proc.pid, signal.SIGCONT)
        tmpl.collect_exits(1)
        paused_at = _comm(tmpl.proc.pid)
        time.sleep(1.0)
        tmpl.spawn(3, script, [str(tmp_path / "c.json"), "report"], tmp_path / "c.log")
        tmpl.spawned(3)
        assert wait_for((tmp_path / "c.json").exists, 120), (tmp_path / "c.log").read_text()[-3000:]
        c = json.loads((tmp_path / "c.json").read_text())
    finally:
        (tmp_path / "release").touch()
        tmpl.close()
    assert paused_at.startswith(fork_server.WARMING_NAME), f"stopped too late to test (template was {paused_at!r})"
    assert c["template_comm"] == paused_at  # no step between the exit and the next request
    step = int(paused_at[len(fork_server.WARMING_NAME):])
    if step < fork_server.WARM_UP_STEPS.index("torch._dynamo"):
        assert "torch._dynamo" not in c["modules"]
    assert c["optimizer_ok"] and c["template_threads"] == 1


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_template_never_asked_warms_up_for_its_first_ranks(tmp_path: Path) -> None:
    """A standby's (or a long rendezvous') template has no ranks to warm up beside; it warms up anyway, all but
    the step that compiles the entry, so its first ranks are forked warm (bench_nodeloss: cold ones cost 4-8 s)."""
    script = write_script(tmp_path / "rank.py", RANK)
    tmpl = _Template({**os.environ, **ENV})
    last = f"{fork_server.WARMING_NAME}{len(fork_server.WARM_UP_STEPS) - 1}"
    try:
        tmpl.receive("ready")
        assert wait_for(lambda: _comm(tmpl.proc.pid) == last, 120, interval=0.01), \
            f"a template never asked did not warm up (it is {_comm(tmpl.proc.pid)!r})"
        tmpl.spawn(1, script, [str(tmp_path / "a.json"), "report"], tmp_path / "a.log")
        tmpl.spawned(1)
        assert wait_for((tmp_path / "a.json").exists, 120), (tmp_path / "a.log").read_text()[-3000:]
        a = json.loads((tmp_path / "a.json").read_text())
        (tmp_path / "release").touch()
        tmpl.collect_exits(1)
    finally:
        (tmp_path / "release").touch()
        tmpl.close()
    assert a["template_comm"] == last
    assert "torch._dynamo" in a["modules"] and "torch.distributed.checkpoint" in a["modules"]
    assert a["optimizer_ok"] and a["template_threads"] == 1 and a["untouched"]
