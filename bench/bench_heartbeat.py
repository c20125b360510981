"""Heartbeat benchmark: hot-path cost in a rank connected to a real monitor, and hang-detection latency.

    python bench/bench_heartbeat.py [--calls 100000] [--trials 3] [--timeout 2] [--output bench/results/heartbeat.json]

1. cost: a rank process (this file with ``--as-rank cost``) times ``send_heartbeat()`` and a
   ``start_section()+end_section()`` pair ``--calls`` times each with perf_counter_ns; the timer's own
   cost (an empty timed call) is measured too and reported separately (not subtracted).
2. detection: a rank sends heartbeats, reports the monotonic time of its last one, then hangs; with
   ``rank_heartbeat_timeout=--timeout`` the monitor kills it. Latency = rank death seen by the parent
   (blocking waitpid) - last heartbeat; overshoot = latency - timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _pct(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def _summary(samples: list[int]) -> dict[str, float]:
    return {"median_us": statistics.median(samples) / 1000.0, "p99_us": _pct(samples, 0.99),
            "max_us": max(samples) / 1000.0, "calls": len(samples)}


# ---------------------------------------------------------------- rank side


def rank_cost(calls: int) -> None:
    from monitors.client import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring(["step"])
    clock = time.perf_counter_ns
    beat, start, end = client.send_heartbeat, client.start_section, client.end_section
    noop = (lambda: None)
    results: dict[str, Any] = {}
    for label, body in (("timer_overhead", noop), ("send_heartbeat", beat)):
        samples = [0] * calls
        for i in range(calls):
            t0 = clock()
            body()
            samples[i] = clock() - t0
        results[label] = _summary(samples)
    samples = [0] * calls
    for i in range(calls):
        t0 = clock()
        start("step")
        end("step")
        samples[i] = clock() - t0
    results["section_pair"] = _summary(samples)
    client.shutdown_workload_monitoring()
    print(json.dumps(results), flush=True)


def rank_hang(beats: int) -> None:
    from monitors.client import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()
    for _ in range(beats):
        client.send_heartbeat()
        time.sleep(0.01)
    client.send_heartbeat()
    print(json.dumps({"last_heartbeat": time.monotonic()}), flush=True)  # ~1 us after the beat
    time.sleep(120)


# ---------------------------------------------------------------- driver


class Monitor:
    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root = root
        self.token = secrets.token_hex(16)
        self.env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "NVRX_MONITOR_TOKEN": self.token, "NVRX_MONITOR_SOCKET": str(root / "run" / "m.sock"),
                    "NVRX_MONITOR_SHM": str(root / "run" / "m.slot")}
        cmd = [sys.executable, "-m", "monitors.rank_monitor", "--rank", "0", "--state-dir", str(root / "state"),
               "--socket", self.env["NVRX_MONITOR_SOCKET"], "--shm", self.env["NVRX_MONITOR_SHM"],
               "--config-json", json.dumps(config), "--events", str(root / "monitor.jsonl")]
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=REPO, stderr=subprocess.DEVNULL)

    def rank(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, *args], env=self.env, cwd=REPO, stdout=subprocess.PIPE,
                                text=True)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure_cost(root: Path, calls: int) -> dict[str, Any]:
    mon = Monitor(root / "cost", {"workload_check_interval": 5.0, "initial_rank_heartbeat_timeout": 600.0,
                                  "rank_heartbeat_timeout": 600.0})
    try:
        rank = mon.rank("--as-rank", "cost", "--calls", str(calls))
        out, _ = rank.communicate(timeout=300)
        if rank.returncode != 0:
            raise SystemExit(f"cost rank failed with {rank.returncode}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        mon.stop()


def measure_detection(root: Path, timeout: float, trials: int) -> dict[str, Any]:
    runs = []
    mon = Monitor(root / "detect", {"workload_check_interval": 5.0, "initial_rank_heartbeat_timeout": 600.0,
                                    "rank_heartbeat_timeout": timeout})
    try:
        for _ in range(trials):
            rank = mon.rank("--as-rank", "hang", "--beats", "20")
            line = rank.stdout.readline()
            last_hb = json.loads(line)["last_heartbeat"]
            rank.wait()  # blocking waitpid: returns as soon as the rank dies
            dead = time.monotonic()
            rank.stdout.close()
            latency = dead - last_hb
            hang = json.loads((root / "detect" / "state" / "rank0.last_hang.json").read_text())
            runs.append({"latency_s": latency, "overshoot_s": latency - timeout, "returncode": rank.returncode,
                         "reason": hang["reason"], "monitor_elapsed_s": hang["elapsed"]})
    finally:
        mon.stop()
    return {"timeout_s": timeout, "trials": runs,
            "max_overshoot_s": max(r["overshoot_s"] for r in runs),
            "median_overshoot_s": statistics.median(r["overshoot_s"] for r in runs)}


def print_table(result: dict[str, Any]) -> None:
    print(f"{'operation':<34}{'median us':>12}{'p99 us':>12}{'max us':>12}")
    for key in ("send_heartbeat", "section_pair", "timer_overhead"):
        row = result["cost"][key]
        label = {"section_pair": "start_section+end_section"}.get(key, key)
        print(f"{label:<34}{row['median_us']:>12.3f}{row['p99_us']:>12.3f}{row['max_us']:>12.1f}")
    det = result["detection"]
    print(f"\ndetection with rank_heartbeat_timeout={det['timeout_s']} s:")
    for i, run in enumerate(det["trials"]):
        print(f"  trial {i}: last heartbeat -> rank dead {run['latency_s']:.4f} s, overshoot "
              f"{run['overshoot_s'] * 1000:.1f} ms ({run['reason']}, rc {run['returncode']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "heartbeat.json")
    p.add_argument("--as-rank", choices=["cost", "hang"], help=argparse.SUPPRESS)
    p.add_argument("--beats", type=int, default=20, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_rank == "cost":
        return rank_cost(args.calls)
    if args.as_rank == "hang":
        return rank_hang(args.beats)
    with tempfile.TemporaryDirectory(prefix="nvrx-hb-bench-") as tmp:
        root = Path(tmp)
        result = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "time": time.time(),
                  "cost": measure_cost(root, args.calls),
                  "detection": measure_detection(root, args.timeout, args.trials)}
    print_table(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nsaved {args.output}")


if __name__ == "__main__":
    main()
