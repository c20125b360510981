#!/usr/bin/env python3
"""How the rendezvous grows with the number of agents: N simulated agents against one real store.

Each simulated agent is the real ``nvrx.launcher.agent.rendezvous.Rendezvous`` (no ranks): the main process
hosts the store and runs agent 0 as a full agent; worker processes run the others, each with one connection,
a thread for its blocking rendezvous calls and its keepalive on the process's one shared keepalive thread
(SimAgent says why). Per N it measures:

- ``close``: "go" -> every agent has returned from ``next_round()`` (round 0 closes at N = MAX nodes);
- ``failure``: agent 0 writes a ``failed`` stop record -> every agent's ``wait_stop()`` has returned;
- ``restart``: that stop -> every agent is in round 1;
- ``dead_node``: one agent's keepalive stops -> every agent saw the ``node_left`` stop record
  (bounded below by ``keepalive_timeout``; the rest is what detection and broadcast add);
- the store host's requests per second while all agents wait for a stop (from its CPU time and a probe
  of request latency), and its resident memory.

Every agent signs its control records with the job secret (issue 19), read from a 0600 file in the run's
private temp dir, as `nvrx launch` reads NVRX_JOB_SECRET_FILE. Each run checks that all agents agree on
both rounds' membership and hold distinct group ranks 0..N-1 (``consistent``).

Usage:
    python bench/bench_rendezvous.py                       # N = 16, 64, 256
    python bench/bench_rendezvous.py --agents 16,64,256,1024 --procs 8
Writes bench/results/rendezvous.json and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nvrx.launcher.agent.config import RdzvSettings  # noqa: E402
from nvrx.launcher.agent.rdzv_auth import generate_secret, load_secret  # noqa: E402
from nvrx.launcher.agent.rendezvous import KeepaliveTask, Rendezvous  # noqa: E402
from nvrx.launcher.agent.rdzv_errors import RendezvousError  # noqa: E402
from nvrx.launcher.agent.rdzv_records import RoundResult, StopKind  # noqa: E402
from nvrx.launcher.agent.restart_policy import RestartPolicy  # noqa: E402
from nvrx.events import StopDetail  # noqa: E402
from nvrx.launcher.agent.store import _join, open_rendezvous_store  # noqa: E402
from nvrx.events import EventLog  # noqa: E402

# torch's TCPStore looks up the peer's name of every new connection (client and server side; a loopback
# connection is ::ffff:127.0.0.1, which /etc/hosts does not name, so the query goes to DNS). This VM's resolver
# drops about one query in 26 of a burst, and glibc waits 5 s for it: a thousand agents connecting spent minutes
# in those waits. Set before the first lookup of this process and inherited by the workers; it bounds the wait to
# 1 s (what is measured starts after every agent has connected).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT = 0.5, 3.0
GO, READY = "bench/go", "bench/ready"


def settings_for(port: int, n: int, secret_file: Path) -> RdzvSettings:
    return RdzvSettings(host="127.0.0.1", port=port, run_id="bench", min_nodes=n, max_nodes=n, nproc_per_node=1,
                        node_rank=None, local_addr="127.0.0.1", join_timeout=600, last_call_timeout=1,
                        keepalive_interval=KEEPALIVE_INTERVAL, keepalive_timeout=KEEPALIVE_TIMEOUT,
                        job_secret_file=str(secret_file), job_secret=load_secret(secret_file))


def write_secret(log_dir: Path) -> Path:
    """The job secret, as the sbatch templates make it: a 0600 file in a private directory."""
    path = log_dir / "job_secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(generate_secret().hex().encode())
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- many simulated agents in one process

T = TypeVar("T")
log = logging.getLogger("bench_rendezvous")


class SharedKeepalive:
    """Drives the keepalive tasks of many simulated agents in one process from one thread and one connection,
    every INTERVAL seconds, instead of a thread and a connection per agent (which starve each other on a few
    cores: beats come late and healthy nodes are reported silent). Each task does exactly what it does on an
    agent's own thread, including its first beat at once when it starts."""

    def __init__(self, connect: Callable[[], TCPStore], interval: float) -> None:
        self._connect = connect
        self._interval = interval
        self._tasks: list[KeepaliveTask] = []
        self._fresh: list[KeepaliveTask] = []  # added since the last pass: beat now, not at the next pass
        self._lock = threading.Lock()  # held while a tick runs, so remove() returns only after the task's last tick
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.slowest_pass = 0.0  # seconds: the longest pass over all tasks (beats come that far apart at worst)

    def add(self, task: KeepaliveTask) -> None:
        with self._lock:
            self._tasks.append(task)
            self._fresh.append(task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nvrx-shared-keepalive", daemon=True)
                self._thread.start()
        self._wake.set()

    def remove(self, task: KeepaliveTask) -> None:
        with self._lock:
            for tasks in (self._tasks, self._fresh):
                if task in tasks:
                    tasks.remove(task)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self._interval + 5.0)

    def _run(self) -> None:
        store = self._connect()
        next_pass = time.monotonic()
        while not self._stop:
            self._wake.clear()  # before taking the fresh tasks: one added from now on wakes the next wait at once
            started = time.monotonic()
            full = started >= next_pass
            with self._lock:
                due, self._fresh = (list(self._tasks) if full else self._fresh), []
                for task in due:
                    try:
                        task.tick(store)
                    except (dist.DistError, RendezvousError) as exc:
                        log.warning("keepalive of %s stopped (%s)", task.rdzv.node_id, str(exc).splitlines()[0])
                        self._tasks.remove(task)
            if full:
                self.slowest_pass = max(self.slowest_pass, time.monotonic() - started)
                next_pass += self._interval
            self._wake.wait(max(0.0, next_pass - time.monotonic()))


class SharedRecords:
    """Records already checked and parsed, shared by the simulated agents of one process (keyed by store key,
    round and the exact bytes): N agents in one process reading the same 1,024-node closed record would otherwise
    spend N times what each real agent spends once on its own node. Parsed records are never modified."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parsed: dict[tuple[str, int, bytes], Any] = {}

    def check(self, key: str, r: int, raw: bytes | str, check: Callable[[], T]) -> T:
        ident = (key, r, raw.encode() if isinstance(raw, str) else bytes(raw))
        with self._lock:
            if ident in self._parsed:
                return self._parsed[ident]
        value = check()  # BadRecord: not cached, every agent reports it as it would alone
        with self._lock:
            if len(self._parsed) >= self.LIMIT:
                self._parsed.clear()
            self._parsed[ident] = value
        return value



class SimRendezvous(Rendezvous):
    """The real Rendezvous of a simulated agent, light enough for hundreds per process: its one connection for
    every purpose (it makes one call at a time), its keepalive on the process's SharedKeepalive, and records
    checked and parsed once per process (SharedRecords). Every store request and check is the real one."""

    def __init__(self, *args: Any, keepalive: "SharedKeepalive", records: "SharedRecords", **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._shared_keepalive = keepalive
        self._shared_records = records

    def _client(self, purpose: str = "main"):
        return self.rs.store if self.rs.store is not None else super()._client(purpose)

    def _check(self, key: str, r: int, raw: bytes, parse: Callable[[str], T]) -> T:
        return self._shared_records.check(key, r, raw, lambda: super(SimRendezvous, self)._check(key, r, raw, parse))

    def start_keepalive(self, result: RoundResult) -> None:
        self.stop_keepalive()
        self._ka_task = KeepaliveTask(self, result)
        self._shared_keepalive.add(self._ka_task)

    def stop_keepalive(self) -> float | None:
        task, self._ka_task = self._ka_task, None
        if task is not None:
            self._shared_keepalive.remove(task)  # returns after the task's last tick
        return (task.last_beat or None) if task is not None else None


# ---------------------------------------------------------------- one simulated agent


class SimAgent:
    """The real rendezvous of one agent; records wall-clock times of what the benchmark measures.

    A simulated agent in a worker process is light: one store connection (it makes one call at a time), its
    keepalive on the process's SharedKeepalive (one thread, one connection for all its agents), and records its
    process's agents already checked (SharedRecords: the same bytes are verified and parsed once per process, as
    each real agent does once on its own node); its join, close, stop, watch and every store request are the
    real Rendezvous calls. The store host's agent (agent 0) is a full agent: its own
    keepalive thread and connections, as `nvrx launch` runs it.
    """

    def __init__(self, settings: RdzvSettings, log_dir: Path, name: str, host: bool = False,
                 keepalive: SharedKeepalive | None = None, records: SharedRecords | None = None) -> None:
        # the others join as agents on other machines would (the endpoint is not theirs to host)
        self.rs = open_rendezvous_store(settings) if host else _join(settings.host, settings.port, settings, False)
        events = EventLog(log_dir / f"agent-{name}.jsonl", source="agent")
        if host:
            self.rdzv = Rendezvous(self.rs, settings, RestartPolicy(100), events, node_id=name)
        else:
            self.rdzv = SimRendezvous(self.rs, settings, RestartPolicy(100), events, node_id=name,
                                      keepalive=keepalive, records=records)
        self.t: dict[str, float] = {}

    def run(self, victim: bool, go: threading.Event, kill: threading.Event, counter) -> None:
        go.wait()
        cpu = time.thread_time()
        r0 = self.rdzv.next_round()
        self.t["closed"] = time.time()
        self.t["cpu_join"] = time.thread_time() - cpu  # this agent's own CPU for a join (its thread only)
        self.t["r0"] = self.view(r0)
        counter.add(READY + "/0", 1)
        self.rdzv.wait_stop(r0.round)
        self.t["stop_seen"] = time.time()
        r1 = self.rdzv.next_round()
        self.t["round1"] = time.time()
        self.t["r1"] = self.view(r1)
        self.rdzv.start_keepalive(r1)
        counter.add(READY + "/1", 1)
        if victim:
            kill.wait()
            last_beat = self.rdzv.stop_keepalive()  # this node goes silent: its neighbours must notice
            self.t["silent"] = time.time()
            self.t["last_beat"] = last_beat or self.t["silent"]
        rec = self.rdzv.wait_stop(r1.round)
        self.t["dead_seen"] = time.time()
        self.t["dead_kind"] = str(rec.kind)
        self.t["dead_by"] = rec.by_node
        self.rdzv.stop_keepalive()

    def view(self, result) -> list:
        """What this agent was told about a round: [round, its group rank, its node id, a digest of every member's
        id in order, the id at its group rank]. (A digest, not the list: N lists of N ids is O(N^2) memory in the
        host that collects them, which is not the store's.)"""
        ids = [node.node_id for node in result.nodes]
        return [result.round, result.group_rank, self.rdzv.node_id, members_digest(ids), ids[result.group_rank],
                len(ids)]


def members_digest(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:32]


def consistent(times: list[dict], n: int) -> bool:
    """Every agent was in both rounds with the same members (digest), and its group rank is its place among them."""
    for name in ("r0", "r1"):
        views = [t.get(name) for t in times]
        if any(v is None for v in views) or len({v[3] for v in views}) != 1:
            return False
        if views[0][5] != n or sorted(v[1] for v in views) != list(range(n)):
            return False
        if any(v[4] != v[2] or v[0] != views[0][0] for v in views):
            return False
    return True


def _connected(settings: RdzvSettings, log_dir: Path, name: str, keepalive: SharedKeepalive,
               records: SharedRecords, tries: int = 5) -> SimAgent:
    """A simulated agent; connecting is retried (hundreds of agents connecting at once on 2 loaded cores can
    exceed the 5 s handshake bound, which is not what this benchmark measures)."""
    for attempt in range(tries):
        try:
            return SimAgent(settings, log_dir, name, keepalive=keepalive, records=records)
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def worker_main(port: int, n: int, first: int, count: int, log_dir: str, victim: int) -> None:
    """A worker process: agents FIRST..FIRST+COUNT-1, a thread each for their blocking rendezvous calls, one
    shared keepalive thread; prints their times as JSON."""
    from nvrx.launcher.agent.store import RendezvousStore  # noqa: F401  (imports torch once, before the threads)
    import torch.distributed as dist

    def client() -> "dist.TCPStore":
        return dist.TCPStore("127.0.0.1", port, is_master=False)

    settings = settings_for(port, n, Path(log_dir) / "job_secret")
    keepalive = SharedKeepalive(client, KEEPALIVE_INTERVAL)
    records = SharedRecords()
    agents = [_connected(settings, Path(log_dir), f"a{i:05d}", keepalive, records)
              for i in range(first, first + count)]
    waiter, counter = client(), client()  # the benchmark's own signals: one blocking, one for counts
    go, kill = threading.Event(), threading.Event()
    threads = [threading.Thread(target=a.run, args=(first + i == victim, go, kill, counter), daemon=True)
               for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    counter.add(READY + "/connected", count)
    waiter.wait([GO])
    go.set()
    if first <= victim < first + count:
        waiter.wait([READY + "/kill"])
        kill.set()
    for t in threads:
        t.join()
    keepalive.close()
    for a in agents:
        a.t["keepalive_pass_s"] = keepalive.slowest_pass
    print(json.dumps([a.t for a in agents]), flush=True)


# ---------------------------------------------------------------- one measurement


def wait_count(store, key: str, target: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while int(store.add(key, 0)) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: {int(store.add(key, 0))} of {target} after {timeout:g} s")
        time.sleep(0.01)


def probe_latency(store, seconds: float = 0.5) -> float:
    """Median round trip of one client's store request while the agents load the store (ms)."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        store.add("bench/probe", 0)
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    return samples[len(samples) // 2]


def measure(n: int, procs: int) -> dict:
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="nvrx-bench-rdzv-"))  # private: mkdtemp makes it 0700
    settings = settings_for(port, n, write_secret(log_dir))
    host = SimAgent(settings, log_dir, "a00000", host=True)
    ctl = host.rs.store
    me = psutil.Process()
    procs = max(1, min(procs, n - 1))
    per = [(n - 1) // procs + (1 if i < (n - 1) % procs else 0) for i in range(procs)]
    victim = n - 1
    children, first = [], 1
    for count in per:
        children.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", str(port), str(n), str(first), str(count), str(log_dir), str(victim),
             str(KEEPALIVE_INTERVAL), str(KEEPALIVE_TIMEOUT)],
            stdout=subprocess.PIPE, text=True))
        first += count
    wait_count(ctl, READY + "/connected", n - 1, 300)
    rss0 = me.memory_info().rss
    machine0 = psutil.cpu_times()
    t_go = time.time()
    ctl.set(GO, "1")
    r0 = host.rdzv.next_round()
    host.t["closed"] = time.time()
    host.t["r0"] = host.view(r0)
    wait_count(ctl, READY + "/0", n - 1, 300)  # every other agent is in (or about to be in) wait_stop
    machine1 = psutil.cpu_times()
    rss_closed = me.memory_info().rss
    cpu0, t_cpu0 = me.cpu_times(), time.monotonic()
    time.sleep(0.5)  # only the store's server threads work in this process now: serving the waiting agents
    cpu1, t_cpu1 = me.cpu_times(), time.monotonic()
    probe_ms = probe_latency(host.rs.new_client())
    t_fail = time.time()
    host.rdzv.report_stop(r0.round, StopKind.FAILED, StopDetail(rank=0, group_rank=r0.group_rank))
    r1 = host.rdzv.next_round()
    host.t["r1"] = host.view(r1)
    host.rdzv.start_keepalive(r1)
    wait_count(ctl, READY + "/1", n - 1, 300)
    rss_restarted = me.memory_info().rss
    connections = sum(1 for c in me.net_connections(kind="tcp")
                      if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)
    t_kill = time.time()
    ctl.set(READY + "/kill", "1")
    host.t["dead_kind"] = str(host.rdzv.wait_stop(r1.round).kind)
    host.t["dead_seen"] = time.time()
    host.rdzv.stop_keepalive()
    rss = me.memory_info().rss  # before the children's reports are read: those are the benchmark's, not the store's
    times = [host.t]
    for child in children:
        out, _ = child.communicate(timeout=300)
        times += json.loads(out.strip().splitlines()[-1])
    busy = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t_cpu1 - t_cpu0)
    silent = next(t["last_beat"] for t in times if "last_beat" in t)  # detection counts from the last beat
    host.rdzv.close()
    host.rs.close()
    shutil.rmtree(log_dir, ignore_errors=True)  # event logs and the job secret
    return {
        "agents": n,
        "close_s": round(max(t["closed"] for t in times) - t_go, 3),
        "failure_s": round(max(t["stop_seen"] for t in times if "stop_seen" in t) - t_fail, 3),
        "restart_s": round(max(t["round1"] for t in times if "round1" in t) - t_fail, 3),
        "dead_node_s": round(max(t["dead_seen"] for t in times) - silent, 3),
        "dead_node_over_timeout_s": round(max(t["dead_seen"] for t in times) - silent - KEEPALIVE_TIMEOUT, 3),
        "kill_signal_to_silent_s": round(next(t["silent"] for t in times if "silent" in t) - t_kill, 3),
        "shared_keepalive_slowest_pass_s": round(max(t.get("keepalive_pass_s", 0.0) for t in times), 3),
        "store_host_cpu_while_waiting": round(busy, 3),
        "store_probe_ms": round(probe_ms, 3),
        "store_host_rss_mb": round(rss / 2**20, 1),
        "store_host_rss_growth_mb": round((rss - rss0) / 2**20, 1),
        "store_host_rss_growth_close_mb": round((rss_closed - rss0) / 2**20, 1),
        "store_host_rss_growth_restart_mb": round((rss_restarted - rss_closed) / 2**20, 1),
        "store_connections": connections,
        "machine_cpu_s_during_close": round(_busy(machine1) - _busy(machine0), 2),
        "agent_cpu_ms_per_join": round(1000 * sorted(t["cpu_join"] for t in times if "cpu_join" in t)[(n - 1) // 2], 2),
        "consistent": consistent(times, n),
        "dead_node_kinds": sorted({t.get("dead_kind", "?") for t in times}),
        "dead_node_reported_by": sorted({t.get("dead_by", "?") for t in times}),
    }


def _busy(t) -> float:
    """CPU seconds the whole machine spent busy (every process: the agents' workers, the store, others)."""
    return t.user + t.system + t.nice + getattr(t, "irq", 0) + getattr(t, "softirq", 0)


def table(rows: list[dict]) -> str:
    cols = ["agents", "close_s", "failure_s", "restart_s", "dead_node_s", "store_host_cpu_while_waiting",
            "store_probe_ms", "store_host_rss_mb", "consistent"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(str(r[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main() -> int:
    global KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        port, n, first, count, log_dir, victim = sys.argv[2:8]
        KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT = float(sys.argv[8]), float(sys.argv[9])
        worker_main(int(port), int(n), int(first), int(count), log_dir, int(victim))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default="16,64,256", help="comma-separated N")
    ap.add_argument("--procs", type=int, default=4, help="worker processes that run the simulated agents")
    ap.add_argument("--keepalive", default=f"{KEEPALIVE_INTERVAL},{KEEPALIVE_TIMEOUT}",
                    help="keepalive interval,timeout in seconds (the dead-node time is bounded below by the timeout)")
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "rendezvous.json"))
    args = ap.parse_args()
    KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT = (float(x) for x in args.keepalive.split(","))
    rows = []
    for n in [int(x) for x in args.agents.split(",")]:
        rows.append(measure(n, args.procs))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"keepalive_interval": KEEPALIVE_INTERVAL,
                                             "keepalive_timeout": KEEPALIVE_TIMEOUT, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
