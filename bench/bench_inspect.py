"""`nvrx inspect` on a ~100 MB log dir: wall time, MB/s, and ratios against grep and jq over the same files.

    python bench/bench_inspect.py [--mb 100] [--runs 3] [--keep DIR] [--output bench/results/inspect.json]
    python bench/bench_inspect.py --scale [--runs 3]     # 1,024 nodes x 2 ranks, 10 rounds: terminal, JSON, --html

``--scale`` (issue 31) writes one job of ``--nodes 1024`` agents, ``--rounds 10`` rounds of 60-120 simulated s,
with what the agents write per round at that size (health checks, rounds, rank starts, checkpoints reported
complete by the ranks' monitors; where a rank hangs a collective, the hundreds of other ranks whose monitors
report the hang too and whose agents SIGKILL them when they ignore the stop's SIGTERM) and times ``nvrx inspect`` (text), ``--json`` and ``--html`` against jq; it also
checks the HTML size, renders it in headless Chromium (scripts/install_chromium.sh) and counts the terminal
view's lines.

The log dir is generated with the real writer (``nvrx.events.EventLog``, with explicit times) and the
event records the real writers emit: a resume chain of ``--jobs`` Slurm-style jobs (one run dir each, plus
the resume driver's ``state/resume.jsonl``), ``--nodes`` agents x ``--nproc`` rank monitors per job,
rounds of 5-40 simulated minutes ended by crashes, hangs (section timeouts), a node leaving and a
preemption (SIGTERM) at the end of every job but the last; monitors log what the real ones log at their
rate limits (section open/close every 10 s per section, heartbeat_stats every 30 s, checkpointing
sections, computed timeouts). A few lines are damaged: a torn last line (a killed agent), binary garbage,
a cut-off line in the middle of a monitor file.

Peers, over exactly the same files: ``grep -c`` of the stop records (reads every byte, parses nothing)
and ``jq -R 'fromjson? | select(.ev == "rdzv_stop")'`` (parses every line in C, skips corrupt ones).
Each command runs ``--runs`` times, interleaved (run i of each before run i+1); the medians of wall time
and of CPU time (user + system, less sensitive to other load on a shared machine) are reported, and the
peak RSS of one ``nvrx inspect`` run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nvrx.events import AgentKilledRank, CheckpointComplete, HealthCheckInfo, NodeHealth  # noqa: E402
from nvrx.events import (  # noqa: E402
    AgentSignal, AgentStart, EventLog, FirstHeartbeat, FtConfig, FtConfigInfo, HangDetected, HangInfo, HeartbeatStats,
    JitAnswer, JitCheckpoint, JobEnd, MonitorConnect, MonitorDisconnect, MonitorExit, MonitorSpawned, MonitorStart,
    RankExit, RankStart, RankTerminated, RdzvJoin, RdzvRound, RdzvStop, ResumeAttemptEnd, ResumeAttemptStart, ResumeDecision, ResumeEnd,
    ResumeLimits, ResumeStart, ResumeSubmit, SectionClose, SectionOpen, StopDetail, TimeoutsInfo, TimeoutsSet,
)

T0 = 1_700_000_000.0
STEP_S = 0.85               # simulated training step
SECTION_PERIOD = 10.0       # nvrx.monitors.rank_monitor.SECTION_EVENT_PERIOD
STATS_PERIOD = 30.0         # nvrx.monitors.rank_monitor.STATS_PERIOD
CKPT_EVERY = 900.0
TIMEOUTS = TimeoutsInfo(initial_heartbeat=600.0, heartbeat=300.0, sections={"step": 60.0, "checkpointing": 600.0})


SCALE = {"jobs": 1, "nodes": 1024, "nproc": 2, "rounds": 10, "round_s": (60.0, 120.0), "ckpt_every": 30.0}


def generate(root: Path, **config: Any) -> None:
    """Write the --scale log dir (1,024 nodes x 2 ranks, 10 rounds) under ROOT; CONFIG overrides its settings.

    Also what tests/integration/test_inspect_scale.py reads: one generator for the benchmark and the test."""
    global CKPT_EVERY
    args = argparse.Namespace(mb=100.0, seed=7, **{**SCALE, **config})
    CKPT_EVERY = args.ckpt_every
    Chain(root, args).run()


class Chain:
    """Writes one synthetic resume chain; sizes in bytes are tracked to stop at the target."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.root = root
        self.args = args
        self.rng = random.Random(args.seed)
        self.t = T0
        self.logs: list[EventLog] = []
        self.resume = self._log(root / "state" / "resume.jsonl", "resume")

    def _log(self, path: Path, src: str) -> EventLog:
        log = EventLog(path, src)
        self.logs.append(log)
        return log

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*.jsonl"))

    def run(self) -> None:
        target = self.args.mb * 1_000_000
        jobs = self.args.jobs
        for j in range(jobs):
            last = j == jobs - 1
            job_id = str(4242 + j)
            cmd = ["nvrx", "launch", "--nproc-per-node", str(self.args.nproc), "train.py"]
            self.resume.emit(ResumeStart(mode="loop", pid=100 + j, job_id=job_id, node="gpu000", state_dir="/runs/state",
                                         finished_flag="/runs/state/finished.flag",
                                         limits=ResumeLimits(max_attempts=10, max_failures=3, max_no_progress=3),
                                         submit="sbatch", command=cmd), t=self.t)
            self.resume.emit(ResumeAttemptStart(attempt=j + 1, job_id=job_id, node="gpu000", command=cmd,
                                                progress=j * 1000), t=self.t)
            start = self.t
            code = self.job(j, target * (j + 1) // jobs, last)
            cause = "clean_exit" if last else "interrupted"
            self.resume.emit(ResumeAttemptEnd(attempt=j + 1, exit_code=code, cause=cause, progress=(j + 1) * 1000,
                                              finished=last, job_id=job_id, node="gpu000", start=start,
                                              seconds=round(self.t - start, 3)), t=self.t)
            action, reason = (("finished", "the finished flag exists: training is complete") if last else
                              ("continue", f"stopped by SIGTERM: interrupted (exit {code})"))
            self.resume.emit(ResumeDecision(action=action, reason=reason, new_job=not last, attempts=j + 1, failures=0,
                                            no_progress=0, last_progress=(j + 1) * 1000, last_cause=cause,
                                            excluded_nodes=[], state={"attempts": j + 1, "failures": 0}),
                             t=self.t + 0.2)
            if not last:
                self.resume.emit(ResumeSubmit(status="submitted", method="sbatch", from_job=job_id,
                                              command=["sbatch", f"--dependency=afterany:{job_id}", "job.sbatch"],
                                              exclude=[], ok=True, job_id=str(4243 + j), state={"attempts": j + 1}),
                                 t=self.t + 0.4)
            self.resume.emit(ResumeEnd(action=action, reason=reason, exit_code=0 if last else 3), t=self.t + 0.5)
            if not last:
                self.t += self.rng.uniform(30, 120)  # queue time of the continuation job
        for log in self.logs:
            log.close()
        self._damage()

    def job(self, j: int, until_bytes: int, last: bool) -> int:
        a = self.args
        run_dir = self.root / str(4242 + j)
        nodes = [f"gpu{j * a.nodes + n:03d}-{9000 + n}" for n in range(a.nodes)]
        node_ids = [f"{n}-{self.rng.randrange(16 ** 6):06x}" for n in nodes]
        agents = [self._log(run_dir / f"agent-{n}.jsonl", "agent") for n in nodes]
        monitors = [[self._log(run_dir / f"monitor-{n}-{lr}.jsonl", f"monitor-{lr}") for lr in range(a.nproc)]
                    for n in nodes]
        ft = FtConfigInfo(workload_check_interval=5.0, initial_rank_heartbeat_timeout=600.0,
                          rank_heartbeat_timeout=300.0, safety_factor=5.0, rank_termination_signal="SIGKILL",
                          log_level="INFO", rank_section_timeouts={"step": 60.0, "checkpointing": 600.0},
                          rank_out_of_section_timeout=None, auto_heartbeat=False)
        for g, ag in enumerate(agents):
            ag.emit(AgentStart(pid=9000 + g, nproc=a.nproc, nnodes=f"{a.nodes}:{a.nodes}", max_restarts=100,
                               run_id=str(4242 + j)), t=self.t + 0.01 * g)
            ag.emit(FtConfig(config=ft), t=self.t + 0.01 * g)
            for lr in range(a.nproc):
                ag.emit(MonitorSpawned(local_rank=lr, pid=20000 + lr), t=self.t + 0.02)
                monitors[g][lr].emit(MonitorStart(rank=lr, pid=20000 + lr, socket="/tmp/x.sock", timeouts=TIMEOUTS,
                                                  check_interval=5.0), t=self.t + 0.1)
        self.t += 0.5
        r, restarts, pid = 0, 0, 30000
        while True:
            done = (r + 1 >= a.rounds) if a.rounds else self.size() >= until_bytes
            for g, ag in enumerate(agents):
                checks = [HealthCheckInfo(name="memory", status="ok", detail="enough memory available",
                                          seconds=0.001),
                          HealthCheckInfo(name="disk", status="ok", detail="enough disk free", seconds=0.002)]
                ag.emit(NodeHealth(ok=True, seconds=round(self.rng.uniform(0.003, 0.009), 4), checks=checks,
                                   action="joins"), t=self.t - 0.05)
                ag.emit(RdzvJoin(round=r, node_id=node_ids[g]), t=self.t)
                ag.emit(RdzvRound(round=r, group_rank=g, nodes=node_ids, world_size=a.nodes * a.nproc,
                                  restart_count=restarts, waited=0.05), t=self.t + 0.05)
            start = self.t + 0.4
            pids = {}
            for g, ag in enumerate(agents):
                for lr in range(a.nproc):
                    pid += 1
                    pids[g, lr] = pid
                    ag.emit(RankStart(local_rank=lr, rank=g * a.nproc + lr, pid=pid, attempt=restarts, how="fork",
                                      seconds=0.004), t=start + 0.001 * lr)
            length = self.rng.uniform(*a.round_s)
            end = start + length
            kind = "interrupted" if done and not last else ("succeeded" if done else self.rng.choice(
                ["failed", "failed", "hang", "node_left"]))
            bad = (self.rng.randrange(a.nodes), self.rng.randrange(a.nproc))
            late, killed = self.collective_hang(bad) if kind == "hang" else ({}, set())
            for g in range(a.nodes):
                for lr in range(a.nproc):
                    self.session(monitors[g][lr], lr, pids[g, lr], start, end, hung=(kind == "hang" and (g, lr) == bad),
                                 global_rank=g * a.nproc + lr, late=late.get((g, lr)))
            stop_t = end + (15.0 if kind == "node_left" else 0.02)  # node_left: after the keepalive timeout
            for g, lr in sorted(killed):
                agents[g].emit(AgentKilledRank(local_rank=lr, rank=g * a.nproc + lr, pid=pids[g, lr], attempt=restarts,
                                               signal="SIGKILL", after="SIGTERM", waited=0.6), t=stop_t + 0.6)
            if kind in ("failed", "hang"):
                restarts += 1
                g, lr = bad
                hang = None
                if kind == "hang":
                    hang = HangInfo(rank=lr, pid=pids[bad], generation=r + 1, reason="section_timeout", section="step",
                                    elapsed=60.3, timeout=60.0, timeouts=TIMEOUTS, signal="SIGKILL", t=end)
                sig = "SIGKILL" if hang else self.rng.choice(["SIGSEGV", None])
                detail = StopDetail(rank=g * a.nproc + lr, local_rank=lr, group_rank=g, pid=pids[bad],
                                    exitcode=None if sig else 1, signal=sig, abandoned=False,
                                    tail=[f"step {int(length / STEP_S)}: loss 2.{self.rng.randrange(1000):03d}"] * 3
                                         + ["RuntimeError: CUDA error: an illegal memory access was encountered"],
                                    describe=f"rank {g * a.nproc + lr} failed", round=r, hang=hang)
                agents[g].emit(RankExit(local_rank=lr, rank=g * a.nproc + lr, pid=pids[bad], exitcode=detail.exitcode,
                                        signal=sig, attempt=restarts - 1, abandoned=False), t=end)
                self.stop(agents, r, "failed", node_ids[0], detail, restarts, stop_t)
                self.jit(agents, r, "failed", [g * a.nproc + lr], stop_t, int((end - T0) / STEP_S))
            elif kind == "node_left":
                restarts += 1
                self.stop(agents, r, "node_left", node_ids[0], StopDetail(node=node_ids[-1], group_rank=a.nodes - 1),
                          restarts, stop_t)
                self.jit(agents[:-1], r, "node_left", list(range((a.nodes - 1) * a.nproc, a.nodes * a.nproc)), stop_t,
                         int((end - T0) / STEP_S))
            elif kind == "interrupted":
                for ag in agents:
                    ag.emit(AgentSignal(signal="SIGTERM", phase="running", round=r), t=end)
                self.stop(agents, r, "interrupted", node_ids[0], StopDetail(signal="SIGTERM", signum=15), restarts, stop_t)
            else:
                self.stop(agents, r, "succeeded", node_ids[0], StopDetail(nodes=a.nodes), restarts, stop_t)
            self.t = stop_t + self.rng.uniform(1, 4)
            if done:
                code = 143 if kind == "interrupted" else 0
                for g, ag in enumerate(agents):
                    ag.emit(JobEnd(status="succeeded" if code == 0 else "failed", exit_code=code,
                                   seconds=round(self.t - T0, 3), failures=[]), t=self.t)
                for g in range(a.nodes):
                    for lr in range(a.nproc):
                        monitors[g][lr].emit(MonitorExit(rank=lr, reason="signal SIGTERM"), t=self.t + 0.05)
                return code
            r += 1

    def collective_hang(self, bad: tuple[int, int]) -> tuple[dict[tuple[int, int], float], set[tuple[int, int]]]:
        """Who else shows a collective hang at scale: ranks blocked in it pass their step timeout too (some monitors
        see it before the stop reaches them: rank -> seconds after the first), and some stuck ranks ignore the stop's
        SIGTERM, so their agents SIGKILL them. Per-rank lines by the hundred, once per such round."""
        a, rng = self.args, self.rng
        ranks = [(g, lr) for g in range(a.nodes) for lr in range(a.nproc) if (g, lr) != bad]
        late = {k: round(rng.uniform(0.05, 0.9), 3) for k in ranks if rng.random() < 0.08}
        killed = {k for k in ranks if rng.random() < 0.05}
        return late, killed

    def stop(self, agents: list[EventLog], r: int, kind: str, by: str, detail: StopDetail, restarts: int,
             t: float) -> None:
        for ag in agents:
            ag.emit(RdzvStop(round=r, kind=kind, by_node=by, detail=detail, restart_count=restarts, give_up=False), t=t)

    def jit(self, agents: list[EventLog], r: int, fault: str, lost: list[int], t: float, step: int) -> None:
        """--jit-ckpt: every surviving node's agent logs its ranks' answers; the lowest surviving rank saves, the
        others leave it to that rank (what a 1,024-node job's agents write per fault: one save, 1,023 skips)."""
        nproc = self.args.nproc
        saver = min(x for x in range(len(agents) * nproc) if x not in lost)
        for g, ag in enumerate(agents):
            ranks = [g * nproc + lr for lr in range(nproc) if g * nproc + lr not in lost]
            skip = f"rank {saver} saves the replicated state"
            answers = [JitAnswer(local_rank=x - g * nproc, rank=x, outcome="saved" if x == saver else "skipped",
                                 reason=None if x == saver else skip) for x in ranks]
            if saver in ranks:
                rec = JitCheckpoint(round=r, fault=fault, lost=lost, outcome="saved", step=step, seconds=0.21,
                                    waited=0.24, path=f"/ckpt/jit_step_{step:09d}", answers=answers)
            else:
                rec = JitCheckpoint(round=r, fault=fault, lost=lost, outcome="skipped", waited=0.01, reason=skip,
                                    answers=answers)
            ag.emit(rec, t=t + 0.25)

    def session(self, mon: EventLog, lr: int, pid: int, start: float, end: float, hung: bool,
                global_rank: int = 0, late: float | None = None) -> None:
        """What one rank monitor logs over one round, at the real monitor's rate limits."""
        mon.emit(MonitorConnect(rank=lr, pid=pid, generation=1, timeouts=TIMEOUTS), t=start + 2.0)
        mon.emit(FirstHeartbeat(rank=lr, pid=pid, delay=4.8), t=start + 7.0)
        t, hb, closes, next_stats, next_ckpt, max_step = start + 7.0, 0, 0, start + 7.0, start + CKPT_EVERY, 0.0
        stop_at = end - 60.3 if hung else end
        rng = self.rng
        while t < stop_at:
            t += SECTION_PERIOD
            n = int(SECTION_PERIOD / STEP_S)
            hb += n
            closes += n
            last = STEP_S * rng.uniform(0.97, 1.05)
            max_step = max(max_step, last)
            mon.emit(SectionOpen(rank=lr, section="step", open_for=round(rng.uniform(0, STEP_S), 6)), t=t)
            mon.emit(SectionClose(rank=lr, section="step", closes=n, last_duration=round(last, 6),
                                  max_duration=round(max_step, 6)), t=t + 0.000015)
            if t >= next_stats:
                mon.emit(HeartbeatStats(rank=lr, count=hb, max_interval=round(STEP_S * 1.2, 6),
                                        since_last=round(rng.uniform(0, STEP_S), 6)), t=t + 0.00003)
                next_stats = t + STATS_PERIOD
            if t >= next_ckpt:
                mon.emit(SectionOpen(rank=lr, section="checkpointing", open_for=2.0), t=t + 1)
                mon.emit(SectionClose(rank=lr, section="checkpointing", closes=1, last_duration=8.0, max_duration=8.0),
                         t=t + 9)
                step = int((t - T0) / STEP_S)  # nvrx's checkpointers: the save is complete on every rank
                mon.emit(CheckpointComplete(rank=lr, global_rank=global_rank, pid=pid, step=step, tier="global",
                                            taken=t, path=f"/ckpt/step_{step:09d}"), t=t + 9.2)
                next_ckpt = t + CKPT_EVERY
                if closes > 1000 and lr % 2 == 0:
                    learned = TimeoutsInfo(initial_heartbeat=24.0, heartbeat=5.1,
                                           sections={"step": 5.3, "checkpointing": 40.0}, out_of_section=4.0)
                    mon.emit(TimeoutsSet(rank=lr, updated=True, timeouts=learned, path=f"/state/rank{lr}.timeouts.json"),
                             t=t + 9.5)
        if hung:
            mon.emit(HangDetected(rank=lr, pid=pid, generation=1, reason="section_timeout", section="step", elapsed=60.3,
                                  timeout=60.0, timeouts=TIMEOUTS, signal="SIGKILL"), t=end)
            mon.emit(RankTerminated(rank=lr, pid=pid, signal="SIGKILL", reason="section_timeout"), t=end + 0.001)
        elif late is not None:  # blocked in the hung collective: its step timeout passes just after the first
            mon.emit(HangDetected(rank=lr, pid=pid, generation=1, reason="section_timeout", section="step",
                                  elapsed=round(60.3 + late, 3), timeout=60.0, timeouts=TIMEOUTS, signal="SIGKILL"),
                     t=end + late / 100)
        mon.emit(HeartbeatStats(rank=lr, count=hb, max_interval=round(STEP_S * 1.2, 6), since_last=0.1), t=end + 0.01)
        mon.emit(MonitorDisconnect(rank=lr, pid=pid, generation=1, reason="rank_disconnected"), t=end + 0.02)

    def _damage(self) -> None:
        """A torn last line, a NUL-filled block and a cut-off line mid-file: what crashes leave behind."""
        agent = sorted(self.root.glob("4242/agent-*.jsonl"))[-1]
        with open(agent, "ab") as fh:
            fh.write(b'{"v":1,"t":1700000000.5,"src":"agent","ev":"rdzv_st')
        mon = sorted(self.root.glob(f"{4242 + self.args.jobs - 1}/monitor-*.jsonl"))[0]
        with open(mon, "ab") as fh:
            fh.write(b"\0" * 64 + b"\n")
        mon = sorted(self.root.glob("4242/monitor-*.jsonl"))[-1]
        data = mon.read_bytes().split(b"\n")
        data[len(data) // 2] = data[len(data) // 2][:40]
        mon.write_bytes(b"\n".join(data))


def run_once(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, bytes]:
    """Wall seconds, CPU seconds (user + system of the child) and stdout of one run of CMD."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1):  # grep -c exits 1 when a file has no match
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
    return seconds, cpu, proc.stdout


def peak_rss_mb(cmd: list[str], env: dict[str, str]) -> float:
    """Peak RSS of one run of CMD, measured by a fresh parent that has no other children."""
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, stdout=subprocess.PIPE, check=True).stdout
    return round(int(out) / 1024, 1)


def interleaved(commands: dict[str, tuple[list[str], dict[str, str] | None]], runs: int) -> dict[str, Any]:
    """Run i of every command before run i+1 of any, so load drift on a shared machine hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    outs: dict[str, bytes] = {}
    for _ in range(runs):
        for name, (cmd, env) in commands.items():
            seconds, cpu, outs[name] = run_once(cmd, env)
            times[name].append(seconds)
            cpus[name].append(cpu)
    return {name: {"median_s": statistics.median(times[name]), "runs_s": times[name],
                   "cpu_median_s": statistics.median(cpus[name]), "cpu_runs_s": cpus[name], "stdout": outs[name]}
            for name in commands}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="size of the generated log dir (MB)")
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=0, help="rounds per job (0: until the size is reached)")
    p.add_argument("--round-s", type=lambda v: tuple(float(x) for x in v.split(":")), default=(300.0, 2400.0),
                   help="MIN:MAX simulated seconds a round runs")
    p.add_argument("--ckpt-every", type=float, default=900.0, help="simulated seconds between checkpoints")
    p.add_argument("--scale", action="store_true",
                   help="issue 31's scale run: 1 job, 1024 nodes x 2 ranks, 10 rounds of 60-120 s; adds --html")
    p.add_argument("--keep", type=Path, default=None, help="generate here and keep it (default: a temp dir, removed)")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "inspect.json")
    args = p.parse_args()
    if args.scale:
        vars(args).update(SCALE)
        if args.output == REPO / "bench" / "results" / "inspect.json":
            args.output = REPO / "bench" / "results" / "inspect_scale.json"
    global CKPT_EVERY
    CKPT_EVERY = args.ckpt_every

    load_at_start = list(os.getloadavg())
    root = args.keep or Path(tempfile.mkdtemp(prefix="nvrx-bench-inspect-"))
    if args.keep and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    Chain(root, args).run()
    gen_s = time.perf_counter() - t0
    files = sorted(str(f) for f in root.rglob("*.jsonl"))
    size = sum(os.path.getsize(f) for f in files)
    lines = sum(1 for f in files for _ in open(f, "rb"))
    print(f"generated {size / 1e6:.1f} MB, {lines} lines, {len(files)} files in {gen_s:.1f} s: {root}", file=sys.stderr)

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nvrx_cmd = [sys.executable, "-m", "nvrx", "inspect", "--json"]
    commands: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "nvrx inspect --json": ([*nvrx_cmd, str(root)], env),
        # --since before the first event turns the lazy path off: every line is parsed
        "nvrx inspect --json (parse all)": ([*nvrx_cmd, "--since", "2000-01-01T00:00:00", str(root)], env),
    }
    html_path = root.parent / f"{root.name}-report.html"
    if args.scale:
        commands["nvrx inspect (text)"] = ([sys.executable, "-m", "nvrx", "inspect", str(root)], env)
        commands["nvrx inspect --html"] = ([sys.executable, "-m", "nvrx", "inspect", "--html", str(html_path),
                                            str(root)], env)
    rss_mb = peak_rss_mb(commands["nvrx inspect --json"][0], env)
    if shutil.which("grep"):
        commands["grep -c rdzv_stop"] = (["grep", "-c", '"ev":"rdzv_stop"', *files], None)
    if shutil.which("jq"):
        commands["jq -R fromjson? select"] = (["jq", "-c", "-R", 'fromjson? | select(.ev == "rdzv_stop")', *files], None)
    results = interleaved(commands, args.runs)
    nvrx = results["nvrx inspect --json"]
    report = json.loads(nvrx["stdout"])
    nvrx["max_rss_mb"] = rss_mb
    for r in results.values():
        r.pop("stdout")
    base, base_cpu = nvrx["median_s"], nvrx["cpu_median_s"]
    for name, r in results.items():
        r["mb_per_s"] = round(size / 1e6 / r["median_s"], 1)
        r["nvrx_over_this"] = round(base / r["median_s"], 3)
        r["nvrx_over_this_cpu"] = round(base_cpu / r["cpu_median_s"], 3) if r["cpu_median_s"] > 0 else None

    extra: dict[str, Any] = {}
    if args.scale:
        extra = scale_checks(root, html_path, env)
    summary = {"jobs": len(report["jobs"]), "rounds": sum(len(j["rounds"]) for j in report["jobs"]),
               "faults": len(report["faults"]), "corrupt_lines": report["corrupt"]["count"],
               "uptime": report["uptime"], "goodput": report["goodput"], "goodput_source": report["goodput_source"]}
    out = {"machine": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": platform.python_version(),
                       "platform": platform.platform(), "cpu_count": os.cpu_count(),
                       "load_avg_at_start": load_at_start, "load_avg_at_end": list(os.getloadavg())},
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "log_dir": {"bytes": size, "lines": lines, "files": len(files), "generate_s": round(gen_s, 2)},
           "report_summary": summary, "scale": extra,
           "results": {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                       for k, v in results.items()}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")

    print(f"\n{size / 1e6:.1f} MB, {lines} lines, {len(files)} files; median of {args.runs} runs")
    print(f"{'command':34} {'median s':>9} {'MB/s':>8} {'nvrx / this':>12} {'CPU s':>7} {'nvrx / this (CPU)':>18}")
    for name, r in results.items():
        cpu_ratio = f"{r['nvrx_over_this_cpu']:18.2f}" if r["nvrx_over_this_cpu"] is not None else f"{'-':>18}"
        print(f"{name:34} {r['median_s']:9.2f} {r['mb_per_s']:8.1f} {r['nvrx_over_this']:12.2f} "
              f"{r['cpu_median_s']:7.2f} {cpu_ratio}")
    print(f"nvrx inspect peak RSS: {rss_mb} MB for {size / 1e6:.0f} MB of logs")
    print(f"report: {summary}")
    if extra:
        print(f"terminal view: {extra['text_lines']} lines; HTML {extra['html_mb']} MB; Chromium: render "
              f"{extra['chromium_render_s']} s (in-page script done at {extra['page_ready_ms']} ms; blank page "
              f"{extra['chromium_blank_s']} s), script errors {extra['script_errors']}")
    print(f"saved {args.output}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
        html_path.unlink(missing_ok=True)
    return 0


def scale_checks(root: Path, html_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """The terminal view's length, the HTML's size, and its render time in headless Chromium (median of 3)."""
    import re

    from tests.integration import browser

    text = subprocess.run([sys.executable, "-m", "nvrx", "inspect", str(root)], env=env,
                          stdout=subprocess.PIPE, check=True, text=True).stdout  # the default view
    subprocess.run([sys.executable, "-m", "nvrx", "inspect", "--html", str(html_path), str(root)], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    out: dict[str, Any] = {"text_lines": text.count("\n"), "timeline_lines": _section_lines(text, "Timeline"),
                           "html_mb": round(html_path.stat().st_size / 1e6, 2)}
    if browser.chromium() is None:
        return out | {"chromium_render_s": None, "page_ready_ms": None, "chromium_blank_s": None,
                      "script_errors": "no chromium (scripts/install_chromium.sh)"}
    blank = html_path.parent / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body>blank</body></html>")
    walls, blanks, ready, errors = [], [], [], []
    for _ in range(3):
        shown = browser.render(html_path)
        walls.append(shown.seconds)
        errors += shown.script_errors
        m = re.search(r'data-ready="(\d+)"', shown.dom)
        ready.append(int(m.group(1)) if m else None)
        blanks.append(browser.render(blank).seconds)
    blank.unlink()
    render = statistics.median(walls) - statistics.median(blanks)  # the page's own cost over starting Chromium
    return out | {"chromium_render_s": round(render, 3), "chromium_wall_s": [round(w, 3) for w in walls],
                  "chromium_blank_s": round(statistics.median(blanks), 3), "page_ready_ms": ready,
                  "script_errors": errors}


def _section_lines(text: str, title: str) -> int:
    """Lines of one section of the plain-text report (up to the next blank line)."""
    lines = text.splitlines()
    if title not in lines:
        return 0
    i = lines.index(title) + 1
    n = 0
    while i + n < len(lines) and lines[i + n].strip():
        n += 1
    return n


if __name__ == "__main__":
    sys.exit(main())
