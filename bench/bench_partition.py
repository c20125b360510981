#!/usr/bin/env python3
"""Partition -> the survivors training again, nvrx vs torchrun (c10d) and NVRx's ft_launcher, on emulated hosts.

Every launcher runs one agent per emulated host (tests/hosts.py: network namespaces with their own addresses
on a bridge; needs root). Once every rank trains (bench/partition_train.py, a gloo all-reduce per step), the
link of the last member host is cut (its switch port goes down) while its agent and ranks keep running. Per
launcher and mode it records:

- ``recovery_s``: cut -> the first step a survivor finishes after a restart (a step with a higher restart count
  than at the cut), or null when nobody trained again within --limit seconds;
- ``cut_off_end``: how the cut-off host's agent ended (exit code) and when (s after the cut), or
  ``hung past <limit> s`` when it was still running then (it is then SIGKILLed with the namespace);
- ``survivor_end``: the survivors' exit codes (they train a fixed number of steps).

Modes: ``standby`` (--nnodes 2:2, a third host waits as a standby and takes the cut-off host's place) and
``no_standby`` (--nnodes 1:2 with two hosts: the survivor goes on alone). Each launcher runs with its own
defaults for detecting a lost node, except nvrx's ``last_call_timeout``, which is set to torchrun's c10d
default's order (we also show the setting each used). The ratio is nvrx / the best peer that recovered at all.

Usage:
    sudo python bench/bench_partition.py                   # both modes, every peer found, --limit 300
    sudo python bench/bench_partition.py --limit 60 --launchers nvrx,torchrun
Writes bench/results/partition.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.hosts import Hosts, unavailable_reason  # noqa: E402

TRAIN = ROOT / "bench" / "partition_train.py"
PORT = 29400
STEP_TIME = 0.05
FT_LAUNCHER: list[str | None] = [None]  # --ft-launcher: NVRx's ft_launcher, e.g. from a venv of its own


def launcher_cmd(name: str, nnodes: str, endpoint: str, run_id: str, out: Path, steps: int) -> list[str] | None:
    """The agent command of launcher NAME, or None when it is not installed here."""
    common = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
              "--max-restarts", "3"]
    script = [str(TRAIN), str(out), str(STEP_TIME), str(steps)]
    if name == "nvrx":
        return [sys.executable, "-m", "nvrx", "launch", *common, "--rdzv-conf", "last_call_timeout=1", *script]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, "--rdzv-backend", "c10d",
                "--rdzv-conf", "last_call_timeout=1", *script]
    if name == "ft_launcher":
        exe = FT_LAUNCHER[0] or shutil.which("ft_launcher")
        if exe is None:
            return None
        return [exe, *common, "--rdzv-backend", "c10d", "--rdzv-conf", "last_call_timeout=1",
                "--ignore-missing-fault-tol-cfg", *script]
    raise ValueError(name)


def steps_of(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return rows


def wait(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def one_run(launcher: str, mode: str, limit: float) -> dict:
    """One partition of one launcher in one mode (fresh hosts)."""
    n_hosts, nnodes = (3, "2:2") if mode == "standby" else (2, "1:2")
    hosts = Hosts(n_hosts)
    out = Path(tempfile.mkdtemp(prefix="nvrx-bench-partition-"))
    out.chmod(0o777)
    steps = int((limit + 120) / STEP_TIME)  # the survivors outlast the measurement
    procs: dict[str, subprocess.Popen] = {}
    row: dict = {"launcher": launcher, "mode": mode}
    try:
        cmd0 = launcher_cmd(launcher, nnodes, f"{hosts[0].addr}:{PORT}", f"bench-{mode}", out, steps)
        if cmd0 is None:
            return {**row, "skipped": f"{launcher} is not installed here"}
        logs = out / "logs"
        logs.mkdir()
        for i, h in enumerate(hosts):
            procs[h.name] = subprocess.Popen(h.wrap(cmd0), cwd=out, stdout=open(logs / f"{h.name}.out", "w"),
                                             stderr=subprocess.STDOUT)
            if i == 0:
                time.sleep(2.0)  # the store's host first (torchrun's c10d picks its store host that way too)
        world = 2
        if not wait(lambda: {r["host"] for r in steps_of(out) if r["world"] == world} and
                    len({r["host"] for r in steps_of(out) if r["world"] == world}) == world, 180):
            return {**row, "error": "the job never trained with every member"}
        members = sorted({r["host"] for r in steps_of(out) if r["world"] == world})
        victim = next(h for h in reversed(hosts.hosts) if h.name in members and h is not hosts[0])
        survivors = [h for h in hosts if h is not victim]
        restart_at_cut = max(r["restart"] for r in steps_of(out))
        t_cut = time.time()
        hosts.cut(victim)

        def recovered() -> float | None:
            again = [r["t"] for r in steps_of(out)
                     if r["restart"] > restart_at_cut and r["host"] != victim.name and r["t"] > t_cut]
            return min(again) - t_cut if again else None

        wait(lambda: recovered() is not None and procs[victim.name].poll() is not None, limit, 0.1)
        row["recovery_s"] = None if recovered() is None else round(recovered(), 2)
        code = procs[victim.name].poll()
        row["cut_off_end"] = (f"hung past {limit:g} s" if code is None else f"exit {code}")
        row["survivors_training_again_world"] = max(
            (r["world"] for r in steps_of(out) if r["restart"] > restart_at_cut), default=None)
        row["survivor_running"] = [h.name for h in survivors if procs[h.name].poll() is None]
        return row
    finally:
        hosts.close()  # kills everything inside the hosts, then removes them
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(out, ignore_errors=True)


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':<11} {'launcher':<12} {'recovery s':>10} {'x nvrx':>7}  cut-off host"]
    for mode in ("standby", "no_standby"):
        mine = [r for r in rows if r["mode"] == mode]
        ours = next((r.get("recovery_s") for r in mine if r["launcher"] == "nvrx"), None)
        for r in mine:
            rec = r.get("recovery_s")
            ratio = f"{rec / ours:.2f}" if rec and ours else "-"
            what = r.get("skipped") or r.get("error") or r.get("cut_off_end", "")
            lines.append(f"{mode:<11} {r['launcher']:<12} {('-' if rec is None else rec):>10} {ratio:>7}  {what}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launchers", default="nvrx,torchrun,ft_launcher")
    ap.add_argument("--modes", default="standby,no_standby")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds after the cut before a peer counts as hung")
    ap.add_argument("--ft-launcher", default=None, help="path of NVRx's ft_launcher (default: the one on PATH)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "partition.json"))
    args = ap.parse_args(argv)
    FT_LAUNCHER[0] = args.ft_launcher
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_partition: {reason}", file=sys.stderr)
        return 2
    rows = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    for mode in args.modes.split(","):
        for launcher in args.launchers.split(","):
            row = one_run(launcher, mode, args.limit)
            print(json.dumps(row), flush=True)
            rows.append(row)
    for mode in {r["mode"] for r in rows}:
        peers = [r["recovery_s"] for r in rows if r["mode"] == mode and r["launcher"] != "nvrx" and r.get("recovery_s")]
        ours = next((r.get("recovery_s") for r in rows if r["mode"] == mode and r["launcher"] == "nvrx"), None)
        for r in rows:
            if r["mode"] == mode and r["launcher"] == "nvrx":
                r["ratio_to_best_peer"] = round(ours / min(peers), 3) if ours and peers else None
    result = {"limit_s": args.limit, "step_time_s": STEP_TIME, "rows": rows, "cpus": os.cpu_count(),
              "load_1_5_15": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
              "note": "each launcher's own defaults for detecting a lost node; nvrx last_call_timeout=1, torchrun's "
                      "c10d last_call_timeout=1"}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    print(f"load (1, 5, 15 min) before {load_before}, after {result['load_1_5_15']['after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
