"""The self-tuning checkpoint interval, measured: goodput of ``every_steps="auto"`` against a sweep of fixed ones.

The workload and the fault injector are bench_goodput's (2 ranks DDP + Adam on gloo, ~2.1 M parameters, the
injector SIGKILLs a rank after a set number of seconds of training in each attempt), under ``nvrx launch
--async-ckpt`` with ``nvrx.ckpt.PeriodicCheckpointer(every_steps=N)``. Faults come from a seeded Poisson
process: the training time of each attempt before its fault is exponential with the rate's mean (one schedule
per rate, the same for every interval). ``auto`` is given no MTBF: it learns the failure rate from the job's
own restarts (and, before the first one, from the time run so far).

goodput (wall) = the fault-free wall without checkpoints (one reference run per rate, right before its sweep)
/ the run's wall. goodput (lost) = reference / (reference + the time lost to each fault, measured around the
fault within the run + the time training was blocked in checkpoint calls): insensitive to the step-time drift
of a shared machine between runs minutes apart, but blind to the writer slowing training down from outside. goodput (steps) = (the run's own median step
time / its wall) / (the same for the reference): the whole cost of faults and saves against the step time of the
same minutes (a save that slows fewer than half of the steps is only counted through the wall).
Target: ``auto`` >= the best fixed interval - 0.5 points, at both rates.

Usage (from the repo root)::

    python bench/bench_interval.py                          # 2 rates x (auto + 5 fixed) + 2 references, 4 faults
    python bench/bench_interval.py --rates 15 --every 10,50,200 --faults 3

Prints a table and writes bench/results/interval.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_goodput as bg  # noqa: E402
import bench_launch as bl  # noqa: E402

LOG = logging.getLogger("bench_interval")
AUTO = 0  # RunSpec.every of the auto runs (the script gets "--every auto")
TARGET_POINTS = 0.5

_goodput_command = bg.command


def command(spec: bg.RunSpec, settings: bg.Settings, dirs: bl.RunDirs, run_id: str, launcher: bl.Launcher) -> list[str]:
    """bench_goodput's command; every 0 is every_steps="auto"."""
    cmd = _goodput_command(spec, settings, dirs, run_id, launcher)
    if spec.every == AUTO:
        at = cmd.index("--every")
        cmd[at + 1] = "auto"
    return cmd


def poisson_schedule(seed: int, mean: float, count: int) -> list[bg.Fault]:
    """COUNT faults of a Poisson process of MEAN seconds of training between faults: each attempt's training
    time before its fault is exponential (memoryless: the same process whatever the restarts cost)."""
    rng = random.Random(seed)
    return [bg.Fault(max(0.5, round(rng.expovariate(1.0 / mean), 2)), rng.randrange(bg.WORLD)) for _ in range(count)]


def steps_for(schedule: list[bg.Fault], margin: float, step_s: float) -> int:
    """Training steps long enough for every fault of SCHEDULE to fire: its training time / MARGIN, in steps."""
    return math.ceil(sum(f.after_s for f in schedule) / margin / step_s)


def label(every: int) -> str:
    return "auto" if every == AUTO else str(every)


def run(settings: bg.Settings, rates: list[float], everies: list[int], seed: int, default_faults: int,
        faults: dict[float, int], margin: float, step_s: float, keep: bool,
        repeats: int = 1) -> tuple[list[dict[str, Any]], dict[float, list[bg.Fault]], dict[float, int]]:
    """REPEATS rounds of every rate: its reference, then auto and the fixed intervals, in an order rotated each
    round (no interval always runs first after the reference, on the coolest machine)."""
    table_ = bg.launchers()
    runs, schedules, steps = [], {}, {}
    for rate in rates:
        schedule = schedules[rate] = poisson_schedule(seed + int(rate), rate, faults.get(rate, default_faults))
        steps[rate] = settings.steps or steps_for(schedule, margin, step_s)
        LOG.info("rate 1/%g s: %d steps, faults at %s", rate, steps[rate],
                 ", ".join(f"{f.after_s:g}s/r{f.rank}" for f in schedule))
    for repeat in range(repeats):
        for rate in rates:
            rate_settings = bg.Settings(**{**asdict(settings), "faults": len(schedules[rate]), "steps": steps[rate],
                                           "run_timeout": steps[rate] * 0.2 + 600})
            shift = repeat % len(everies)
            order = everies[shift:] + everies[:shift]
            specs = [bg.RunSpec("nvrx", f"interval{rate:g}", "none", "none", 10)]
            specs += [bg.RunSpec("nvrx", f"interval{rate:g}", "crash", "nvrx", every) for every in order]
            for spec in specs:
                runs.append(_one(spec, rate, repeat, rate_settings, schedules[rate], table_, keep))
    return runs, schedules, steps


def _one(spec: bg.RunSpec, rate: float, repeat: int, settings: bg.Settings, schedule: list[bg.Fault],
         table_: Any, keep: bool) -> dict[str, Any]:
    load = os.getloadavg()[0]
    result = bg.execute(spec, settings, schedule, table_, keep)
    result.load = load
    every = label(spec.every) if spec.kind != "none" else "reference"
    LOG.log(logging.INFO if result.ok else logging.WARNING, "round %d rate %g every %s: %s (load %.1f)", repeat,
            rate, every, f"wall {result.wall_s:.1f} s, {len(result.faults)} fault(s)" if result.ok
            else f"FAILED: {result.error}; kept {result.run_dir}", load)
    return {"rate_s": rate, "every": every, "repeat": repeat, "result": result}


def chosen_intervals(result: bg.RunResult) -> list[dict[str, Any]] | None:
    """The intervals the auto run's rank 0 chose, in order (its monitor's checkpoint_interval events)."""
    return (result.monitor or {}).get("intervals")


_monitor_facts = bg.monitor_facts


def monitor_facts(logs: Path) -> dict[str, Any] | None:
    """bench_goodput's facts from the monitors' events, plus the checkpoint intervals auto chose (and why)."""
    from nvrx.events import read_events

    facts = dict(_monitor_facts(logs) or {})
    events = [e for f in sorted(logs.rglob("monitor-*.jsonl")) for e in read_events(f)
              if isinstance(e, dict) and e.get("ev") == "checkpoint_interval"]
    facts["intervals"] = [{k: e.get(k) for k in ("t", "every_steps", "mtbf_s", "save_cost_s", "step_s", "drain_s", "why")}
                          for e in sorted(events, key=lambda e: e.get("t", 0))]
    return facts


METRICS = ("goodput_wall", "goodput_lost", "goodput_steps")


def summarize(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows per run (each against its own round's reference), rows per rate and interval (medians over the
    rounds), and the targets."""
    rows = [row for rate, repeat in sorted({(r["rate_s"], r.get("repeat", 0)) for r in runs})
            for row in _round_rows([r for r in runs if r["rate_s"] == rate and r.get("repeat", 0) == repeat])]
    table = [_median_row(rate, every, [row for row in rows if row["rate_s"] == rate and row["every"] == every])
             for rate in sorted({row["rate_s"] for row in rows})
             for every in dict.fromkeys(row["every"] for row in rows if row["rate_s"] == rate)]
    goals = [_goal(rate, metric, rows, table) for rate in sorted({row["rate_s"] for row in rows}) for metric in METRICS]
    return rows, table, goals


def _round_rows(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One round of one rate: each run's figures against that round's fault-free reference."""
    ref = next((r["result"] for r in mine if r["every"] == "reference" and r["result"].ok), None)
    rows = []
    for r in mine:
        res: bg.RunResult = r["result"]
        row: dict[str, Any] = {"rate_s": r["rate_s"], "repeat": r.get("repeat", 0), "every": r["every"], "ok": res.ok,
                               "error": res.error, "wall_s": res.wall_s, "faults": len(res.faults), "load": res.load,
                               "ckpt_blocked_s": res.ckpt_blocked_s, "step_median_s": res.step_median_s,
                               "lost_per_fault_s": bg.med([f["lost"] for f in res.faults if "lost" in f]),
                               "recompute_per_fault_s": bg.med([f["recompute"] for f in res.faults if "recompute" in f])}
        if res.ok and res.wall_s and res.step_median_s and ref is not None and ref.wall_s and ref.step_median_s:
            # the work in the run's own median steps (the load of its own minutes) over its wall, against the
            # same for the reference (start-up, the last step: the same in both)
            row["goodput_steps"] = (res.step_median_s / res.wall_s) / (ref.step_median_s / ref.wall_s)
        if res.ok and ref is not None and ref.wall_s and res.wall_s:
            row["goodput_wall"] = ref.wall_s / res.wall_s
            if res.faults:
                lost = bg.covered([(f["t_fault"], f["t_fault"] + f["lost"]) for f in res.faults])
                row["goodput_lost"] = ref.wall_s / (ref.wall_s + lost + (res.ckpt_blocked_s or 0.0))
        rows.append(row)
    return rows


def _median_row(rate: float, every: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one rate and interval over its rounds (with each goodput's lowest and highest)."""
    row: dict[str, Any] = {"rate_s": rate, "every": every, "runs": len(rows), "failed": sum(not r["ok"] for r in rows)}
    for key in ("wall_s", "faults", "load", "ckpt_blocked_s", "step_median_s", "lost_per_fault_s",
                "recompute_per_fault_s", *METRICS):
        values = [r[key] for r in rows if r.get(key) is not None]
        row[key] = bg.med(values)
        if key in METRICS and values:
            row[key + "_range"] = [min(values), max(values)]
    return row


def _goal(rate: float, metric: str, rows: list[dict[str, Any]], table: list[dict[str, Any]]) -> dict[str, Any]:
    """auto >= the best fixed interval (highest median) - 0.5 points, judged round by round: met (or missed)
    only when every round says so; rounds that disagree leave it unresolved (the noise is larger than 0.5)."""
    fixed = [t for t in table if t["rate_s"] == rate and t["every"] not in ("auto", "reference")
             and t.get(metric) is not None]
    auto = next((t for t in table if t["rate_s"] == rate and t["every"] == "auto"), None)
    best = max(fixed, key=lambda t: t[metric]) if fixed else None
    goal: dict[str, Any] = {"target": f"rate 1/{rate:g} s: auto {metric} >= best fixed - {TARGET_POINTS} points",
                            "value": auto.get(metric) if auto else None,
                            "best_fixed": best[metric] if best else None,
                            "best_every": best["every"] if best else None, "met": None}
    if best is None or auto is None or auto.get(metric) is None:
        return goal
    by_round = {r["repeat"]: r for r in rows if r["rate_s"] == rate and r["every"] == "auto" and r.get(metric) is not None}
    diffs = [by_round[r["repeat"]][metric] - r[metric] for r in rows if r["rate_s"] == rate
             and r["every"] == best["every"] and r.get(metric) is not None and r["repeat"] in by_round]
    goal["round_differences"] = diffs
    passed = [d >= -TARGET_POINTS / 100 for d in diffs]
    goal["met"] = True if passed and all(passed) else False if passed and not any(passed) else None
    return goal


def report(runs: list[dict[str, Any]], schedules: dict[float, list[bg.Fault]], steps: dict[float, int],
           settings: bg.Settings, output: Path, extra: dict[str, Any]) -> None:
    rows, table, goals = summarize(runs)
    rounds = max((r.get("repeat", 0) for r in runs), default=0) + 1

    def span(row: dict[str, Any], metric: str) -> str:
        value, lo_hi = row.get(metric), row.get(metric + "_range")
        text = bg.fmt(value, "")
        return text if not lo_hi or row["runs"] < 2 else f"{text} ({lo_hi[0]:.3f}-{lo_hi[1]:.3f})"

    header = ["rate", "every", "runs", "wall s", "lost/fault", "recompute", "blocked s", "goodput wall",
              "goodput lost", "goodput steps", "load"]
    body = [[f"1/{row['rate_s']:g}s", row["every"], f"{row['runs'] - row['failed']}/{row['runs']}",
             bg.fmt(row["wall_s"]), bg.fmt(row["lost_per_fault_s"]), bg.fmt(row["recompute_per_fault_s"]),
             bg.fmt(row["ckpt_blocked_s"]), span(row, "goodput_wall"), span(row, "goodput_lost"),
             span(row, "goodput_steps"), "-" if row["load"] is None else f"{row['load']:.1f}"] for row in table]
    bl.print_table(header, body, f"checkpoint interval sweep: {bg.WORLD} ranks DDP+Adam gloo, Poisson faults (crash) "
                                 "at " + ", ".join(f"1/{r:g} s ({len(s)} faults, {steps[r]} steps)"
                                                   for r, s in schedules.items())
                   + f"; medians of {rounds} round(s)")
    for r in runs:
        if r["every"] == "auto":
            chosen = chosen_intervals(r["result"]) or []
            print(f"  rate 1/{r['rate_s']:g} s, round {r.get('repeat', 0)}, auto chose: "
                  + (" -> ".join(str(c["every_steps"]) for c in chosen) or "-")
                  + (f"; the last because {chosen[-1]['why']}" if chosen else ""))
    for goal in goals:
        value, best = goal["value"], goal["best_fixed"]
        diffs = ", ".join(f"{100 * d:+.1f}" for d in goal.get("round_differences") or [])
        verdict = {True: "met", False: "MISSED", None: "unresolved (the rounds disagree)" if diffs else ""}[goal["met"]]
        print(f"  {goal['target']}: {'-' if value is None else f'{value:.4f}'} (best fixed "
              f"{'-' if best is None else f'{best:.4f}'} at every {goal['best_every']}; auto - best per round, "
              f"points: {diffs or '-'}) {verdict}")
    bl.save_json(output, {**extra, "settings": asdict(settings), "steps": {f"{r:g}": n for r, n in steps.items()},
                          "schedules": {f"{rate:g}": [asdict(f) for f in s] for rate, s in schedules.items()},
                          "rows": rows, "table": table, "targets": goals,
                          "runs": [{"rate_s": r["rate_s"], "every": r["every"], "repeat": r.get("repeat", 0),
                                    **{**asdict(r["result"]), "progress": r["result"].progress}} for r in runs]})
    print(f"\nsaved {output}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="15,60",
                   help="mean seconds of training between faults, comma list; RATE:N runs N faults at that rate")
    p.add_argument("--every", default="10,20,50,100,200", help="the fixed intervals (steps), comma list")
    p.add_argument("--faults", type=int, default=4, help="faults per run (the Poisson schedule's first N)")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: enough for the faults to fire)")
    p.add_argument("--pause", type=float, default=0.01)
    p.add_argument("--step-s", type=float, default=0.03, help="expected seconds per step (to fit the schedule)")
    p.add_argument("--margin", type=float, default=0.85, help="the faults fit in this share of the training time")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--output", type=Path, default=bg.RESULTS / "interval.json")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every rate (each with its own reference; the targets are judged round by round)")
    p.add_argument("--keep-run-dirs", action="store_true")
    p.add_argument("--from-json", type=Path, help="summarize a saved run again")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    pairs = [x.split(":") for x in args.rates.split(",") if x]
    try:
        rates = [float(x[0]) for x in pairs]
        per_rate = {float(x[0]): int(x[1]) for x in pairs if len(x) > 1}
    except ValueError:
        p.error("--rates: comma list of RATE or RATE:FAULTS")
    everies = [AUTO, *(int(x) for x in args.every.split(",") if x)]
    if (not rates or any(not math.isfinite(r) or r <= 0 for r in rates) or any(e < 0 for e in everies)
            or args.faults < 1 or args.repeats < 1):
        p.error("--rates must be positive seconds, --every positive steps, --faults and --repeats >= 1")
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        runs = []
        for raw in data["runs"]:
            fields = {k: v for k, v in raw.items() if k in bg.RunResult.__dataclass_fields__}
            fields["spec"] = bg.RunSpec(**raw["spec"])
            runs.append({"rate_s": raw["rate_s"], "every": raw["every"], "repeat": raw.get("repeat", 0),
                         "result": bg.RunResult(**fields)})
        schedules = {float(r): [bg.Fault(**f) for f in fs] for r, fs in data["schedules"].items()}
        settings = bg.Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["settings"].items()})
        extra = {k: data[k] for k in ("machine", "elapsed_s", "load_start", "load_end", "command") if k in data}
        report(runs, schedules, {float(r): n for r, n in data["steps"].items()}, settings, args.output, extra)
        return 0
    base, _ = bg.parse_args(["--steps", str(args.steps), "--faults", str(args.faults), "--kinds", "crash",
                             "--pause", str(args.pause),
                             "--launchers", "nvrx", "--variants", "every10"])
    settings = bg.Settings(**{**asdict(base), "variants": ("interval",)})
    bg.command, bg.monitor_facts = command, monitor_facts
    started, load = time.monotonic(), os.getloadavg()[0]
    runs, schedules, steps = run(settings, rates, everies, args.seed, args.faults, per_rate, args.margin, args.step_s,
                                 args.keep_run_dirs, args.repeats)
    report(runs, schedules, steps, settings, args.output, {
        "machine": bl.machine_info(), "elapsed_s": time.monotonic() - started, "load_start": load,
        "load_end": os.getloadavg()[0], "command": ["python", "bench/bench_interval.py", *(argv or sys.argv[1:])]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
