"""A whole node lost, with local checkpoints: 4 ranks as 2 emulated nodes (2 ranks each) and a standby, two tiers
with and without the just-in-time checkpoint, side by side under the same seeded faults (issue 30).

Each node is an emulated host (tests/hosts.py: a network namespace with its own address and host name; needs
root) running its own ``nvrx launch --nnodes 2 --nproc-per-node 2 --local-ckpt-dir <its own dir under /dev/shm>``
agent, as a Slurm user would run one agent per node with a spare node allocated: the job is full with 2 nodes and
the third waits as a standby. Workload: bench_goodput's (``goodput_train.py``, DDP + Adam on gloo, ~2.1 M
parameters) with ``bench/goodput_twotier.py``: local every ``--local-every`` steps, each rank's shard replicated
to the same local rank of the other node, global (DCP, shared directory) every ``--global-every``.

Fault: the node that does not host the rendezvous store (losing the store's host ends any c10d-style job) is
lost: every process on the host (agent, ranks, checkpoint writers) is SIGKILLed at once and its local checkpoint
directory deleted. The standby takes its place with an empty local directory; the lost host is then brought back
as the next standby (a replaced node), empty. Variants:

* ``twotier``: the lost node's shards come back from their replicas on the survivor (resume = newest checkpoint);
* ``twotier+jit``: ``save_on_failure=True``, ``nvrx launch --jit-ckpt``: the survivors save the last completed step
  into the global tier (``jit_iter_<step>``); the resume takes it;
* ``twotier+jit+sharded``: the same, with a DTensor sharded over the ranks in the state (held only by its rank,
  and by its replica): the just-in-time save must decline it and the resume take the local tier, the lost node's
  shards from their replicas.

Per fault: bench_goodput's breakdown (detect, stop, respawn, init, recompute; lost = fault -> the step reached
before it done again) and "recompute since the newest checkpoint" (the time the steps after the newest checkpoint
restorable without the lost node took the first time; found by scanning the surviving local roots and the global
directory at the fault). Target (issue 30): lost per fault <= that + 0.5 s. Checked and asserted per fault: the
resumed step and tier are what they must be; every rank's restored weights equal (CRC-32) the weights rank 0 had
after that step before the fault; with ``sharded``, every rank's shard holds exactly its own values.

    python bench/bench_nodeloss.py --quick     # 120 steps, 1 fault per variant (~3.3 min at load 12-16)
    python bench/bench_nodeloss.py             # 3 faults per variant
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(ROOT))

import bench_goodput as bg  # noqa: E402
import bench_launch as bl  # noqa: E402
from tests.hosts import Host, Hosts, unavailable_reason  # noqa: E402

LOG = logging.getLogger("bench_nodeloss")
NPROC = 2  # ranks per node
NODES = 2
PORT = 29400  # on the hosts' own network
SLACK_S = 0.5  # the target's allowance over the recompute since the newest checkpoint
SETTLE_S = 120.0  # seconds a run waits at most for the load of the previous one to fade
VARIANTS = {"twotier": ("twotier", False), "twotier+jit": ("twotier_jit", False),
            "twotier+jit+sharded": ("twotier_jit", True)}
_LOCAL_FILE = re.compile(r"^iter_(\d{9})_(\d+)_local\.nvrxl$")
_GLOBAL_DIR = re.compile(r"^(?:jit_)?iter_(\d+)$")


@dataclass(frozen=True)
class Settings:
    """Everything that defines the runs (saved in the JSON)."""

    steps: int
    faults: int
    interval: float
    jitter: float
    seed: int
    local_every: int
    global_every: int
    pause: float
    pg_timeout: float
    run_timeout: float


# ------------------------------------------------------------------------------------------ the emulated cluster


class Cluster:
    """Three emulated hosts, each with its own local checkpoint root; host 0 hosts the rendezvous store."""

    def __init__(self, settings: Settings, variant: str, dirs: bl.RunDirs, run_id: str) -> None:
        self.hosts = Hosts(NODES + 1, stem="nl")
        self.settings, self.variant, self.dirs, self.run_id = settings, variant, dirs, run_id
        self.roots = {h.name: Path(tempfile.mkdtemp(prefix=f"nvrx-nodeloss-{h.name}-", dir="/dev/shm"))
                      for h in self.hosts}
        self.agents: dict[str, subprocess.Popen] = {}
        self.env = bl.build_env(bl.make_launchers()["nvrx"], run_id)

    def command(self, host: Host) -> list[str]:
        ckpt, sharded = VARIANTS[self.variant]
        s, d = self.settings, self.dirs
        (d.root / "ckpt").mkdir(exist_ok=True)
        flags = ["--nnodes", str(NODES), "--nproc-per-node", str(NPROC), "--max-restarts", str(s.faults + 3),
                 "--rdzv-id", self.run_id, "--rdzv-endpoint", f"{self.hosts[0].addr}:{PORT}",
                 "--rdzv-conf", "join_timeout=120,last_call_timeout=1", "--node-rank", "0" if host.index == 0 else "1",
                 "--log-dir", str(d.logs), "--local-ckpt-dir", str(self.roots[host.name]), "--async-ckpt",
                 *(["--jit-ckpt"] if ckpt == "twotier_jit" else [])]
        args = ["--out", str(d.out), "--steps", str(s.steps), "--pause", f"{s.pause:g}", "--ckpt", ckpt,
                "--every", str(s.local_every), "--global-every", str(s.global_every), "--ckpt-dir",
                str(d.root / "ckpt"), "--pg-timeout", f"{s.pg_timeout:g}", "--digests", *(["--sharded"] if sharded else [])]
        return host.wrap([sys.executable, "-m", "nvrx", "launch", *flags, str(bg.TRAIN), *args])

    def start(self, host: Host) -> None:
        """Start HOST's agent (its local root emptied first: a fresh or replaced node)."""
        root = self.roots[host.name]
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(mode=0o700)
        log = open(self.dirs.root / f"agent-{host.name}-{len(self.agents)}.log", "wb")  # noqa: SIM115
        self.agents[host.name] = subprocess.Popen(self.command(host), cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                                  stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def host_of(self, pid: int) -> Host | None:
        return next((h for h in self.hosts if pid in h.pids()), None)

    def lose(self, host: Host) -> None:
        """The node is gone: SIGKILL every process on it (agent, ranks, writers) and delete its local directory."""
        for _ in range(3):  # a process forked meanwhile is caught by the next pass
            pids = host.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.roots[host.name], ignore_errors=True)
        agent = self.agents.pop(host.name, None)
        if agent is not None:
            agent.wait(timeout=30)

    def events(self, ev: str) -> int:
        """How many agent events EV were logged (e.g. rdzv_standby: a standby is waiting)."""
        pattern = f'"ev":"{ev}"'
        return sum(path.read_text(errors="replace").count(pattern)
                   for path in (self.dirs.logs / self.run_id).glob("agent-*.jsonl"))

    def jit_outcomes(self) -> list[dict[str, Any]]:
        """Every jit_checkpoint event the agents logged (what their surviving ranks answered after a fault)."""
        found = []
        for path in (self.dirs.logs / self.run_id).glob("agent-*.jsonl"):
            for line in path.read_text(errors="replace").splitlines():
                if '"ev":"jit_checkpoint"' in line:
                    e = json.loads(line)
                    found.append({k: e.get(k) for k in ("t", "outcome", "step", "reason", "lost", "waited")})
        return sorted(found, key=lambda e: e["t"])

    def close(self) -> None:
        self.hosts.close()
        for agent in self.agents.values():
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
        for root in self.roots.values():
            shutil.rmtree(root, ignore_errors=True)


def newest_checkpoint(cluster: Cluster, lost: Host) -> dict[str, int]:
    """The newest iteration restorable once LOST is gone: local (every rank's shard in a surviving root) and
    global (a published directory). A file being written has another name until it is complete."""
    owners: dict[int, set[int]] = {}
    for host in cluster.hosts:
        if host is lost:
            continue
        for path in cluster.roots[host.name].glob("*/rank*/*"):
            m = _LOCAL_FILE.match(path.name)
            if m:
                owners.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    local = max((it for it, got in owners.items() if len(got) == NODES * NPROC), default=-1)
    global_dir = cluster.dirs.root / "ckpt" / "global"
    names = [_GLOBAL_DIR.match(p.name) for p in global_dir.iterdir()] if global_dir.is_dir() else []
    return {"local": local, "global": max((int(m.group(1)) for m in names if m), default=-1)}


# ------------------------------------------------------------------------------------------ the injector


class NodeLossInjector(bg.Injector):
    """bench_goodput's injector for one node's loss: it kills the host holding the fault's rank, and brings a
    replaced node back as the standby once the job trains again (before the next fault)."""

    def __init__(self, cluster: Cluster, deadline: float) -> None:
        super().__init__(None, cluster.dirs.out, "crash", deadline)  # type: ignore[arg-type]
        self.cluster = cluster
        self.lost: list[Host] = []

    def alive(self) -> bool:
        agent0 = self.cluster.agents.get(self.cluster.hosts[0].name)
        return (agent0 is not None and agent0.poll() is None and not bg.training_done(self.out)
                and time.time() < self.deadline)

    def _wait_first_step(self, attempt: int) -> float | None:
        t_first = super()._wait_first_step(attempt)
        if t_first is not None and self.lost:  # the job trains again: the lost host comes back as the standby
            self._replace(self.lost.pop())
        return t_first

    def add_standby_when_training(self, host: Host) -> None:
        """Once the job's first attempt is ready, start HOST as the standby (it would join the round otherwise)."""
        if self._wait_attempt(0) is not None:
            self._replace(host)

    def _replace(self, host: Host) -> None:
        """Start HOST's agent (emptied: a replaced node) and wait until it waits as the standby."""
        standbys = self.cluster.events("rdzv_standby")
        self.cluster.start(host)
        while self.alive() and self.cluster.events("rdzv_standby") <= standbys:
            time.sleep(0.1)

    def _fire(self, fault: bg.Fault, attempt: int, records: list[dict[str, Any]]) -> dict[str, Any]:
        victim = self.cluster.host_of(records[fault.rank]["pid"])
        assert victim is not None and victim is not self.cluster.hosts[0], "the victim is not on a member host"
        newest = newest_checkpoint(self.cluster, victim)
        t_fault = time.time()
        self.cluster.lose(victim)
        self.lost.append(victim)
        pids = [r["pid"] for r in records]
        lost_ranks = [r["rank"] for r in records if r.get("host") == victim.name]
        survivors = [r["pid"] for r in records if r["rank"] not in lost_ranks]
        kept = sorted({r.get("host") for r in records if r["rank"] not in lost_ranks})
        t_first_gone, t_all_gone = self._watch_gone(survivors, pids)
        return {"attempt": attempt, "rank": fault.rank, "after_s": fault.after_s, "pid": records[fault.rank]["pid"],
                "t_fault": t_fault, "t_first_gone": t_first_gone, "t_all_gone": t_all_gone, "in_place": False,
                "host": victim.name, "lost_ranks": lost_ranks, "survivor_hosts": kept, "newest": newest}


# ------------------------------------------------------------------------------------------ one run


def make_schedule(settings: Settings) -> list[bg.Fault]:
    """Seconds of training before each fault (seeded; the same for every variant). The rank hit is always one of
    the non-store node's (node rank 1: ranks NPROC..): the whole node goes."""
    rng = random.Random(settings.seed)
    return [bg.Fault(round(rng.uniform(settings.interval - settings.jitter, settings.interval + settings.jitter), 2),
                     NPROC + rng.randrange(NPROC)) for _ in range(settings.faults)]


def execute(variant: str, settings: Settings, schedule: list[bg.Fault], keep: bool) -> bg.RunResult:
    """One run of VARIANT on fresh hosts: host 0 first (the store), then the member and the standby."""
    dirs = bl.RunDirs.create("nvrx", f"nodeloss-{variant.replace('+', '-')}")
    run_id = f"nodeloss-{uuid.uuid4().hex[:12]}"
    result = bg.RunResult(bg.RunSpec("nvrx", "nodeloss", "nodeloss", variant, settings.local_every))
    result.load = os.getloadavg()[0]
    cluster = Cluster(settings, variant, dirs, run_id)
    try:
        t0 = result.t0 = time.time()
        cluster.start(cluster.hosts[0])
        time.sleep(2.0)  # the store's host first
        cluster.start(cluster.hosts[1])
        injector = NodeLossInjector(cluster, t0 + settings.run_timeout)
        injector.add_standby_when_training(cluster.hosts[2])
        fired = injector.run(schedule)
        agent0 = cluster.agents[cluster.hosts[0].name]
        try:
            result.rc = agent0.wait(timeout=max(1.0, t0 + settings.run_timeout - time.time()))
        except subprocess.TimeoutExpired:
            result.error = f"not finished within {settings.run_timeout:.0f} s"
        result.exit_s = time.time() - t0
        bg.collect(result, dirs.out, t0, fired, len(schedule))
        outcomes = cluster.jit_outcomes()
        for fault in result.faults:
            fault["jit"] = next((o for o in outcomes if 0 <= o["t"] - fault["t_fault"] < 30), None)  # its answer
            fault.update(verify(dirs.out, fault, variant, settings))
            fault["recompute_since_newest"] = recompute_since_newest(dirs.out, fault, result.step_median_s)
        result.monitor = {"step_p90_s": step_p90(dirs.out)}  # (bench_goodput's free-form facts field)
        if result.ok and not all(f.get("state_ok") for f in result.faults):
            result.ok, result.error = False, "resumed state check failed: " + "; ".join(
                f.get("state_error") or "" for f in result.faults if not f.get("state_ok"))
    finally:
        cluster.close()
        if not result.ok:
            result.log_tail = bl.tail(next(iter(sorted(dirs.root.glob("agent-nl0-*.log"))), dirs.console), 30)
        if result.ok and not keep:
            shutil.rmtree(dirs.root, ignore_errors=True)
        else:
            result.run_dir = str(dirs.root)
    return result


# ------------------------------------------------------------------------------------------ checking a resume


def digests(out: Path, upto: int) -> dict[int, int]:
    """Rank 0's weight digest after each step (steps done -> CRC-32), attempts 0..UPTO (a later attempt's wins)."""
    found: dict[int, int] = {}
    for a in range(upto + 1):
        try:
            lines = (out / f"digest-a{a}-r0.txt").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) == 2:
                found[int(parts[0])] = int(parts[1])
    return found


def allowed_resumes(fault: dict[str, Any], local_every: int, global_every: int) -> set[tuple[Any, Any]]:
    """The (steps, tier) pairs the resume after FAULT may take: the survivors' just-in-time save when they
    reported one saved; else a checkpoint at least as new as the newest restorable at the fault (one whose
    replicas were exchanged before the loss may be written after it: a local or global save up to the step
    reached), or a fresh start (None, None) if there was none."""
    jit, newest = fault.get("jit") or {}, fault["newest"]
    if jit.get("outcome") == "saved" and jit.get("step") is not None:
        return {(int(jit["step"]), "global")}
    floor, top = max(newest["local"], newest["global"]), fault["step_reached"] + 1
    allowed: set[tuple[Any, Any]] = {(s, "local") for s in range(local_every, top + 1, local_every) if s >= floor}
    allowed |= {(s, "global") for s in range(global_every, top + 1, global_every) if s >= floor}
    if floor < 0:
        allowed.add((None, None))
    return allowed


def verify(out: Path, fault: dict[str, Any], variant: str, settings: Settings) -> dict[str, Any]:
    """Whether the resume after FAULT restored what it must: step and tier, every rank's weights, the lost ranks'
    shards from their replicas (local tier) or the global tier, and (sharded) every rank its own shard."""
    nxt = fault.get("next_attempt")
    ready = bg.ready_records(out, nxt) if nxt is not None else None
    if not ready:
        return {"state_ok": False, "state_error": "no attempt after the fault"}
    restored = [r.get("restored") or {} for r in ready]
    allowed = allowed_resumes(fault, settings.local_every, settings.global_every)
    got = restored[0].get("steps")
    pairs = {(r.get("steps"), r.get("tier")) for r in restored}
    want_digest = digests(out, fault["attempt"]).get(got)
    lost = [r["rank"] for r in ready if r.get("host") not in fault.get("survivor_hosts", [])]
    facts = {"resumed_steps": got, "allowed": sorted(allowed, key=str), "replaced_ranks": lost,
             "tiers": [r.get("tier") for r in restored], "sources": [r.get("local_source") for r in restored],
             "jit_used": "just-in-time" in (restored[0].get("reason") or ""),
             "weights_equal": None if got is None else  # (a fresh start restores nothing)
             want_digest is not None and all(r.get("digest") == want_digest for r in restored),
             "shards_own": all(r.get("shard_ok", True) for r in restored),
             "lost_ranks_from": sorted({f"{r.get('tier')}:{r.get('local_source') or 'dcp'}"
                                        for i, r in enumerate(restored) if i in lost}),
             "reason": restored[0].get("reason")}
    errors = []
    if len(pairs) != 1 or not pairs <= allowed:
        errors.append(f"resumed (steps, tier) {sorted(pairs, key=str)}, allowed {sorted(allowed, key=str)}")
    if any(r.get("tier") == "local" and r.get("local_source") != "replica" for i, r in enumerate(restored) if i in lost):
        errors.append(f"the lost ranks {lost} did not restore from replicas: {facts['sources']}")
    if "sharded" in variant and facts["jit_used"]:
        errors.append("a just-in-time checkpoint was used with sharded state")
    if facts["weights_equal"] is False:
        errors.append(f"restored weights differ from the run's own at step {got} (digest {want_digest})")
    if not facts["shards_own"]:
        errors.append("a rank's sharded state is not its own")
    return {**facts, "state_ok": not errors, "state_error": "; ".join(errors) or None}


# ------------------------------------------------------------------------------------------ summary


def recompute_since_newest(out: Path, fault: dict[str, Any], step_s: float | None) -> float | None:
    """Seconds the steps after the newest restorable checkpoint took before the fault (the work a resume from it
    redoes): from that checkpoint's step done to the step reached, in the faulted attempt."""
    newest = max(fault["newest"]["local"], fault["newest"]["global"])
    if fault.get("tiers") and fault["tiers"][0] == "local" and not fault.get("jit_used"):
        newest = max(newest, fault.get("resumed_steps") or -1)  # written after the scan: restorable all the same
    reached = fault.get("step_reached", -1)
    if newest < 0 or reached < newest:
        return 0.0 if reached < newest else None
    t_from = bg.step_done_at(out, fault["attempt"], newest)
    t_to = bg.step_done_at(out, fault["attempt"], reached)
    if t_from is not None and t_to is not None:
        return t_to - t_from
    return (reached - newest) * step_s if step_s else None


def step_p90(out: Path) -> float | None:
    """The 90th percentile of rank 0's step times over the run (with the median: how steady the machine was)."""
    gaps = [t2 - t1 for a in bg.attempts(out) for (_, t1), (_, t2) in zip(bg.progress(out, a, 0),
                                                                          bg.progress(out, a, 0)[1:])]
    return statistics.quantiles(gaps, n=10)[-1] if len(gaps) >= 20 else None


def settle(cores: int, bound: float = SETTLE_S) -> None:
    """Wait (up to BOUND s) for the 1-minute load to fall to one per core: the previous run's own 4 ranks stay in
    the average for a minute, and a run started on top of them is judged noisy."""
    deadline = time.monotonic() + bound
    if os.getloadavg()[0] > cores:
        LOG.info("waiting up to %.0f s for the load (%.1f) to fall to %d", bound, os.getloadavg()[0], cores)
    while os.getloadavg()[0] > cores and time.monotonic() < deadline:
        time.sleep(2.0)


def noisy(row: dict[str, Any], cores: int) -> str | None:
    """Why ROW's figures are too noisy to judge a target on, or None: others' load when it started above one per
    core, or the step time swinging (p90 over median of rank 0's step times > 1.5)."""
    if row["load"] is not None and row["load"] / cores > 1.0:
        return f"load {row['load']:.1f} on {cores} cores before the run"
    p90, median = row.get("step_p90_s"), row.get("step_median_s")
    if p90 and median and p90 / median > 1.5:
        return f"step time p90 {p90 * 1000:.0f} ms vs median {median * 1000:.0f} ms"
    return None


def summarize(results: list[bg.RunResult]) -> list[dict[str, Any]]:
    cores = os.cpu_count() or 1
    rows = []
    for r in results:
        row: dict[str, Any] = {"variant": r.spec.ckpt, "ok": r.ok, "error": r.error, "wall_s": r.wall_s, "load": r.load,
                               "step_median_s": r.step_median_s, "step_p90_s": (r.monitor or {}).get("step_p90_s"),
                               "faults": r.faults, "run_dir": r.run_dir}
        for part in (*bg.COMPONENTS, "recompute_since_newest"):
            row[part] = bg.med([f[part] for f in r.faults if f.get(part) is not None])
        row["noisy"] = noisy(row, cores)
        row["target"] = verdict(r.faults, row["noisy"]) if r.ok else "FAILED"
        row["state"] = ("ok" if all(f.get("state_ok") for f in r.faults) else "WRONG") if r.faults else "-"
        rows.append(row)
    return rows


def verdict(faults: list[dict[str, Any]], why_noisy: str | None) -> str:
    """PASS / MISS of lost per fault <= recompute since the newest checkpoint + SLACK_S, every fault; a noisy run
    is never a PASS."""
    judged = [f["lost"] <= f["recompute_since_newest"] + SLACK_S for f in faults
              if f.get("lost") is not None and f.get("recompute_since_newest") is not None]
    if not judged:
        return "-"
    if all(judged):
        return "noisy: rerun" if why_noisy else "PASS"
    return "MISS" + (" (noisy)" if why_noisy else "")


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["variant", "lost/fault", "detect", "stop", "respawn", "init", "recompute", "since newest ckpt",
              "target", "resumed (tier, lost ranks from)", "JIT", "state"]
    body = []
    for r in rows:
        resumed = "; ".join(f"{f.get('resumed_steps')} ({f.get('tiers', ['?'])[0]}{', JIT' if f.get('jit_used') else ''},"
                            f" {'/'.join(f.get('lost_ranks_from') or [])})" for f in r["faults"])
        body.append([r["variant"] if r["ok"] else f"{r['variant']} FAILED", bg.fmt(r.get("lost")),
                     *(bg.fmt(r.get(c)) for c in ("detect", "stop", "respawn", "init", "recompute",
                                                  "recompute_since_newest")),
                     r["target"], resumed or "-", "; ".join(jit_text(f.get("jit")) for f in r["faults"]) or "-",
                     r["state"]])
    return header, body


def jit_text(jit: dict[str, Any] | None) -> str:
    """The survivors' just-in-time answer in a few words: 'saved 38 after 6.4 s' / 'failed after 6.4 s'."""
    if not jit:
        return "-"
    return f"{jit['outcome']}{' ' + str(jit['step']) if jit.get('step') is not None else ''}"


# ------------------------------------------------------------------------------------------ driver


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="120 steps, 1 fault per variant after 5 +- 1 s")
    p.add_argument("--steps", type=int)
    p.add_argument("--faults", type=int)
    p.add_argument("--interval", type=float, help="mean seconds of training before each fault")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--local-every", type=int, default=10)
    p.add_argument("--global-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--keep", action="store_true", help="keep every run's directory")
    p.add_argument("--out", default=str(bg.RESULTS / "nodeloss.json"))
    args = p.parse_args(argv)
    quick = args.quick
    steps = args.steps or (120 if quick else 900)
    settings = Settings(steps=steps, faults=args.faults or (1 if quick else 3),
                        interval=args.interval or (5.0 if quick else 10.0), jitter=1.0 if quick else 2.0,
                        seed=args.seed, local_every=args.local_every, global_every=args.global_every, pause=0.04,
                        pg_timeout=10.0, run_timeout=steps * 0.3 + 300)
    return settings, args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_nodeloss: {reason}", file=sys.stderr)
        return 2
    bg.WORLD = NODES * NPROC  # bench_goodput's readers (ready, progress, done files) for 4 ranks
    variants = bl.parse_list(args.variants, tuple(VARIANTS), "--variants")
    schedule = make_schedule(settings)
    LOG.info("fault schedule (seconds of training, rank whose node is lost): %s",
             ", ".join(f"{f.after_s:g} s r{f.rank}" for f in schedule))
    uptime = [round(x, 2) for x in os.getloadavg()]
    results = []
    for variant in variants:
        settle(os.cpu_count() or 1)
        LOG.info("run %s (load %.1f)", variant, os.getloadavg()[0])
        results.append(execute(variant, settings, schedule, args.keep))
        r = results[-1]
        LOG.log(logging.INFO if r.ok else logging.WARNING, "%s: %s", variant,
                f"wall {r.wall_s:.1f} s" if r.ok else f"FAILED: {r.error}; kept {r.run_dir}")
    rows = summarize(results)
    header, body = table(rows)
    title = (f"a node lost: {NODES} nodes x {NPROC} ranks + a standby (emulated hosts), local every "
             f"{settings.local_every} + global every {settings.global_every} steps; {settings.steps} steps, "
             f"{settings.faults} fault(s) per run; target lost/fault <= recompute since newest ckpt + {SLACK_S} s")
    print()
    bl.print_plain_table(header, body, title)
    for row in rows:
        for f in row["faults"]:
            print(f"  {row['variant']}: fault at step {f.get('step_reached')} ({f.get('host')}, ranks "
                  f"{f.get('lost_ranks')}), newest restorable {f.get('newest')}: resumed {f.get('resumed_steps')} "
                  f"from {f.get('tiers')} sources {f.get('sources')}; weights equal {f.get('weights_equal')}, "
                  f"own shards {f.get('shards_own')}; {f.get('state_error') or 'state ok'}")
            if f.get("jit"):
                print(f"    JIT: {f['jit']['outcome']} (lost ranks {f['jit']['lost']}, "
                      f"{f['jit']['t'] - f['t_fault']:.2f} s after the fault): {f['jit'].get('reason') or 'saved'}")
        if row["noisy"]:
            print(f"  {row['variant']}: noisy: rerun ({row['noisy']})")
    uptime_end = [round(x, 2) for x in os.getloadavg()]
    print(f"load (1, 5, 15 min) at start {uptime}, at end {uptime_end}")
    bl.save_json(Path(args.out), {"machine": bl.machine_info(), "command": " ".join(["bench/bench_nodeloss.py",
                                                                                      *(argv or sys.argv[1:])]),
                                  "load_start": uptime, "load_end": uptime_end, "settings": asdict(settings),
                                  "schedule": [asdict(f) for f in schedule], "rows": rows,
                                  "table": {"header": header, "body": body, "title": title}})
    print(f"saved {args.out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
