"""Slurm end-to-end benchmark: graceful stop and auto-resume on the project's test Slurm.

Brings up the same real Slurm as tests/slurm (munged, slurmctld, 3 emulated slurmd; tests/slurm/cluster.py)
and drives the same auto-resume chain (tests/slurm/chain.py: nvrx/slurm/templates/auto_resume.sbatch running
tests/slurm/resumable_train.py on 2 nodes, 1 rank per node, 0.1 s steps). Kinds of run:

* chain:      scancel --signal=TERM once the ranks train -> (a) all ranks stopped with the checkpoint
              saved; the job ends; `nvrx resume` has submitted the continuation -> (b) the job's end to
              the continuation's first training step (all ranks). The continuation runs to the end and
              the chain must be correct (every step once, final weights exact) for the run to count.
* floor:      the same Slurm path without nvrx (the peer for (b)): a 2-node job ends, a job submitted with
              --dependency=afterany on it runs `srun` of a bare torch.distributed script (env from Slurm,
              gloo group, one all-reduce and one 0.1 s step). Its end -> first step is Slurm's own cost.
* time-limit: one job with --time=1 --signal=TERM@20: when the warning's graceful stop completed, counted
              from the job's start and before its limit (Slurm sends it on a 30 s tick, up to 30 s before
              N s are left), and that nvrx resume continued.

Usage (from the repo root, as root, with Slurm installed: scripts/install_slurm.sh)::

    python bench/bench_slurm.py [--runs 3] [--only chain,floor,time-limit]

Prints a table and writes bench/results/slurm.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

import bench_launch as bl  # noqa: E402  (table, machine info and JSON helpers)
from tests.slurm.chain import ResumeChain, wait_end, wait_running  # noqa: E402
from tests.slurm.cluster import ClusterUnavailable, SlurmCluster, wait_until  # noqa: E402

LOG = logging.getLogger("bench_slurm")
DEFAULT_OUTPUT = BENCH_DIR / "results" / "slurm.json"
KINDS = ("chain", "floor", "time-limit")
STEPS, STEP_TIME = 40, 0.1
SIGNAL_AFTER_STEPS = 3
# --time=1 --signal=TERM@20: Slurm sends it on its 30 s tick once less than 20 + 30 s are left, i.e. 10-40 s
# into the job (never before the ranks train).
TIME_LIMIT_WARN = 20

# The peer's job: a bare torch.distributed step under srun, rendezvous from Slurm's variables.
FLOOR_SCRIPT = r'''
import os, sys, time, json
import torch, torch.distributed as dist
os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(30000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
dist.init_process_group("gloo")
t = torch.ones(4)
time.sleep(float(sys.argv[2]))
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json"), "w") as fh:
    json.dump({"first_step": time.time(), "job": os.environ["SLURM_JOB_ID"]}, fh)
dist.destroy_process_group()
'''


def wait_for(what: str, check, timeout: float, poll: float = 0.02):
    """A failed wait fails the run (RuntimeError), not the cluster."""
    return wait_until(what, check, timeout, interval=poll, error=RuntimeError)


def world_events(chain: ResumeChain, job: str, event: str) -> list[dict[str, Any]] | None:
    """The first EVENT of every rank in JOB, once all ranks have one."""
    firsts = []
    for events in chain.by_rank(job).values():
        found = [e for e in events if e["event"] == event]
        if not found:
            return None
        firsts.append(found[0])
    return firsts if len(firsts) == chain.nodes * chain.nproc_per_node else None


def check_chain(chain: ResumeChain, jobs: list[str]) -> None:
    """The run counts only if the chain is right: every step once per rank, exact final weights."""
    for rank, events in chain.by_rank().items():
        steps = [e["step"] for e in events if e["event"] == "step"]
        if steps != list(range(chain.steps)):
            raise RuntimeError(f"rank {rank}: steps lost or repeated: {steps}")
        done = [e for e in events if e["event"] == "finished"]
        if len(done) != 1 or set(done[0]["weights"]) != {chain.expected_weights()}:
            raise RuntimeError(f"rank {rank}: wrong final weights {done}")
    if chain.resume_state()["jobs"] != jobs:
        raise RuntimeError(f"chain jobs {chain.resume_state()['jobs']} != {jobs}")


def run_chain(cluster: SlurmCluster, base: Path, index: int) -> dict[str, Any]:
    chain = ResumeChain(cluster, base / f"chain-{index}", steps=STEPS, step_time=STEP_TIME)
    first = chain.submit()
    chain.wait_steps(first, SIGNAL_AFTER_STEPS)
    step_at_signal = max(e["step"] for e in chain.events() if e["event"] == "step")
    t_signal = chain.signal(first, "--signal=TERM")
    stopped = wait_for("all ranks stopped", lambda: world_events(chain, first, "stopped"), 60)
    t_saved = max(e["t"] for e in stopped)
    info, t_end = chain.wait_end(first)
    if info["ExitCode"] != "3:0":
        raise RuntimeError(f"job {first} ended {info['JobState']} {info['ExitCode']}:\n{chain.output(first)}")
    second = chain.continuation_of(first)
    if second is None:
        raise RuntimeError(f"no continuation submitted:\n{chain.output(first)}")
    t_running = chain.wait_running(second)
    starts = wait_for("continuation ranks started", lambda: world_events(chain, second, "start"), 60)
    firsts = wait_for("continuation's first step", lambda: world_events(chain, second, "step"), 60)
    info2, _ = chain.wait_end(second)
    if info2["ExitCode"] != "0:0":
        raise RuntimeError(f"continuation {second} ended {info2['ExitCode']}:\n{chain.output(second)}")
    check_chain(chain, [first, second])
    stop_step = stopped[0]["step"]
    t_first = max(e["t"] for e in firsts)
    t_resume, t_agents, t_ranks = startup_marks(chain, second)
    return {
        "jobs": [first, second], "step_at_signal": step_at_signal, "stop_step": stop_step,
        "resumed_at_step": starts[0]["step"],
        "stop_s": t_saved - t_signal,
        "stop_steps_after_signal": stop_step - step_at_signal,
        "signal_to_job_end_s": t_end - t_signal,
        "end_to_first_step_s": t_first - t_end,
        "end_to_running_s": t_running - t_end,
        "running_to_ranks_started_s": max(e["t"] for e in starts) - t_running,
        "running_to_resume_up_s": t_resume - t_running,
        "resume_up_to_agents_up_s": t_agents - t_resume,
        "agents_up_to_ranks_spawned_s": t_ranks - t_agents,
        "ranks_spawned_to_ranks_started_s": max(e["t"] for e in starts) - t_ranks,
        "ranks_started_to_first_step_s": t_first - max(e["t"] for e in starts),
    }


def startup_marks(chain: ResumeChain, job: str) -> tuple[float, float, float]:
    """From the event logs of JOB: nvrx resume started, last agent started, last rank spawned."""
    def events(path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    resume = [e for e in events(chain.state_dir / "resume.jsonl") if e.get("ev") == "resume_start"
              and e.get("job_id") == job]
    agents = [events(p) for p in (chain.dir / "nvrx_logs" / job).glob("agent-*.jsonl")]
    agent_up = max(e["t"] for evs in agents for e in evs if e.get("ev") == "agent_start")
    spawned = max(e["t"] for evs in agents for e in evs if e.get("ev") == "rank_start")
    return resume[0]["t"], agent_up, spawned


def run_floor(cluster: SlurmCluster, base: Path, index: int) -> dict[str, Any]:
    run = base / f"floor-{index}"
    (run / "out").mkdir(parents=True)
    (run / "probe.py").write_text(FLOOR_SCRIPT)
    first = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", f"--output={run}/first.out", "--wrap",
                           f"srun sleep {SIGNAL_AFTER_STEPS * STEP_TIME + 1:.1f}", cwd=run)
    second = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", f"--dependency=afterany:{first}",
                            f"--output={run}/second.out", "--wrap",
                            f"srun {sys.executable} probe.py {run / 'out'} {STEP_TIME}", cwd=run)
    _, t_end = wait_end(cluster, first)
    t_running = wait_running(cluster, second)
    info, _ = wait_end(cluster, second)
    records = [json.loads(p.read_text()) for p in (run / "out").glob("rank-*.json")]
    if info["ExitCode"] != "0:0" or len(records) != 2:
        raise RuntimeError(f"floor job {second}: {info['ExitCode']}, {len(records)} ranks:\n"
                           f"{(run / 'second.out').read_text(errors='replace')}")
    t_first = max(r["first_step"] for r in records)
    return {"jobs": [first, second], "end_to_first_step_s": t_first - t_end, "end_to_running_s": t_running - t_end}


def run_time_limit(cluster: SlurmCluster, base: Path, index: int) -> dict[str, Any]:
    chain = ResumeChain(cluster, base / f"time-limit-{index}", steps=2000, step_time=STEP_TIME)
    first = chain.submit("--time=1", f"--signal=TERM@{TIME_LIMIT_WARN}")
    t_running = chain.wait_running(first)
    stopped = wait_for("the time-limit warning's stop", lambda: world_events(chain, first, "stopped"), 75, poll=0.1)
    info, t_end = chain.wait_end(first)
    second = chain.continuation_of(first)
    if second:
        cluster.run("scancel", second, check=False, timeout=15)
    if info["ExitCode"] != "3:0" or not second or {e["signal"] for e in stopped} != {"SIGTERM"}:
        raise RuntimeError(f"job {first}: {info['JobState']} {info['ExitCode']}, continuation {second}:\n"
                           f"{chain.output(first)}")
    return {"jobs": [first, second], "stop_step": stopped[0]["step"],
            "saved_after_job_start_s": max(e["t"] for e in stopped) - t_running,
            "saved_before_limit_s": t_running + 60 - max(e["t"] for e in stopped),
            "job_end_after_start_s": t_end - t_running, "time_limit_s": 60, "signal_option": f"TERM@{TIME_LIMIT_WARN}"}


RUNNERS = {"chain": run_chain, "floor": run_floor, "time-limit": run_time_limit}


def summarize(samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        ok = [s for s in samples if s["kind"] == kind and "error" not in s]
        failed = sum(1 for s in samples if s["kind"] == kind and "error" in s)
        metrics = sorted({k for s in ok for k, v in s.items() if isinstance(v, float)})
        out[kind] = {"n_ok": len(ok), "failures": failed, **{
            m: {"median": statistics.median(s[m] for s in ok), "min": min(s[m] for s in ok),
                "max": max(s[m] for s in ok)} for m in metrics}}
        for m in ("stop_steps_after_signal",):
            vals = [s[m] for s in ok if m in s]
            if vals:
                out[kind][m] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def table(summary: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    def cell(kind: str, metric: str, unit: str = " s") -> str:
        entry = summary.get(kind, {}).get(metric)
        if not entry:
            return ""
        fmt = "{:.3f}" if unit == " s" else "{:g}"
        return f"{fmt.format(entry['median'])}{unit} ({fmt.format(entry['min'])}-{fmt.format(entry['max'])})"

    def ratio(metric: str) -> str:
        a, b = summary.get("chain", {}).get(metric), summary.get("floor", {}).get(metric)
        return f"{a['median'] / b['median']:.2f}x" if a and b and b["median"] else ""

    rows = [
        ["scancel --signal=TERM -> all ranks stopped, state saved", cell("chain", "stop_s"), "", ""],
        ["  steps run after the signal (stop margin 2)", cell("chain", "stop_steps_after_signal", ""), "", ""],
        ["scancel --signal=TERM -> job ended (continuation submitted)", cell("chain", "signal_to_job_end_s"), "", ""],
        ["job end -> continuation's first training step", cell("chain", "end_to_first_step_s"),
         cell("floor", "end_to_first_step_s"), ratio("end_to_first_step_s")],
        ["  job end -> continuation RUNNING (Slurm)", cell("chain", "end_to_running_s"),
         cell("floor", "end_to_running_s"), ratio("end_to_running_s")],
        ["  RUNNING -> all ranks in the loop, checkpoint loaded", cell("chain", "running_to_ranks_started_s"), "", ""],
        ["    RUNNING -> nvrx resume started (batch shell)", cell("chain", "running_to_resume_up_s"), "", ""],
        ["    -> agents started (srun, nvrx launch)", cell("chain", "resume_up_to_agents_up_s"), "", ""],
        ["    -> ranks spawned (rendezvous, fork server imports torch)", cell("chain", "agents_up_to_ranks_spawned_s"),
         "", ""],
        ["    -> ranks in the loop (gloo group, checkpoint loaded)", cell("chain", "ranks_spawned_to_ranks_started_s"),
         "", ""],
        ["  ranks in the loop -> first step done (0.1 s step)", cell("chain", "ranks_started_to_first_step_s"), "", ""],
        [f"--time=1 --signal=TERM@{TIME_LIMIT_WARN}: stop saved, after job start",
         cell("time-limit", "saved_after_job_start_s"), "", ""],
        ["  ... and before the time limit", cell("time-limit", "saved_before_limit_s"), "", ""],
    ]
    fails = [f"{k}: fail {v['failures']}/{v['failures'] + v['n_ok']}" for k, v in summary.items() if v["failures"]]
    if fails:
        rows.append(["failed runs", "; ".join(fails), "", ""])
    return ["metric", "nvrx: median (min-max)", "floor: bare srun+torch", "nvrx/floor"], rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of chain and floor (default 3; time-limit runs once)")
    ap.add_argument("--only", default=",".join(KINDS), type=lambda v: bl.parse_list(v, KINDS, "--only"),
                    help=f"kinds of run, comma-separated ({','.join(KINDS)})")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    ap.add_argument("--keep-run-dirs", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    machine = bl.machine_info()
    cluster = SlurmCluster(nodes=3)
    try:
        cluster.start()
    except ClusterUnavailable as why:
        print(f"bench_slurm: error: no test Slurm: {why}", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="nvrx-bench-slurm-"))
    base.chmod(0o755)
    samples: list[dict[str, Any]] = []
    plan = [(k, i) for i in range(args.runs) for k in args.only if k != "time-limit"]
    plan += [("time-limit", 0)] if "time-limit" in args.only else []
    try:
        for kind, index in plan:
            t0 = time.monotonic()
            try:
                sample = {"kind": kind, "index": index, **RUNNERS[kind](cluster, base, index)}
            except (RuntimeError, AssertionError, subprocess.TimeoutExpired) as exc:
                sample = {"kind": kind, "index": index, "error": str(exc)[-2000:]}
                cluster.cancel_all()
            sample["wall_s"] = round(time.monotonic() - t0, 2)
            LOG.info("%s #%d: %s", kind, index, {k: (round(v, 3) if isinstance(v, float) else v)
                                                 for k, v in sample.items() if k not in ("kind", "index")})
            samples.append(sample)
    finally:
        killed = cluster.stop()
        if not args.keep_run_dirs:
            shutil.rmtree(base, ignore_errors=True)
    summary = summarize(samples)
    header, rows = table(summary)
    bl.print_table(header, rows, f"Slurm graceful stop and auto-resume (2 nodes x 1 rank, median of {args.runs})")
    bl.save_json(args.output, {
        "machine": machine,
        "config": {"runs": args.runs, "kinds": args.only, "nodes": 2, "ranks_per_node": 1, "steps": STEPS,
                   "step_time_s": STEP_TIME, "signal_after_steps": SIGNAL_AFTER_STEPS, "stop_margin_steps": 2,
                   "slurm": {"proctrack": cluster.proctrack, "sched_interval_s": 1,
                             "bringup_s": round(cluster.bringup_seconds, 2)},
                   "template": "nvrx/slurm/templates/auto_resume.sbatch", "script": "tests/slurm/resumable_train.py"},
        "summary": summary,
        "samples": samples,
        "leftover_processes_killed_at_teardown": killed,
    })
    print(f"wrote {args.output}")
    if killed:
        print(f"bench_slurm: warning: processes were still running at tear-down: {killed}", file=sys.stderr)
    return 1 if any("error" in s for s in samples) or killed else 0


if __name__ == "__main__":
    sys.exit(main())
