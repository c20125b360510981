"""Run a job of `python workload.py` ranks with the torchrun environment and collect what they recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import REPO, free_port, tagged_processes, wait_for

WORKLOAD = Path(__file__).with_name("workload.py")


@dataclass
class JobResult:
    codes: dict[int, int]
    stderr: dict[int, str]
    events: dict[int, list[dict[str, Any]]]
    leftovers: list[Any] = field(default_factory=list)
    out: Path | None = None

    def of(self, rank: int, event: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events.get(rank, []) if e["event"] == event
                and all(e.get(k) == v for k, v in match.items())]

    def starts(self, rank: int) -> dict[int, dict[str, Any]]:
        """Iteration -> the 'start' event of RANK (initial numbering)."""
        return {e["iteration"]: e for e in self.of(rank, "start")}

    def pids(self, rank: int) -> set[int]:
        return {e["pid"] for e in self.events.get(rank, [])}


def run_job(tmp_path: Path, world: int, plan: dict[str, Any], timeout: float = 90.0,
            script: Path = WORKLOAD, agent_store: bool = False) -> JobResult:
    """Start WORLD ranks of SCRIPT, wait for all of them (killing everything after TIMEOUT), check for leftovers.

    SCRIPT reads its plan from $NVRX_TEST_PLAN and appends JSON lines with an "event" key to
    $NVRX_TEST_OUT/rank<RANK>.jsonl. AGENT_STORE: this process hosts the store at MASTER_ADDR:MASTER_PORT
    (a real TCPStore on loopback) and the ranks are told so (TORCHELASTIC_USE_AGENT_STORE=True), as under
    ``nvrx launch``; otherwise rank 0 hosts the Wrapper's store."""
    out = tmp_path / "out"
    out.mkdir()
    token = uuid.uuid4().hex
    agent, port = _host_store() if agent_store else (None, free_port())  # agent: serves until we return
    procs = {}
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NVRX_TEST_PLAN=json.dumps(plan),
                   NVRX_TEST_OUT=str(out), NVRX_TEST_TOKEN=token, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        if agent_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        procs[rank] = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                                       stderr=open(out / f"stderr{rank}", "w"), cwd=tmp_path)
    deadline = time.monotonic() + timeout
    try:
        for rank, proc in procs.items():
            proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in tagged_processes(token):
            p.send_signal(signal.SIGKILL)
        raise AssertionError(f"the job did not finish in {timeout:g} s; stderr:\n" +
                             "\n".join((out / f"stderr{r}").read_text()[-3000:] for r in procs))
    leftovers = _leftovers(token)
    events = {}
    for rank in procs:
        path = out / f"rank{rank}.jsonl"
        events[rank] = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return JobResult({r: p.returncode for r, p in procs.items()},
                     {r: (out / f"stderr{r}").read_text() for r in procs}, events, leftovers, out)


def _host_store() -> tuple[Any, int]:
    """A TCPStore server on 127.0.0.1 (a fresh port) in this process: the agent's store; (server, port)."""
    from nvrx.common.net import start_store_server

    return start_store_server("127.0.0.1")


def _leftovers(token: str, wait: float = 5.0) -> list[Any]:
    """Processes of this job still alive after WAIT seconds (killed, and returned for the test to report)."""
    if wait_for(lambda: not tagged_processes(token), wait, interval=0.1):
        return []
    left = tagged_processes(token)
    for p in left:
        p.kill()
    return left
