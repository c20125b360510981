"""Hang-detection benchmark: nvrx's monitor-driven restart vs torchrun's crash restart, side by side.

One 2-rank CPU/gloo job per run (``--standalone --nproc-per-node 2 --max-restarts 1``); rank 1 of
attempt 0 either hangs (stops heartbeating, ``time.sleep``) or crashes (``sys.exit(1)``):

* nvrx hang:   ``nvrx launch ... --ft-param-rank-heartbeat-timeout 2`` (default check interval).
               (a) last heartbeat -> rank 1 killed by its monitor (``rank_terminated`` event),
               overshoot = (a) - timeout; (b) last heartbeat -> all ranks of attempt 1 running again
               (group re-initialised + first barrier); (c) restart part = (b) - (a).
* crash:       nvrx, torchrun (shared rendezvous store) and torchrun-noshare, same script:
               crash -> all ranks running again.

Ratios: nvrx's restart part (c) / torchrun's crash restart, and nvrx crash / torchrun crash.

Usage (from the repo root)::

    python bench/bench_detection.py [--runs 3] [--peers torchrun-noshare,torchrun]

Prints a table and writes everything to bench/results/detection.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_launch as bl  # noqa: E402  (shared launcher table, env, cleanup, table and JSON helpers)

LOG = logging.getLogger("bench_detection")

DEFAULT_OUTPUT = BENCH_DIR / "results" / "detection.json"
HB_TIMEOUT_S = 2.0
MAX_RESTARTS = 1
FAULT_STEP = 10  # rank 1 hangs/crashes at this step of attempt 0 (~0.5 s of 50 ms steps after the group is up)
PG_TIMEOUT_S = 10.0  # a round stuck on a dead peer's address fails in bounded time
PEERS = ("torchrun-noshare", "torchrun")
LAUNCHERS = ("nvrx", *PEERS)
POLL_S = 0.002

# ft_launcher measured on this machine (issue 3), with a 3 s heartbeat timeout and a 0.5 s check interval.
REFERENCE = {"timeout_s": 3.0, "check_interval_s": 0.5, "detect_s": 3.39, "back_s": 6.75}

# Written into each run's dir and started by the launcher on every rank. Plain stdlib + torch; the
# monitor client only with heartbeats on (nvrx), since it refuses to run outside `nvrx launch`.
RANK_SCRIPT = r'''
import datetime, json, os, sys, time
T_START = time.time()
out, mode, fault_step, heartbeats, pg_timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", float(sys.argv[5])
rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

def record(name, payload):
    tmp = os.path.join(out, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(payload, fh)
    os.replace(tmp, os.path.join(out, name))

import torch.distributed as dist
t_imported = time.time()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))
dist.barrier()
record(f"ready-a{attempt}-r{rank}.json", {"rank": rank, "attempt": attempt, "pid": os.getpid(),
                                          "t_start": T_START, "t_imported": t_imported,
                                          "t_ready": time.time()})
if attempt > 0:
    dist.destroy_process_group()
    sys.exit(0)
beat = lambda: None
if heartbeats:
    from nvrx.monitors import RankMonitorClient
    client = RankMonitorClient()
    client.init_workload_monitoring()
    beat = client.send_heartbeat
deadline = time.monotonic() + 120
step = 0
while time.monotonic() < deadline:
    beat()
    t_beat = time.time()  # kept in memory; written only once, right before the fault
    if rank == 1 and step == fault_step:
        if mode == "hang":
            record("fault-r1.json", {"kind": "hang", "pid": os.getpid(), "step": step, "t_last_heartbeat": t_beat})
            time.sleep(1000)
        record("fault-r1.json", {"kind": "crash", "pid": os.getpid(), "step": step, "t_fault": time.time()})
        sys.exit(1)
    time.sleep(0.05)
    step += 1
sys.exit(3)  # attempt 0 was never interrupted
'''


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


def build_command(launcher: bl.Launcher, dirs: bl.RunDirs, script: Path, run_id: str, mode: str) -> list[str]:
    flags = ["--standalone", "--nproc-per-node", str(bl.NPROC), "--max-restarts", str(MAX_RESTARTS),
             "--rdzv-id", run_id, "--log-dir", str(dirs.logs)]
    heartbeats = launcher.name == "nvrx"
    if heartbeats:
        flags += ["--ft-param-rank-heartbeat-timeout", f"{HB_TIMEOUT_S:g}"]
    args = [str(dirs.out), mode, str(FAULT_STEP), "1" if heartbeats else "0", f"{PG_TIMEOUT_S:g}"]
    return [*launcher.prefix, *flags, str(script), *args]


def start(launcher: bl.Launcher, dirs: bl.RunDirs, mode: str) -> tuple[subprocess.Popen, str, float]:
    """Start the launcher on the rank script; returns (process, run id, time just before Popen)."""
    script = dirs.root / "detect_rank.py"
    script.write_text(RANK_SCRIPT)
    run_id = f"bench-{uuid.uuid4().hex[:12]}"
    cmd = build_command(launcher, dirs, script, run_id, mode)
    console = open(dirs.console, "wb")  # noqa: SIM115 - closed by bl.finish_run
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=bl.REPO_ROOT, env=bl.build_env(launcher, run_id), stdin=subprocess.DEVNULL,
                            stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
    proc._bench_console = console  # type: ignore[attr-defined]
    LOG.debug("started %s pid=%d: %s", launcher.name, proc.pid, " ".join(cmd))
    return proc, run_id, t0


def wait_for_file(proc: subprocess.Popen, path: Path, deadline: float) -> dict[str, Any] | None:
    while time.time() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    return json.loads(path.read_text()) if path.exists() else None


def _gone(pid: int) -> bool:
    """True once the process is dead (exited or a zombie not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def wait_gone(pid: int, deadline: float) -> float | None:
    """Time the bench saw ``pid`` dead (polled every 2 ms); None if it was still alive at the deadline."""
    while time.time() < deadline:
        if _gone(pid):
            return time.time()
        time.sleep(POLL_S)
    return None


def read_events(logs: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(logs.rglob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def first_event(events: list[dict[str, Any]], ev: str, **match: Any) -> dict[str, Any] | None:
    return next((e for e in events if e.get("ev") == ev and all(e.get(k) == v for k, v in match.items())), None)


def run_fault(launcher: bl.Launcher, mode: str, index: int, timeout: float, restart_timeout: float,
              keep_all: bool) -> bl.Sample:
    """One run: rank 1 hangs or crashes in attempt 0; time until both ranks of attempt 1 are up."""
    dirs = bl.RunDirs.create(launcher.name, mode)
    sample = bl.Sample(launcher.name, mode, index, ok=False)
    proc, run_id, t0 = start(launcher, dirs, mode)
    try:
        fault = wait_for_file(proc, dirs.out / "fault-r1.json", t0 + timeout)
        if fault is None:
            sample.error = f"rank 1 never reached its fault step (launcher rc={proc.poll()})"
            return sample
        t_fault = fault["t_last_heartbeat"] if mode == "hang" else fault["t_fault"]
        if mode == "hang":  # do not poll while the monitor is still counting down
            time.sleep(max(0.0, t_fault + HB_TIMEOUT_S - 0.2 - time.time()))
        t_gone = wait_gone(fault["pid"], t_fault + restart_timeout)
        again = bl.wait_for_records(proc, dirs.out, "ready", 1, t_fault + restart_timeout)
        if again is None:
            sample.error = (f"attempt 1 not running {time.time() - t_fault:.1f} s after the {mode} "
                            f"(launcher rc={proc.poll()}, attempts that got ready: {bl.attempts_seen(dirs.out)})")
            return sample
        t_back = max(r["t_ready"] for r in again)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        sample.detail.update(launcher_rc=rc, fault_step=fault["step"], back_to_launcher_exit_s=time.time() - t_back,
                             **phases(dirs.out, t0, t_fault, again))
        if t_gone is not None:  # an independent check of the kill time: /proc polled by this process
            sample.detail["dead_seen_by_bench_s"] = t_gone - t_fault
        if rc != 0:
            sample.error = f"attempt 1 came back, but the launcher then exited with rc={rc}"
            return sample
        if mode == "hang":
            return measure_hang(sample, read_events(dirs.logs), fault, t_back)
        sample.values = {"crash_to_running": t_back - t_fault}
        if t_gone is not None:
            sample.values.update(crash_teardown=t_gone - t_fault, gone_to_running=t_back - t_gone)
        sample.ok = True
        return sample
    finally:
        bl.finish_run(proc, run_id, sample, dirs, keep_all)


def phases(out: Path, t0: float, t_fault: float, again: list[dict[str, Any]]) -> dict[str, float]:
    """Where the time went (max over ranks): startup of attempt 0, and attempt 1's way back after the fault."""
    first = bl.read_records(out, "ready", 0) or []
    return {"startup_s": max((r["t_ready"] for r in first), default=t0) - t0,
            "fault_to_user_code": max(r["t_start"] for r in again) - t_fault,
            "import_torch": max(r["t_imported"] - r["t_start"] for r in again),
            "init_pg": max(r["t_ready"] - r["t_imported"] for r in again)}


def measure_hang(sample: bl.Sample, events: list[dict[str, Any]], fault: dict[str, Any], t_back: float) -> bl.Sample:
    """Detection numbers from the monitor's and the agent's JSON-lines events."""
    t_hb = fault["t_last_heartbeat"]
    hang = first_event(events, "hang_detected", rank=1, pid=fault["pid"])
    killed = first_event(events, "rank_terminated", rank=1, pid=fault["pid"])
    exited = first_event(events, "rank_exit", rank=1, attempt=0)
    others = [e for e in events if e.get("ev") == "hang_detected" and e is not hang]
    if hang is None or killed is None:
        sample.error = "no hang_detected/rank_terminated event for rank 1 in the monitor logs"
        return sample
    sample.detail.update(reason=hang["reason"], monitor_elapsed_s=hang["elapsed"], timeout_in_force=hang["timeout"],
                         signal=killed.get("signal"), other_hangs_detected=len(others))
    if hang["reason"] != "heartbeat_timeout" or others:
        sample.error = f"unexpected detection: {hang['reason']}, {len(others)} other hang event(s)"
        return sample
    detect = killed["t"] - t_hb
    back = t_back - t_hb
    sample.values = {"detect": detect, "overshoot": detect - HB_TIMEOUT_S, "hang_to_running": back,
                     "restart_part": back - detect}
    if exited is not None:
        sample.values["agent_saw_exit"] = exited["t"] - t_hb
    sample.ok = True
    return sample


# --------------------------------------------------------------------------------------------
# Summary and table
# --------------------------------------------------------------------------------------------

# (metric key, kind of run, label)
METRICS = (
    ("detect", "hang", "hang: last beat -> killed (a)"),
    ("overshoot", "hang", "hang: overshoot, (a) - timeout"),
    ("agent_saw_exit", "hang", "hang: last beat -> agent saw exit"),
    ("hang_to_running", "hang", "hang -> all running again (b)"),
    ("restart_part", "hang", "hang: restart part, (b) - (a)"),
    ("crash_to_running", "crash", "crash -> all running again"),
    ("crash_teardown", "crash", "crash: exit(1) -> rank dead"),
    ("gone_to_running", "crash", "crash: dead -> all running again"),
)


def summarize(samples: list[bl.Sample], launchers: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for name in launchers:
        summary[name] = {}
        for metric, kind, _ in METRICS:
            runs = [s for s in samples if s.launcher == name and s.kind == kind]
            if not runs:
                continue
            values = [s.values[metric] for s in runs if s.ok and metric in s.values]
            summary[name][metric] = {
                "median": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "n_ok": len(values), "n_runs": len(runs), "failures": len(runs) - len(values),
            }
    return summary


def median(summary: dict[str, dict[str, Any]], name: str, metric: str) -> float | None:
    return summary.get(name, {}).get(metric, {}).get("median")


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compute_ratios(summary: dict[str, dict[str, Any]], peers: list[str]) -> dict[str, dict[str, float | None]]:
    """Per peer: nvrx hang restart part / peer crash restart (as asked), the same against the peer's
    restart counted from the crashed rank's death (no exit teardown in it, like the SIGKILLed rank),
    and nvrx crash / peer crash (like for like)."""
    part = median(summary, "nvrx", "restart_part")
    return {peer: {
        "restart_part/crash_to_running": div(part, median(summary, peer, "crash_to_running")),
        "restart_part/gone_to_running": div(part, median(summary, peer, "gone_to_running")),
        "crash_to_running": div(median(summary, "nvrx", "crash_to_running"), median(summary, peer, "crash_to_running")),
        "gone_to_running": div(median(summary, "nvrx", "gone_to_running"), median(summary, peer, "gone_to_running")),
    } for peer in peers}


def targets(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    def verdict(metric: str, bound: float) -> bool | None:
        entry = summary.get("nvrx", {}).get(metric)
        if not entry:
            return None
        return entry["median"] is not None and entry["median"] <= bound and not entry["failures"]

    bound_back = HB_TIMEOUT_S + 0.75
    return {"overshoot": {"target": "<= 0.25 s", "met": verdict("overshoot", 0.25)},
            "detect": {"target": f"<= {HB_TIMEOUT_S + 0.25:.2f} s", "met": verdict("detect", HB_TIMEOUT_S + 0.25)},
            "hang_to_running": {"target": f"<= {bound_back:.2f} s", "met": verdict("hang_to_running", bound_back)}}


def reference_column() -> dict[str, str]:
    r = REFERENCE
    return {"detect": f"{r['detect_s']:.2f} s", "overshoot": f"{r['detect_s'] - r['timeout_s']:.2f} s",
            "hang_to_running": f"{r['back_s']:.2f} s", "restart_part": f"{r['back_s'] - r['detect_s']:.2f} s"}


def fmt_ratio(value: float | None) -> str:
    """Like bench_launch's, with one more digit for ratios far below 1."""
    if value is None:
        return "-"
    return f"{value:.3f}x" if value < 0.1 else f"{value:.2f}x"


def fmt(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "-"
    text = "-" if entry["median"] is None else f"{entry['median']:.3f} s"
    return text + (f" (fail {entry['failures']}/{entry['n_runs']})" if entry["failures"] else "")


def table_rows(summary: dict[str, dict[str, Any]], launchers: list[str], peers: list[str],
               ratios: dict[str, dict[str, float | None]]) -> tuple[list[str], list[list[str]]]:
    ref, goals = reference_column(), targets(summary)
    header = ["metric", *launchers, *(f"nvrx/{p.replace('torchrun-', '')}" for p in peers),
              f"ft_launcher ({REFERENCE['timeout_s']:g} s)", "target", "met"]
    rows = []
    for metric, _, label in METRICS:
        goal = goals.get(metric, {})
        ratio_key = {"restart_part": "restart_part/crash_to_running", "crash_to_running": "crash_to_running",
                     "gone_to_running": "gone_to_running"}.get(metric)
        rows.append([
            label,
            *(fmt(summary[name].get(metric)) for name in launchers),
            *(fmt_ratio(ratios[p][ratio_key]) if ratio_key else "" for p in peers),
            ref.get(metric, ""),
            goal.get("target", ""),
            {True: "yes", False: "NO", None: ""}[goal.get("met")],
        ])
    return header, rows


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark nvrx hang detection + restart against torchrun's crash restart.")
    p.add_argument("--runs", type=int, default=3, help="measured runs per launcher and fault (default 3)")
    p.add_argument("--peers", type=lambda v: bl.parse_list(v, PEERS, "--peers"), default=list(PEERS),
                   help="comma list of references: torchrun-noshare,torchrun (default both)")
    bl.add_run_options(p, DEFAULT_OUTPUT, timeout=60.0, restart_timeout=15.0)
    return bl.parse_checked(p, argv)


def plan_runs(args: argparse.Namespace, launchers: dict[str, bl.Launcher]) -> list[tuple[str, Callable[[], bl.Sample]]]:
    """Round i of every kind before round i+1, so drifts of machine load hit all of them alike."""
    kinds = [("nvrx", "hang"), ("nvrx", "crash"), *((p, "crash") for p in args.peers)]
    plan = []
    for i in range(args.runs):
        for name, mode in kinds:
            fn = lambda lau=launchers[name], mode=mode, i=i: run_fault(  # noqa: E731
                lau, mode, i, args.timeout, args.restart_timeout, args.keep_run_dirs)
            plan.append((f"{name} {mode} run {i + 1}/{args.runs}", fn))
    return plan


def describe(sample: bl.Sample) -> str:
    if not sample.ok:
        return f"FAILED: {sample.error}"
    return ", ".join(f"{k} {v:.3f} s" for k, v in sample.values.items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    launchers = bl.make_launchers()
    names = ["nvrx", *args.peers]
    info = bl.machine_info()
    t_start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=False)  # page cache
    samples: list[bl.Sample] = []
    for label, fn in plan_runs(args, launchers):
        sample = fn()
        samples.append(sample)
        LOG.log(logging.INFO if sample.ok else logging.WARNING, "%s: %s", label, describe(sample))
        if not sample.ok and sample.log_tail:
            LOG.warning("  launcher output, last lines (all of it in %s/launcher.log):\n    %s",
                        sample.run_dir, "\n    ".join(line[:300] for line in sample.log_tail[-6:]))
    elapsed = time.monotonic() - t_start

    summary = summarize(samples, names)
    ratios = compute_ratios(summary, args.peers)
    header, rows = table_rows(summary, names, args.peers, ratios)
    print()
    bl.print_table(header, rows, f"hang detection + restart: {bl.NPROC} ranks, gloo/CPU, rank_heartbeat_timeout="
                                 f"{HB_TIMEOUT_S:g} s, default check interval, median of {args.runs} run(s)")
    for peer in args.peers:
        print(f"nvrx hang restart part / {peer} restart counted from the crashed rank's death: "
              f"{fmt_ratio(ratios[peer]['restart_part/gone_to_running'])}")
    bl.save_json(args.output, {
        "machine": info,
        "config": {"runs": args.runs, "launchers": names, "nproc_per_node": bl.NPROC, "max_restarts": MAX_RESTARTS,
                   "rank_heartbeat_timeout_s": HB_TIMEOUT_S, "workload_check_interval_s": "default (5.0)",
                   "fault_step": FAULT_STEP, "pg_timeout_s": PG_TIMEOUT_S, "timeout_s": args.timeout,
                   "restart_timeout_s": args.restart_timeout,
                   "commands": {n: list(launchers[n].prefix) for n in names},
                   "env_overrides": {n: launchers[n].env for n in names}},
        "reference_ft_launcher": REFERENCE,
        "elapsed_s": elapsed,
        "summary": summary,
        "ratios": ratios,
        "targets": targets(summary),
        "samples": [asdict(s) for s in samples],
    })
    print(f"\nelapsed {elapsed:.0f} s; raw samples and summary saved to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
