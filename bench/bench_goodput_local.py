"""Goodput with the two-tier checkpoint (nvrx.ckpt.local + the global DCP tier) vs the global tier alone, under crashes
and node losses: the local-tier variant of bench_goodput.py (same workload, injector, breakdown; nvrx only).

Runs (``nvrx launch --async-ckpt``, 2 ranks, each an emulated node with its own local root under /dev/shm):

* ``none/none``: fault-free, no checkpoint (the reference wall);
* ``global``: the global tier alone, every ``--global-every`` steps (the local tier off);
* ``twotier``: local every ``--local-every`` steps (replicated to the other rank) + global every ``--global-every``;

each fault-free (checkpoint cost), under ``crash`` (a rank SIGKILLed; local files intact) and under ``nodeloss``
(a rank SIGKILLed and its node's whole local directory deleted: its shard comes back from the replica on the other
node). Goodput = reference wall / (reference wall + time lost to the faults + time blocked in checkpoint calls);
the time lost per fault is bench_goodput's breakdown (detect, stop, respawn, init, recompute).

    python bench/bench_goodput_local.py --quick          # a few minutes
    python bench/bench_goodput_local.py                  # 1500 steps, 4 faults every ~12 s
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_goodput as bg  # noqa: E402
import bench_launch as bl  # noqa: E402

KINDS = ("crash", "nodeloss")


class NodeLossInjector(bg.Injector):
    """bench_goodput's injector; a ``nodeloss`` fault also deletes the victim node's local checkpoint directory,
    at the moment its rank is killed (the node and its disk are gone together)."""

    def __init__(self, proc: subprocess.Popen, out: Path, deadline: float, local_root: Path | None) -> None:
        super().__init__(proc, out, "crash", deadline)
        self.local_root = local_root

    def _fire(self, fault: bg.Fault, attempt: int, records: list[dict[str, Any]]) -> dict[str, Any]:
        if self.local_root is not None:
            shutil.rmtree(self.local_root / f"node{fault.rank}", ignore_errors=True)
        return super()._fire(fault, attempt, records)


def command(spec: bg.RunSpec, settings: bg.Settings, dirs: bl.RunDirs, run_id: str, local_root: Path,
            global_every: int) -> list[str]:
    base = bg.command(bg.RunSpec(spec.launcher, "every10", spec.kind if spec.kind != "nodeloss" else "crash",
                                 "none", spec.every), settings, dirs, run_id, bl.make_launchers()["nvrx"])
    if spec.ckpt == "none":
        return base
    base[base.index("--ckpt") + 1] = "twotier"
    at = base.index(str(bg.TRAIN))
    return [*base[:at], "--async-ckpt", *base[at:], "--global-every", str(global_every), "--local-dir", str(local_root)]


def execute(spec: bg.RunSpec, settings: bg.Settings, schedule: list[bg.Fault], global_every: int,
            keep: bool) -> bg.RunResult:
    dirs = bl.RunDirs.create("nvrx", f"local-{spec.ckpt}-{spec.kind}")
    local_root = Path(tempfile.mkdtemp(prefix="nvrx-goodput-local-", dir="/dev/shm"))
    run_id = f"goodput-{uuid.uuid4().hex[:12]}"
    load = bg.os.getloadavg()[0]

    def injector(proc: subprocess.Popen, t0: float) -> NodeLossInjector:
        return NodeLossInjector(proc, dirs.out, t0 + settings.run_timeout,
                                local_root if spec.kind == "nodeloss" else None)

    def after(result: bg.RunResult) -> None:
        result.load = load
        for f in result.faults:  # where each attempt after a fault resumed (a multiple of global-every: global tier)
            ready = bg.read_json(dirs.out / f"ready-a{f['attempt'] + 1}-r0.json") or {}
            f["resumed_at_step"] = ready.get("start_step")

    try:
        return bg.run_measured(spec, settings, schedule, dirs, run_id,
                               command(spec, settings, dirs, run_id, local_root, global_every),
                               bl.build_env(bl.make_launchers()["nvrx"], run_id), injector, after, keep)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)


def plan(kinds: tuple[str, ...], local_every: int) -> list[bg.RunSpec]:
    runs = [bg.RunSpec("nvrx", "local", "none", "none", local_every)]
    for kind in ("none", *kinds):
        runs += [bg.RunSpec("nvrx", "local", kind, "global", 0), bg.RunSpec("nvrx", "local", kind, "twotier", local_every)]
    return runs


def summarize(results: list[bg.RunResult]) -> list[dict[str, Any]]:
    ref = next((r for r in results if r.ok and r.spec.kind == "none" and r.spec.ckpt == "none"), None)
    rows = []
    for r in results:
        row: dict[str, Any] = {"kind": r.spec.kind, "ckpt": r.spec.ckpt, "ok": r.ok, "error": r.error,
                               "wall_s": r.wall_s, "load": r.load, "ckpt_blocked_s": r.ckpt_blocked_s,
                               "faults": r.faults, "step_median_s": r.step_median_s, "run_dir": r.run_dir}
        if r.ok and ref is not None and ref.wall_s:
            lost = bg.covered([(f["t_fault"], f["t_fault"] + f["lost"]) for f in r.faults])
            row["lost_s"] = lost
            row["goodput"] = ref.wall_s / (ref.wall_s + lost + (r.ckpt_blocked_s or 0.0))
            row["goodput_wall"] = ref.wall_s / r.wall_s if r.wall_s else None
            for part in bg.COMPONENTS:
                row[part] = bg.med([f[part] for f in r.faults if f.get(part) is not None])
            row["resumed_at"] = [f.get("resumed_at_step") for f in r.faults]
        rows.append(row)
    for row in rows:  # the two tiers / the global tier alone, same faults
        peer = next((o for o in rows if o["kind"] == row["kind"] and o["ckpt"] == "global"), None)
        if row["ckpt"] == "twotier" and peer and row.get("goodput") and peer.get("goodput"):
            row["goodput_x_global"] = row["goodput"] / peer["goodput"]
            if row.get("lost") and peer.get("lost"):
                row["lost_per_fault_x_global"] = row["lost"] / peer["lost"]
    return rows


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["faults", "ckpt", "wall", "goodput", "x global", "lost/fault", "x global", "recompute", "ckpt blocked",
              "resumed at steps"]
    body = [[r["kind"], r["ckpt"], bg.fmt(r["wall_s"]), bg.fmt(r.get("goodput"), ""), bg.fmt(r.get("goodput_x_global"), ""),
             bg.fmt(r.get("lost")), bg.fmt(r.get("lost_per_fault_x_global"), ""), bg.fmt(r.get("recompute")),
             bg.fmt(r.get("ckpt_blocked_s")), ",".join(str(s) for s in r.get("resumed_at") or []) or "-"]
            for r in rows]
    return header, body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="600 steps, 2 faults every 8 +- 2 s")
    p.add_argument("--steps", type=int)
    p.add_argument("--faults", type=int)
    p.add_argument("--interval", type=float, help="mean seconds of training before each fault")
    p.add_argument("--local-every", type=int, default=10)
    p.add_argument("--global-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--keep", action="store_true", help="keep every run's directory")
    p.add_argument("--out", default=str(bg.RESULTS / "goodput_local.json"))
    args = p.parse_args(argv)
    quick = args.quick
    settings = bg.Settings(steps=args.steps or (600 if quick else 1500), faults=args.faults or (2 if quick else 4),
                           interval=args.interval or (8.0 if quick else 12.0), jitter=2.0, seed=args.seed,
                           save_every=args.global_every, pause=0.04, hang_timeout=3.0, pg_timeout=10.0, big=False,
                           variants=("local",), kinds=KINDS, launchers=("nvrx",), run_timeout=900.0)
    schedule = bg.make_schedule(settings.seed, settings.faults, settings.interval, settings.jitter)
    results = []
    for spec in plan(KINDS, args.local_every):
        print(f"run {spec.kind}/{spec.ckpt} (load {bg.os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        results.append(execute(spec, settings, schedule, args.global_every, args.keep))
        if not results[-1].ok:
            print(f"  failed: {results[-1].error}; {results[-1].run_dir}", file=sys.stderr)
    rows = summarize(results)
    header, body = table(rows)
    title = (f"goodput, two tiers (local every {args.local_every}, global every {args.global_every} steps) vs the "
             f"global tier alone; {settings.steps} steps, {settings.faults} faults per run")
    bl.print_plain_table(header, body, title)
    bl.save_json(Path(args.out), {"machine": bl.machine_info(), "command": " ".join(sys.argv),
                                  "settings": bg.asdict(settings), "schedule": [bg.asdict(f) for f in schedule],
                                  "rows": rows, "table": {"header": header, "body": body, "title": title}})
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
