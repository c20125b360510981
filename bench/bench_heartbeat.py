"""Heartbeat benchmark: hot-path cost in a rank connected to a real monitor, and hang-detection latency.

    python bench/bench_heartbeat.py [--calls 100000] [--trials 3] [--timeout 2] [--output bench/results/heartbeat.json]

1. cost: a rank started by ``nvrx launch --standalone`` (this file with ``--as-rank cost``, so the real agent,
   bootstrap and monitor are in place) times ``send_heartbeat()`` and a ``start_section()+end_section()`` pair
   ``--calls`` times each with perf_counter_ns; the timer's own cost (an empty timed call) is measured too and
   reported separately (not subtracted). The peer, NVIDIA's ft_launcher, cannot be installed here (not on the
   package index); its numbers measured on this machine class (the issue's) are the ratio's denominator.
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


# ft_launcher on this machine class, from the issue (us): the peer column of the table.
PEER_US = {"send_heartbeat": {"median_us": 7.0, "p99_us": 41.0},
           "section_pair": {"median_us": 17.6, "p99_us": 800.0}}


def rank_cost(calls: int, out: Path | None) -> None:
    from nvrx.monitors.client import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring(sections=["step"])
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
    if out is not None:
        out.write_text(json.dumps(results))
    else:
        print(json.dumps(results), flush=True)


def rank_hang(beats: int) -> None:
    from nvrx.monitors.client import RankMonitorClient

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
        cmd = [sys.executable, "-m", "nvrx.monitors.rank_monitor", "--rank", "0", "--state-dir", str(root / "state"),
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


def measure_cost_launched(root: Path, calls: int) -> dict[str, Any]:
    """The cost in a rank that ``nvrx launch`` started: the configuration users run."""
    out = root / "launched_cost.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("NVRX_MONITOR_TOKEN", None)
    cmd = [sys.executable, "-m", "nvrx", "launch", "--standalone", "--nproc-per-node", "1", "-q",
           "--log-dir", str(root / "logs"), "--ft-param-initial-rank-heartbeat-timeout", "600",
           "--ft-param-rank-heartbeat-timeout", "600", __file__, "--as-rank", "cost", "--calls", str(calls),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=600, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"launched cost rank failed with {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


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
            hang = [e for e in map(json.loads, (root / "detect" / "monitor.jsonl").read_text().splitlines())
                    if e["ev"] == "hang_detected"][-1]  # the one record of a hang's cause
            runs.append({"latency_s": latency, "overshoot_s": latency - timeout, "returncode": rank.returncode,
                         "reason": hang["reason"], "monitor_elapsed_s": hang["elapsed"]})
    finally:
        mon.stop()
    return {"timeout_s": timeout, "trials": runs,
            "max_overshoot_s": max(r["overshoot_s"] for r in runs),
            "median_overshoot_s": statistics.median(r["overshoot_s"] for r in runs)}


def ratios(cost: dict[str, Any]) -> dict[str, dict[str, float]]:
    """nvrx / ft_launcher per operation and statistic (below 1 = nvrx is cheaper)."""
    return {op: {stat: cost[op][stat] / peer for stat, peer in stats.items()} for op, stats in PEER_US.items()}


def print_table(result: dict[str, Any]) -> None:
    cost, rat = result["cost_launched"], result["ratios_vs_ft_launcher"]
    print(f"{'operation (launched rank)':<30}{'median us':>10}{'p99 us':>9}{'ft_l. med':>10}{'ft_l. p99':>10}"
          f"{'ratio med':>10}{'ratio p99':>10}")
    for key in ("send_heartbeat", "section_pair", "timer_overhead"):
        row = cost[key]
        label = {"section_pair": "start_section+end_section"}.get(key, key)
        peer = PEER_US.get(key)
        tail = (f"{peer['median_us']:>10.1f}{peer['p99_us']:>10.1f}{rat[key]['median_us']:>10.3f}"
                f"{rat[key]['p99_us']:>10.3f}") if peer else ""
        print(f"{label:<30}{row['median_us']:>10.3f}{row['p99_us']:>9.3f}{tail}")
    bare = result["cost"]["send_heartbeat"]
    print(f"(bare rank, monitor started by hand: send_heartbeat median {bare['median_us']:.3f} us, "
          f"p99 {bare['p99_us']:.3f} us)")
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
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_rank == "cost":
        return rank_cost(args.calls, args.out)
    if args.as_rank == "hang":
        return rank_hang(args.beats)
    with tempfile.TemporaryDirectory(prefix="nvrx-hb-bench-") as tmp:
        root = Path(tmp)
        result = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "time": time.time(),
                  "cost_launched": measure_cost_launched(root, args.calls),
                  "cost": measure_cost(root, args.calls),
                  "detection": measure_detection(root, args.timeout, args.trials)}
        result["ratios_vs_ft_launcher"] = ratios(result["cost_launched"])
    print_table(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nsaved {args.output}")


if __name__ == "__main__":
    main()
