"""Goodput at 1k / 4k / 16k GPUs, projected from the per-fault costs bench_jit.py measured and a published failure rate.

Model (per failure, first order): a job checkpoints every T seconds of training, each save blocking training C
seconds; failures arrive at rate N x lambda (N GPUs, lambda per GPU). A failure costs the restart R (detect + stop
+ respawn + init, measured per launcher) plus recompute: T / 2 on average without a just-in-time checkpoint; with
one, a step when it succeeds (fraction P_JIT of failures: measured, capped by --min-fallback) and T / 2 when it
falls back. So

    goodput = 1 - C / T - (R + (1 - P_JIT) T / 2 + P_JIT * step) / M,    M = 1 / (N lambda)

Fixed interval: T = the job's interval (default 200 steps, as measured). Auto: T = Daly's optimum
(nvrx.ckpt.interval.daly_seconds) of C and the MTBF each failure pays the half interval at, M / (1 - P_JIT).
The failure rate default is Llama 3 405B's pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs.

First the model is checked against the small runs it takes its costs from (``check``): each measured faulty run's
goodput against the model's for the same faults (target: within 2 points).

Usage::

    python bench/bench_jit_scale.py                      # reads bench/results/jit.json
    python bench/bench_jit_scale.py --step-s 6 --save-cost-s 5 --interval-steps 300

Prints the check and the projection, writes bench/results/jit_scale.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import bench_launch as bl  # noqa: E402

from nvrx.ckpt.interval import daly_seconds  # noqa: E402

LLAMA3 = {"interruptions": 419, "days": 54, "gpus": 16384, "source": "Llama 3 405B pre-training (Meta, 2024)"}
SCALES = (1024, 4096, 16384)
WAYS = {"nvrx_jit": "nvrx+jit", "nvrx": "nvrx", "torch_save": "torchrun+torch.save"}


def goodput(interval: float, save_cost: float, mtbf: float, restart: float, p_jit: float, step: float) -> float:
    recompute = (1 - p_jit) * interval / 2 + p_jit * step
    return max(0.0, 1 - save_cost / (interval + save_cost) - (restart + recompute) / mtbf)


def measured_costs(data: dict[str, Any], kind: str | None = None) -> dict[str, dict[str, float]]:
    """Per way: restart R (median lost - recompute), JIT success fraction, step time, from bench_jit's runs of fault
    KIND (None: crashes and hangs pooled, as if failures at scale were half of each)."""
    out: dict[str, dict[str, Any]] = {}
    for run in data["runs"]:
        spec = run["spec"]
        if spec["kind"] == "none" or not run["ok"] or (kind is not None and spec["kind"] != kind):
            continue
        faults = [f for f in run["faults"] if "lost" in f]
        way = out.setdefault(spec["ckpt"], {"restart": [], "redone_zero": [], "step": [], "lost": []})
        way["restart"] += [f["lost"] - f["recompute"] for f in faults]
        way["redone_zero"] += [1.0 if f.get("steps_redone", 1) <= 1 else 0.0 for f in faults]
        way["lost"] += [f["lost"] for f in faults]
        if run.get("step_median_s"):
            way["step"].append(run["step_median_s"])
    return {k: {"restart": statistics.mean(v["restart"]), "p_jit": statistics.mean(v["redone_zero"]) if k == "nvrx_jit" else 0.0,
                "step": statistics.median(v["step"]), "faults": len(v["lost"])}
            for k, v in out.items() if v["restart"]}


def check(data: dict[str, Any], every: int) -> list[dict[str, Any]]:
    """The model against each measured faulty run. Both sides are goodput = W / (W + time lost), W the run's
    training time without faults (its wall minus what it lost: the reference runs' walls vary by more than the
    faults cost on a loaded machine). Measured lost: the ranks' timestamps, fault -> the step reached done again.
    Model lost per fault: R + recompute, recompute = the steps since the last checkpoint at the fault (from where
    the fault hit; one step when the JIT save worked) x the step time."""
    rows = []
    for run in data["runs"]:
        spec = run["spec"]
        c = measured_costs(data, spec["kind"]).get(spec["ckpt"]) if spec["kind"] != "none" else None
        faults = [f for f in run["faults"] if "lost" in f]
        if spec["kind"] == "none" or not run["ok"] or c is None or not faults:
            continue
        lost = sum(f["lost"] for f in faults)
        work = run["wall_s"] - lost
        model = 0.0
        for f in faults:
            since = (f["step_reached"] + 1) % every
            steps = min(since, 1) if spec["ckpt"] == "nvrx_jit" else since
            model += c["restart"] + steps * c["step"]
        measured, predicted = work / (work + lost), work / (work + model)
        rows.append({"way": WAYS.get(spec["ckpt"], spec["ckpt"]), "kind": spec["kind"], "faults": len(faults),
                     "measured": round(measured, 4), "predicted": round(predicted, 4),
                     "points_off": round(100 * (predicted - measured), 2)})
    return rows


def project(costs: dict[str, dict[str, float]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rate = LLAMA3["interruptions"] / (LLAMA3["days"] * 86400 * LLAMA3["gpus"])  # failures per GPU-second
    rows = []
    for gpus in SCALES:
        mtbf = 1 / (rate * gpus)
        for key, c in costs.items():
            save = args.save_cost_s if key != "torch_save" else args.sync_save_cost_s
            fixed_t = args.interval_steps * args.step_s
            p_jit = min(c["p_jit"], 1 - args.min_fallback)
            auto_t = daly_seconds(save, mtbf / (1 - p_jit))
            for mode, t in (("fixed", fixed_t), ("auto", auto_t)):
                rows.append({"gpus": gpus, "mtbf_h": round(mtbf / 3600, 2), "way": WAYS.get(key, key), "interval": mode,
                             "interval_s": round(t, 1), "restart_s": round(c["restart"], 3), "p_jit": round(p_jit, 2),
                             "goodput": round(goodput(t, save, mtbf, c["restart"] * args.restart_scale, p_jit,
                                                      args.step_s), 4)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", type=Path, default=BENCH_DIR / "results" / "jit.json")
    p.add_argument("--output", type=Path, default=BENCH_DIR / "results" / "jit_scale.json")
    p.add_argument("--step-s", type=float, default=6.0, help="a training step at scale, seconds (default 6)")
    p.add_argument("--interval-steps", type=int, default=200, help="the fixed interval, steps (default 200)")
    p.add_argument("--save-cost-s", type=float, default=2.0, help="training blocked per asynchronous save, s")
    p.add_argument("--sync-save-cost-s", type=float, default=60.0, help="training blocked per torch.save, s")
    p.add_argument("--min-fallback", type=float, default=0.2,
                   help="fraction of failures at scale whose JIT save falls back whatever was measured here (sharded "
                        "state whose holders are all lost, a second failure, a full disk; default 0.2)")
    p.add_argument("--restart-scale", type=float, default=1.0,
                   help="multiply the measured restart cost (e.g. for NCCL init and a large load at scale)")
    args = p.parse_args(argv)
    data = json.loads(args.input.read_text())
    every = int(data["settings"]["save_every"])
    costs = measured_costs(data)
    checked = check(data, every)
    bl.print_table(["way", "kind", "faults", "measured", "predicted", "points off"],
                   [[r["way"], r["kind"], str(r["faults"]), f"{r['measured']:.3f}", f"{r['predicted']:.3f}",
                     f"{r['points_off']:+.2f}"] for r in checked],
                   f"model check against {args.input.name} (goodput of the measured runs)")
    rows = project(costs, args)
    bl.print_table(["GPUs", "MTBF h", "way", "interval", "T s", "R s", "P(JIT)", "goodput"],
                   [[str(r["gpus"]), f"{r['mtbf_h']:g}", r["way"], r["interval"], f"{r['interval_s']:g}",
                     f"{r['restart_s']:.2f}", f"{r['p_jit']:.2f}", f"{r['goodput']:.4f}"] for r in rows],
                   f"projection: {LLAMA3['source']}, {LLAMA3['interruptions']} interruptions in {LLAMA3['days']} days on "
                   f"{LLAMA3['gpus']} GPUs; step {args.step_s:g} s")
    bl.save_json(args.output, {"failure_rate": LLAMA3, "settings": vars(args) | {"input": str(args.input),
                                                                                 "output": str(args.output)},
                               "costs": costs, "check": checked, "projection": rows,
                               "max_points_off": max((abs(r["points_off"]) for r in checked), default=None)})
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
