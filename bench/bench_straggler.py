"""Straggler detection benchmark: how fast a rank that becomes 1.5x slower is flagged, and what a report costs.

1. **Detection delay** (end to end, real processes): ``nvrx launch --standalone --nproc-per-node 2`` runs
   ``tests/straggler/train.py`` (lock-step gloo steps: a timed ``compute`` section, then an all-reduce);
   rank 1's compute becomes ``--factor`` (1.5) times slower after about 5 report intervals, and writes the
   moment it does. Delay = the agent's first ``straggler`` event - that moment, in seconds and in report
   intervals (``--interval``, default 2 s; defaults for threshold 1.2 and sustain 2 reports).
2. **Cost per report** (in process, real objects): a monitor's look at its slot (snapshot + TimingSampler),
   its end-of-window summary written as a ``rank_timing`` event; one aggregator pass of an agent with 8
   local ranks (read 8 monitor event files, publish to a real TCPStore, gather and score); the scoring alone
   for 8 to 4096 ranks.

Usage (from the repo root)::

    python bench/bench_straggler.py [--runs 5] [--interval 2] [--factor 1.5] [--sustain 2] [--output PATH]

Prints a table and writes bench/results/straggler.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nvrx.launcher.agent.rank_monitors import RankMonitorGroup  # noqa: E402
from nvrx.launcher.agent.rdzv_records import NodeInfo, RoundResult  # noqa: E402
from nvrx.launcher.agent.rdzv_auth import RecordAuth, generate_secret  # noqa: E402
from nvrx.launcher.agent.store import RendezvousStore  # noqa: E402
from nvrx.launcher.agent.stragglers import StragglerAggregator  # noqa: E402
from nvrx.events import EventLog, RankTiming, TimingInfo  # noqa: E402
from nvrx.monitors.ft_config import FaultToleranceConfig  # noqa: E402
from nvrx.monitors.heartbeat import Slot, SlotWriter  # noqa: E402
from nvrx.monitors.straggler import MetricSummary, StragglerScorer, TimingSampler  # noqa: E402
from nvrx.common.net import start_store_server  # noqa: E402

OUTPUT = REPO / "bench" / "results" / "straggler.json"
TRAIN = REPO / "tests" / "straggler" / "train.py"
STEP_S = 0.03          # the rank's sleep per step (train.py STEP_SLEEP)


# ------------------------------------------------------------------ 1. detection delay


def detection_run(interval: float, factor: float, sustain: int) -> dict[str, Any]:
    """One job; the delay from rank 1's slowdown to the agent's first straggler event."""
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-straggler-") as tmp:
        work = Path(tmp)
        per_step = STEP_S + 0.004                       # sleep + matmuls + all-reduce, roughly
        slow_from = int(5 * interval / per_step)        # about 5 report intervals of steady steps first
        steps = slow_from + int(6 * interval / (per_step * factor))
        run_id = f"bstr{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "STEPS": str(steps),
               "STEP_SLEEP": str(STEP_S), "SLOW_RANK": "1", "SLOW_FACTOR": str(factor), "SLOW_FROM": str(slow_from),
               "SLOW_MARK": str(work / "slow_at")}
        cmd = [sys.executable, "-m", "nvrx", "launch", "--standalone", "--nproc-per-node", "2",
               "--rdzv-id", run_id, "--ft-param-straggler_report_interval", f"{interval:g}",
               "--ft-param-straggler_sustain_reports", str(sustain), str(TRAIN)]
        res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"the job failed ({res.returncode}): {res.stderr[-2000:]}")
        slow_at = float((work / "slow_at").read_text())
        flagged = [json.loads(line) for f in (work / "nvrx_logs" / run_id).glob("agent-*.jsonl")
                   for line in f.read_text().splitlines() if '"ev":"straggler"' in line]
        first = min((e for e in flagged if e["state"] == "straggler"), key=lambda e: e["t"], default=None)
        if first is None:
            return {"flagged": False, "slow_steps": steps - slow_from}
        return {"flagged": True, "rank": first["rank"], "relative": first["relative"],
                "delay_s": round(first["t"] - slow_at, 3), "delay_intervals": round((first["t"] - slow_at) / interval, 2)}


# ------------------------------------------------------------------ 2. cost per report


def _per_call(fn: Callable[[], Any], n: int) -> float:
    """Median seconds per call of FN over N calls (timed in 10 batches)."""
    batch = max(1, n // 10)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times)


def monitor_costs(tmp: Path) -> dict[str, float]:
    """A monitor's look at the slot (snapshot + sampler) and its end-of-window summary event."""
    slot = Slot.create(tmp / "slot")
    writer = SlotWriter(Slot.attach(tmp / "slot"))
    names = {0: "step", 1: "compute", 2: "io", 3: "checkpointing"}
    sampler = TimingSampler()
    log = EventLog(tmp / "monitor-bench-0.jsonl", "monitor-0")

    def look() -> None:
        for sid in range(3):
            writer.open_section(sid)
            writer.close_section(sid)
        writer.beat()
        snap = slot.snapshot()
        sampler.observe(snap.hb_count, snap.last_hb, snap.section_closes, snap.section_last, names)

    look_s = _per_call(look, 2000)
    for _ in range(20):  # a window of 20 looks
        look()

    def report() -> None:
        summary = sampler.take()
        log.emit(RankTiming(rank=0, global_rank=0, pid=1, window=10.0, timings=[
            TimingInfo(metric=k, median=m.median, samples=m.samples) for k, m in sorted(summary.items())]))
        for _ in range(20):
            look()

    report_s = _per_call(report, 200) - 20 * look_s
    log.close()
    return {"look_us": round(look_s * 1e6, 2), "report_us": round(report_s * 1e6, 1)}


def aggregator_pass_cost(tmp: Path, nproc: int = 8) -> dict[str, float]:
    """One pass of group rank 0's aggregator with NPROC local ranks, against a real TCPStore."""
    ft = FaultToleranceConfig(straggler_report_interval=10.0)
    store, port = start_store_server("127.0.0.1")
    rs = RendezvousStore(store, True, "127.0.0.1", port, RecordAuth("bench", generate_secret(), True, "generated"))
    group = RankMonitorGroup(ft, nproc, tmp, EventLog(None, "agent"), {}, tmp / "state", "bench")
    agg = StragglerAggregator(ft, group, EventLog(tmp / "agent-bench.jsonl", "agent"), rs, "bench", "bench",
                              "bench-node")
    logs = [EventLog(group.events_file(lr), f"monitor-{lr}") for lr in range(nproc)]
    result = RoundResult(0, 0, (NodeInfo("bench-node", "127.0.0.1", nproc),), 0, "127.0.0.1", port, True)
    times = []
    for i in range(60):
        for lr, log in enumerate(logs):  # fresh summaries (not timed): what the monitors wrote meanwhile
            log.emit(RankTiming(rank=lr, global_rank=lr, pid=1000 + lr, window=10.0, timings=[
                TimingInfo(metric="compute", median=0.05 * (1.5 if lr == 3 and i > 30 else 1.0), samples=20),
                TimingInfo(metric="<heartbeat>", median=0.08, samples=20)]))
        t0 = time.perf_counter()
        agg.step(result, time.time())
        times.append(time.perf_counter() - t0)
    for log in logs:
        log.close()
    agg.close()
    group.close()
    return {"ranks": nproc, "pass_ms": round(statistics.median(times) * 1e3, 3),
            "pass_p90_ms": round(sorted(times)[int(len(times) * 0.9)] * 1e3, 3)}


def scoring_costs() -> dict[str, float]:
    """StragglerScorer.update alone (3 metrics per rank), per report, by the number of ranks."""
    out = {}
    for ranks in (8, 64, 512, 4096):
        scorer = StragglerScorer()
        report = {r: (f"n{r // 8}", {m: MetricSummary(0.05 + 0.0001 * (r % 7), 20) for m in ("a", "b", "<heartbeat>")})
                  for r in range(ranks)}
        n = max(3, 2000 // ranks)
        out[str(ranks)] = round(_per_call(lambda: scorer.update(report, time.time()), n) * 1e3, 3)
    return out


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("nvrx.stragglers").setLevel(logging.ERROR)  # the in-process aggregator's flags: not output
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--interval", type=float, default=2.0, help="straggler_report_interval (s)")
    p.add_argument("--factor", type=float, default=1.5, help="how much slower rank 1 becomes")
    p.add_argument("--output", type=Path, default=OUTPUT)
    p.add_argument("--sustain", type=int, default=2, help="straggler_sustain_reports (default 2, the default)")
    args = p.parse_args(argv)
    runs = [detection_run(args.interval, args.factor, args.sustain) for _ in range(args.runs)]
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-straggler-cost-") as tmp:
        mon = monitor_costs(Path(tmp))
        agg = aggregator_pass_cost(Path(tmp))
    score = scoring_costs()
    delays = [r["delay_intervals"] for r in runs if r["flagged"]]
    summary = {"interval_s": args.interval, "factor": args.factor, "threshold": 1.2, "sustain_reports": args.sustain,
               "flagged_runs": f"{len(delays)}/{len(runs)}",
               "delay_intervals_median": statistics.median(delays) if delays else None,
               "delay_intervals_max": max(delays) if delays else None}
    out = {"summary": summary, "runs": runs, "monitor": mon, "aggregator_pass": agg, "scoring_ms_by_ranks": score,
           "machine": {"cpus": os.cpu_count()}, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"| what | value |\n|---|---|")
    print(f"| rank 1 becomes {args.factor}x slower: flagged in | {summary['flagged_runs']} runs |")
    print(f"| detection delay (report intervals of {args.interval:g} s), median / max | "
          f"{summary['delay_intervals_median']} / {summary['delay_intervals_max']} |")
    for r in runs:
        print(f"|   run | {r} |")
    print(f"| monitor: one look at the slot (snapshot + sampler) | {mon['look_us']} us |")
    print(f"| monitor: end-of-window summary + rank_timing event | {mon['report_us']} us |")
    print(f"| agent pass, {agg['ranks']} local ranks (read events, publish, gather, score), median / p90 | "
          f"{agg['pass_ms']} / {agg['pass_p90_ms']} ms |")
    for ranks, ms in score.items():
        print(f"| scoring one report, {ranks} ranks x 3 metrics | {ms} ms |")
    print(f"\nJSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
