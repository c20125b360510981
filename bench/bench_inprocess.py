"""Restart latency: in-process restart (`nvrx launch --inprocess`) vs process restarts (`nvrx launch`, torchrun).

One workload (bench/inprocess_probe.py, CPU/gloo), 2 and 4 ranks, side by side in one run:

* ``inprocess``: ``nvrx launch --inprocess``: the script runs inside the in-process Wrapper (defaults);
* ``nvrx``:      ``nvrx launch --max-restarts 1``: the agent restarts the rank processes;
* ``torchrun``:  ``python -m torch.distributed.run --max-restarts 1`` with
                 ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the shared store (torchrun's default) its
                 attempt 1 cannot form the gloo group after a rank failed (gloo connects to the old
                 addresses; see bench/README.md, launch benchmark), so it would never restart at all.

Rank 1 raises ValueError ~0.2 s after every rank is ready. Latency = the last rank's "back in the
script with a new process group and one all_reduce done" in attempt 1 minus the time just before the
raise. Breakdown (max over ranks): ``to_script`` (fault -> first line of the attempt-1 script, i.e.
detection + teardown + start), ``init_pg`` (init_process_group), ``first_collective``; for inprocess
also the Wrapper's phases (``detect``: fault -> restart began, ``abort``, ``termination_barrier``,
``rank_assignment``, ``iteration_barrier``).

Usage (repo root)::

    python bench/bench_inprocess.py [--runs 3] [--worlds 2,4] [--configs inprocess,nvrx,torchrun]

Prints a table and writes bench/results/inprocess.json (machine info with the load average before and
after, every sample, medians, ratios). Target: inprocess <= 0.2x torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench_launch import MARKER_ENV, kill_leftovers, machine_info, print_table, save_json

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PROBE = BENCH_DIR / "inprocess_probe.py"
DEFAULT_OUTPUT = BENCH_DIR / "results" / "inprocess.json"
CONFIGS = ("inprocess", "nvrx", "torchrun")
TARGET = 0.2  # inprocess / torchrun
WRAPPER_PHASES = ("abort", "finalize_health_check", "termination_barrier", "rank_assignment", "iteration_barrier")


def command(config: str, world: int, run_id: str, root: Path) -> list[str]:
    py = sys.executable
    launcher = [py, "-m", "torch.distributed.run"] if config == "torchrun" else [py, "-m", "nvrx", "launch"]
    flags = ["--standalone", "--nproc-per-node", str(world), "--max-restarts", "1", "--rdzv-id", run_id,
             "--log-dir", str(root / "logs")]
    if config == "inprocess":
        flags.append("--inprocess")
    return [*launcher, *flags, str(PROBE), "--out", str(root / "out")]


def run_once(config: str, world: int, index: int, timeout: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"nvrx-bench-inprocess-{config}-{world}-"))
    (root / "out").mkdir()
    run_id = f"bench-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{MARKER_ENV: run_id})
    if config == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    sample: dict[str, Any] = {"config": config, "world": world, "index": index, "ok": False}
    with open(root / "launcher.log", "wb") as console:
        proc = subprocess.Popen(command(config, world, run_id, root), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_leftovers(proc, run_id)
    sample.update(measure(root / "out", world))
    sample["exit_code"] = code
    sample["ok"] = code == 0 and "latency" in sample
    if sample["ok"]:
        shutil.rmtree(root, ignore_errors=True)
    else:
        sample["run_dir"] = str(root)
        sample["log_tail"] = (root / "launcher.log").read_text(errors="replace").splitlines()[-15:]
    return sample


def measure(out: Path, world: int) -> dict[str, Any]:
    fault_file = out / "fault.json"
    ready = [json.loads(p.read_text()) for p in out.glob("ready-a1-*.json")]
    if not fault_file.exists() or len(ready) != world:
        return {"error": f"fault recorded: {fault_file.exists()}, attempt-1 ranks ready: {len(ready)}/{world}"}
    fault = json.loads(fault_file.read_text())["t"]
    first = {r["rank"]: r["pid"] for r in (json.loads(p.read_text()) for p in out.glob("ready-a0-*.json"))}
    result: dict[str, Any] = {
        "latency": max(r["t_ready"] for r in ready) - fault,
        "to_script": max(r["t_enter"] for r in ready) - fault,
        "init_pg": max(r["t_pg"] - r["t_enter"] for r in ready),
        "first_collective": max(r["t_ready"] - r["t_pg"] for r in ready),
        "same_pids": sorted(first.values()) == sorted(r["pid"] for r in ready),
    }
    timings = [r["timings"] for r in ready if r.get("timings")]
    if timings:
        result["detect"] = max(t["began"] for t in timings) - fault
        for phase in WRAPPER_PHASES:
            result[phase] = max(t.get(phase, 0.0) for t in timings)
    return result


def summarize(samples: list[dict[str, Any]], configs: list[str], worlds: list[int]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for world in worlds:
        for config in configs:
            mine = [s for s in samples if s["config"] == config and s["world"] == world]
            ok = [s for s in mine if s["ok"]]
            entry: dict[str, Any] = {"n_ok": len(ok), "failures": len(mine) - len(ok)}
            keys = ["latency", "to_script", "init_pg", "first_collective"]
            if config == "inprocess":
                keys += ["detect", *WRAPPER_PHASES]
            for key in keys:
                values = [s[key] for s in ok if key in s]
                if values:
                    entry[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            summary[f"{config}/{world}"] = entry
    return summary


def ratio(summary: dict[str, Any], num: str, den: str, world: int) -> float | None:
    a, b = summary.get(f"{num}/{world}", {}), summary.get(f"{den}/{world}", {})
    if "latency" in a and "latency" in b and b["latency"]["median"] > 0:
        return a["latency"]["median"] / b["latency"]["median"]
    return None


def ms(entry: dict[str, Any], key: str) -> str:
    return f"{entry[key]['median'] * 1000:.0f}" if key in entry else "-"


def report(summary: dict[str, Any], configs: list[str], worlds: list[int]) -> tuple[dict[str, Any], bool | None]:
    header = ["ranks", "config", "restart ms (median)", "min-max ms", "ok", "x torchrun", "to_script", "init_pg",
              "1st coll.", "detect", "abort", "term. barrier", "iter. barrier"]
    rows, ratios, verdicts = [], {}, []
    for world in worlds:
        for config in configs:
            e = summary[f"{config}/{world}"]
            r = ratio(summary, config, "torchrun", world) if config != "torchrun" else None
            if config != "torchrun":
                ratios[f"{config}/torchrun/{world}"] = r
            if config == "inprocess" and r is not None:
                verdicts.append(r <= TARGET and e["failures"] == 0)
            span = f"{e['latency']['min'] * 1000:.0f}-{e['latency']['max'] * 1000:.0f}" if "latency" in e else "-"
            rows.append([str(world), config, ms(e, "latency"), span, f"{e['n_ok']}/{e['n_ok'] + e['failures']}",
                         f"{r:.3f}x" if r is not None else "-", ms(e, "to_script"), ms(e, "init_pg"),
                         ms(e, "first_collective"), ms(e, "detect"), ms(e, "abort"), ms(e, "termination_barrier"),
                         ms(e, "iteration_barrier")])
    met = all(verdicts) if verdicts else None
    print_table(header, rows, f"restart latency after an exception on rank 1 (target: inprocess <= {TARGET}x torchrun)")
    print(f"target met: {met}")
    return ratios, met


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",") if w]
    args.configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or args.runs < 1 or any(w < 2 for w in args.worlds):
        parser.error(f"configs from {CONFIGS}, --runs >= 1, worlds >= 2 (bad: {bad})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine_info()
    samples = []
    for world in args.worlds:
        for index in range(args.runs):
            for config in args.configs:  # interleaved, so load drifts hit every config alike
                sample = run_once(config, world, index, args.timeout)
                samples.append(sample)
                print(f"{config:9s} world {world} run {index}: " + (f"{sample['latency'] * 1000:.0f} ms" if sample["ok"]
                      else f"FAILED ({sample.get('error') or sample.get('exit_code')})"), flush=True)
    info["load_avg_at_end"] = list(os.getloadavg())
    summary = summarize(samples, args.configs, args.worlds)
    ratios, met = report(summary, args.configs, args.worlds)
    print(f"load average: start {info['load_avg_at_start']}, end {info['load_avg_at_end']} ({info['cpu_count']} cpus)")
    save_json(args.output, {"machine": info, "config": {"runs": args.runs, "worlds": args.worlds, "configs": args.configs,
                                                        "target": f"inprocess <= {TARGET}x torchrun"},
                            "summary": summary, "ratios": ratios, "target_met": met, "samples": samples})
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
