"""Just-in-time checkpoints, measured: time lost per fault with and without them, side by side with torchrun.

The workload and the fault injector are bench_goodput's (2 ranks DDP + Adam on gloo, ~2.1 M parameters,
SIGKILL for a crash, SIGSTOP for a hang, the same seeded schedule for every run). Three ways to run it, each
checkpointing every 200 steps:

* ``nvrx+jit``: nvrx's ``PeriodicCheckpointer(every_steps=200, save_on_failure=True)`` under
  ``nvrx launch --async-ckpt --jit-ckpt``: on a fault the survivor saves its last completed step;
* ``nvrx``: the same without the just-in-time save (a fault loses the steps since the last periodic save);
* ``torchrun``: ``torchrun`` with ``torch.save`` every 200 steps (the user changed nothing).

Per fault: detect / stop / respawn / init / recompute / lost, as bench_goodput splits them (lost = fault ->
the step reached before the fault is done again). Fault-free, the wall with JIT against without it (the
cost of the step gate: target <= 1.005x), plus the gate's own cost per optimizer step measured in-process.

Usage (from the repo root)::

    python bench/bench_jit.py                   # 1000 steps, 3 faults per run, crash and hang (~20 min)
    python bench/bench_jit.py --steps 600 --faults 2 --interval 8

Prints a table and writes bench/results/jit.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_goodput as bg  # noqa: E402
import bench_launch as bl  # noqa: E402

LOG = logging.getLogger("bench_jit")
VARIANT = "jit200"
WAYS = (("nvrx", "nvrx_jit"), ("nvrx", "nvrx"), ("torchrun-noshare", "torch_save"))
NAMES = {"nvrx_jit": "nvrx+jit", "nvrx": "nvrx", "torch_save": "torchrun+torch.save"}

_goodput_command = bg.command


def command(spec: bg.RunSpec, settings: bg.Settings, dirs: bl.RunDirs, run_id: str, launcher: bl.Launcher) -> list[str]:
    """bench_goodput's command; nvrx+jit adds --async-ckpt --jit-ckpt before the script."""
    cmd = _goodput_command(spec, settings, dirs, run_id, launcher)
    if spec.ckpt == "nvrx_jit":
        at = cmd.index(str(bg.TRAIN))
        cmd[at:at] = ["--async-ckpt", "--jit-ckpt"]
    return cmd


def plan(settings: bg.Settings) -> list[bg.RunSpec]:
    """Fault-free first (the references), then each fault kind; the three ways interleaved."""
    return [bg.RunSpec(launcher, VARIANT, kind, ckpt, settings.save_every)
            for kind in ("none", *settings.kinds) for launcher, ckpt in WAYS]


def gate_cost(steps: int = 2000) -> dict[str, float]:
    """Seconds per optimizer step the JIT step gate adds (its two hooks), in this process: Adam on a tiny model."""
    import torch

    from nvrx.ckpt.jit import StepGate

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()

    def timed() -> float:
        started = time.perf_counter()
        for _ in range(steps):
            opt.step()
        return (time.perf_counter() - started) / steps

    without = min(timed() for _ in range(3))
    gate = StepGate(opt)
    with_gate = min(timed() for _ in range(3))
    gate.remove()
    return {"step_without_s": without, "step_with_gate_s": with_gate, "gate_s": max(0.0, with_gate - without)}


def summarize(results: list[bg.RunResult]) -> list[dict[str, Any]]:
    rows = bg.summarize(results)
    for row, run in zip(rows, results):
        row["way"] = NAMES.get(row["ckpt"], row["ckpt"])
        if run.spec.launcher == "nvrx" and run.spec.kind == "hang":
            measured = [(f, timeout_derived(run, f)) for f in run.faults if "lost" in f]
            warm = [f for f, derived in measured if derived]
            cold = [f for f, derived in measured if not derived]
            row.update(lost_timeout_derived=bg.med([f["lost"] for f in warm]), faults_timeout_derived=len(warm),
                       lost_timeout_warming=bg.med([f["lost"] for f in cold]), faults_timeout_warming=len(cold))
    return rows


def timeout_derived(run: bg.RunResult, fault: dict[str, Any]) -> bool:
    """nvrx's automatic heartbeat timeout of the hung rank was derived before FAULT struck. Before that (the
    first 5 s settle + the warm-up of a job's first attempt) the configured timeout is the bound, and a hang
    is caught when the warm-up ends or the configured timeout passes, whichever comes first."""
    return any(a.get("mode") == "set" and a.get("rank") == fault["rank"] and (a.get("t") or float("inf")) < fault["t_fault"]
               for a in (run.monitor or {}).get("auto_timeouts") or [])


def report(results: list[bg.RunResult], settings: bg.Settings, schedule: list[bg.Fault], output: Path,
           extra: dict[str, Any]) -> None:
    rows = summarize(results)
    header = ["way", "kind", "wall s", "goodput", "detect", "stop", "respawn", "init", "recompute", "lost/fault",
              "redone"]
    body = []
    for row, run in zip(rows, results):
        redone = bg.med([f["steps_redone"] for f in run.faults if "steps_redone" in f])
        body.append([row["way"], row["kind"], bg.fmt(row["wall_s"]), bg.fmt(row.get("goodput"), ""),
                     *(bg.fmt(row[c]) for c in bg.COMPONENTS), "-" if redone is None else f"{redone:g}"])
    bl.print_table(header, body, f"just-in-time checkpoint: {bg.WORLD} ranks DDP+Adam gloo, {settings.steps} steps, "
                                 f"save every {settings.save_every}, {settings.faults} faults per run, schedule "
                                 f"{', '.join(f'{f.after_s:g}s/r{f.rank}' for f in schedule)}")
    by = {(r["ckpt"], r["kind"]): r for r in rows}
    goals = []
    for kind in settings.kinds:
        lost = (by.get(("nvrx_jit", kind)) or {}).get("lost")
        goals.append({"target": f"nvrx+jit lost per {kind} <= 0.5 s", "value": lost,
                      "met": None if lost is None else lost <= 0.5})
        warm = (by.get(("nvrx_jit", kind)) or {}).get("lost_timeout_derived")
        if kind == "hang" and warm is not None:
            n = by[("nvrx_jit", kind)]["faults_timeout_derived"]
            goals.append({"target": f"nvrx+jit lost per hang <= 0.5 s, automatic timeout derived ({n} fault(s))",
                          "value": warm, "met": warm <= 0.5})
    for row in rows:
        if row.get("faults_timeout_warming"):
            print(f"  {row['way']} hang: {row['faults_timeout_warming']} fault(s) before the automatic timeout was "
                  f"derived lost {bg.fmt(row['lost_timeout_warming'])}; {row['faults_timeout_derived']} after it "
                  f"{bg.fmt(row['lost_timeout_derived'])}")
    free_jit, free = by.get(("nvrx_jit", "none")), by.get(("nvrx", "none"))
    pairs = extra.get("free_pairs") or []
    if pairs:  # repeated, order alternating: the median pair's ratio, judged only if the pairs agree within 0.5%
        ratios = sorted(p["wall_ratio"] for p in pairs)
        ratio, spread = bg.med(ratios), (ratios[-1] - ratios[0]) / 2
        goals.append({"target": f"fault-free wall with JIT / without <= 1.005 (median of {len(pairs)} pairs, "
                                f"+-{spread:.4f})", "value": ratio,
                      "met": None if spread > 0.005 and abs(ratio - 1.005) < spread else ratio <= 1.005})
    else:
        ratio = (free_jit["wall_s"] / free["wall_s"]) if free_jit and free and free_jit.get("wall_s") and free.get("wall_s") else None
        goals.append({"target": "fault-free wall with JIT / without <= 1.005 (one pair: noisy)", "value": ratio,
                      "met": None})
    gate = extra.get("gate") or {}
    step_s = (free or {}).get("step_median_s")
    if gate and step_s:
        goals.append({"target": "step gate cost per step / step time (in-process)", "value": gate["gate_s"] / step_s,
                      "met": gate["gate_s"] / step_s <= 0.005})
    for pair in pairs:
        print(f"  fault-free pair {pair['order']}: wall {pair['jit_wall_s']:.2f} / {pair['wall_s']:.2f} s = "
              f"{pair['wall_ratio']:.4f}, step median ratio {pair['step_ratio']:.4f} (load {pair['load']:.1f})")
    for goal in goals:
        value = goal["value"]
        print(f"  {goal['target']}: {'-' if value is None else f'{value:.4f}'} "
              f"{'unresolved (noise)' if goal['met'] is None else ('met' if goal['met'] else 'MISSED')}")
    bl.save_json(output, {**extra, "settings": asdict(settings), "schedule": [asdict(f) for f in schedule],
                          "rows": rows, "targets": goals,
                          "runs": [{**asdict(r), "progress": r.progress} for r in results]})
    print(f"\nsaved {output}")


def free_pairs(settings: bg.Settings, schedule: list[bg.Fault], n: int, keep: bool) -> list[dict[str, Any]]:
    """N more fault-free runs of nvrx with and without JIT, the order flipped every pair (a pair's first run
    meets a colder machine): each pair's wall and step-median ratios (JIT / without)."""
    table = bg.launchers()
    pairs = []
    for i in range(n):
        ways = ("nvrx_jit", "nvrx") if i % 2 == 0 else ("nvrx", "nvrx_jit")
        load = os.getloadavg()[0]
        runs = {ckpt: bg.execute(bg.RunSpec("nvrx", VARIANT, "none", ckpt, settings.save_every), settings, schedule,
                                 table, keep) for ckpt in ways}
        if not all(r.ok and r.wall_s and r.step_median_s for r in runs.values()):
            LOG.warning("fault-free pair %d failed: %s", i, [r.error for r in runs.values()])
            continue
        jit, plain = runs["nvrx_jit"], runs["nvrx"]
        pairs.append({"order": "/".join(ways), "load": load, "jit_wall_s": jit.wall_s, "wall_s": plain.wall_s,
                      "wall_ratio": jit.wall_s / plain.wall_s, "step_ratio": jit.step_median_s / plain.step_median_s})
        LOG.info("fault-free pair %d (%s): %.4f", i, pairs[-1]["order"], pairs[-1]["wall_ratio"])
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--faults", type=int, default=3)
    p.add_argument("--interval", type=float, default=10.0, help="mean seconds of training per attempt before its fault")
    p.add_argument("--jitter", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--kinds", default="crash,hang")
    p.add_argument("--output", type=Path, default=bg.RESULTS / "jit.json")
    p.add_argument("--from-json", type=Path, help="summarize a saved run again")
    p.add_argument("--keep-run-dirs", action="store_true")
    p.add_argument("--free-pairs", type=int, default=0,
                   help="N more fault-free pairs with / without JIT (order alternating) for the 1.005x target")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.from_json:
        settings, schedule, results, extra = bg.load_results(args.from_json)
        report(results, settings, schedule, args.output, extra)
        return 0
    base, _ = bg.parse_args(["--steps", str(args.steps), "--faults", str(args.faults), "--interval", str(args.interval),
                             "--jitter", str(args.jitter), "--seed", str(args.seed), "--kinds", args.kinds,
                             "--save-every", "200", "--launchers", "nvrx,torchrun-noshare", "--variants", "save200"])
    settings = bg.Settings(**{**asdict(base), "variants": (VARIANT,)})
    schedule = bg.make_schedule(settings.seed, settings.faults, settings.interval, settings.jitter)
    bg.command, bg.plan = command, plan  # the goodput machinery, with our three ways
    LOG.info("fault schedule: %s", ", ".join(f"{f.after_s:g} s r{f.rank}" for f in schedule))
    started = time.monotonic()
    gate = gate_cost()
    results = bg.run_all(settings, schedule, args.keep_run_dirs)
    pairs = free_pairs(settings, schedule, args.free_pairs, args.keep_run_dirs)
    report(results, settings, schedule, args.output, {"machine": bl.machine_info(), "gate": gate, "free_pairs": pairs,
                                                      "elapsed_s": time.monotonic() - started,
                                                      "load_end": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
