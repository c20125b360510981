"""Re-run state machine benchmark: what `validate_result` costs a healthy step, and how long a reproduced
fault takes to be re-run on other hardware.

1. **overhead**: 2 ranks (real processes, gloo, TCPStore), the same training loop (a linear model,
   SGD, all-reduced gradients) in four modes: ``plain`` (no machine), ``validated`` (mode
   ``validate_results``: ``while rsm.should_run_forward_backward(data)`` with a RerunDataIterator,
   ``rsm.validate_result(loss, is_nan_or_inf, ...)`` and a SpikeDetector check), ``disabled`` (the same
   calls, mode ``disabled``) and ``agree`` (plain + the one-integer all-reduce the machine makes per step,
   to show its share). The modes alternate step by step in the same two processes, so load drifts hit all
   of them; every step is timed and the median per mode compared. Reported: per-step times, the overhead
   (validated - plain) in microseconds, the ratio validated / plain, and the overhead as a share of a
   50 ms step (the issue's target: < 1 %).
2. **fault to training again**: tests/rerun/train_rerun.py under `nvrx launch` (2 ranks), a NaN that
   node nvrx-n1 reproduces: job 1 exits 16 after its checkpoint, job 2 on nvrx-n2 resumes and re-runs
   the step. From the events: reproduced (``rerun_attempt``) -> job 1 ended -> job 2 started -> verdict
   (``rerun_verdict``, training goes on). No scheduler in between: a real job also waits for Slurm.

Usage (from the repo root)::

    python bench/bench_rerun.py [--steps 500] [--rounds 4] [--fault-runs 2]

Prints a table and writes bench/results/rerun.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_OUTPUT = BENCH_DIR / "results" / "rerun.json"
STEP_TARGET_S = 0.050
MODES = ("plain", "validated", "disabled", "agree")


# ---------------------------------------------------------------------- 1. overhead

def worker(rank: int, port: int, steps: int, rounds: int, out: Path) -> None:
    """One rank: STEPS x ROUNDS steps in each mode, the modes alternating step by step (load drifts hit all
    of them alike); rank 0 writes every step's seconds, by mode, to OUT."""
    import torch
    import torch.distributed as dist

    from launcher.rank.rerun import RerunDataIterator, RerunStateMachine, SpikeDetector, is_nan_or_inf
    from launcher.rank.rerun.collective import reduce_max

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)
    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = RerunDataIterator(torch.randn(32, 64) for _ in iter(int, 1))
    plain_data = iter(lambda: torch.randn(32, 64), None)
    machines = {"validated": RerunStateMachine(mode="validate_results"), "disabled": RerunStateMachine()}
    spike = SpikeDetector(factor=100.0)

    def step_body(src: Any) -> Any:
        opt.zero_grad()
        loss = (model(next(src)) ** 2).mean()
        loss.backward()
        return loss

    def one_step(mode: str) -> None:
        if mode == "plain":
            step_body(plain_data)
        elif mode == "agree":  # the plain step + the machine's one collective per step (its share of the cost)
            step_body(plain_data)
            reduce_max([0])
        else:
            rsm = machines[mode]
            while rsm.should_run_forward_backward(data):
                loss = step_body(data)
                rsm.validate_result(loss, is_nan_or_inf, "loss is NaN or Inf")
                rsm.validate_result(loss, spike, "loss spike", fatal=False)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()

    for mode in MODES * 10:  # warm-up
        one_step(mode)
    dist.barrier()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(steps * rounds * len(MODES)):  # the modes alternate step by step: load drifts hit all alike
        mode = MODES[i % len(MODES)]
        t0 = time.perf_counter()
        one_step(mode)
        times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "NVRX_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


def bench_overhead(steps: int, rounds: int) -> dict[str, Any]:
    """Seconds per step of each mode (2 real rank processes), and the overhead of the machine."""
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-rerun-") as d:
        port, out = _free_port(), Path(d) / "times.json"
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), str(steps), str(rounds),
                                   str(out)], env=_env(), cwd=REPO) for r in (0, 1)]
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes != [0, 0]:
            raise RuntimeError(f"overhead workers exited {codes}")
        per: dict[str, list[float]] = json.loads(out.read_text())
    med = {m: statistics.median(v) for m, v in per.items()}
    over = med["validated"] - med["plain"]
    return {"steps_per_mode": len(per["plain"]), "median_per_step_s": med,
            "mean_per_step_s": {m: statistics.fmean(v) for m, v in per.items()},
            "overhead_s": over, "overhead_disabled_s": med["disabled"] - med["plain"],
            "overhead_agree_s": med["agree"] - med["plain"],
            "ratio_validated_over_plain": med["validated"] / med["plain"],
            "overhead_share_of_50ms_step": over / STEP_TARGET_S}


# ---------------------------------------------------------------------- 2. fault -> training again

def _events(log_dir: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(log_dir.rglob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _launch(work: Path, logs: Path, inject: str, node: str) -> tuple[int, float, float]:
    env = _env()
    env["SLURMD_NODENAME"] = node
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "nvrx_cli.main", "launch", "--nproc-per-node", "2", "--standalone",
                           "--log-dir", str(logs), "-q", str(REPO / "tests" / "rerun" / "train_rerun.py"), str(work),
                           inject], env=env, cwd=work.parent, capture_output=True, text=True, timeout=300)
    return proc.returncode, t0, time.time()


def bench_fault(runs: int) -> dict[str, Any]:
    results = []
    for _ in range(runs):
        d = Path(tempfile.mkdtemp(prefix="nvrx-bench-rerun-fault-"))
        try:
            work, logs = d / "work", d / "logs"
            work.mkdir()
            code1, _, end1 = _launch(work, logs, "node", "nvrx-n1")
            code2, start2, _ = _launch(work, logs, "node", "nvrx-n2")
            if (code1, code2) != (16, 0):
                raise RuntimeError(f"fault run exited {code1}, {code2}")
            evs = _events(logs)
            reproduced = next(e["t"] for e in evs if e["ev"] == "rerun_attempt" and e.get("reproduced"))
            verdict = next(e["t"] for e in evs if e["ev"] == "rerun_verdict")
            results.append({"reproduced_to_exit_s": end1 - reproduced, "exit_to_relaunch_s": start2 - end1,
                            "relaunch_to_verdict_s": verdict - start2, "total_s": verdict - reproduced})
        finally:
            shutil.rmtree(d, ignore_errors=True)
    keys = results[0].keys()
    return {"runs": results, "median": {k: statistics.median(r[k] for r in results) for k in keys}}


# ---------------------------------------------------------------------- report

def table(res: dict[str, Any]) -> str:
    o, f = res["overhead"], res.get("fault")
    med = o["median_per_step_s"]
    lines = [f"validate_result overhead, 2 ranks gloo, {o['steps_per_mode']} steps per mode, interleaved (median):",
             "  mode        per step",
             *(f"  {m:<10}  {med[m] * 1e6:8.1f} us" for m in MODES),
             f"  overhead (validated - plain): {o['overhead_s'] * 1e6:.1f} us per step; ratio validated/plain "
             f"{o['ratio_validated_over_plain']:.3f}; {o['overhead_share_of_50ms_step'] * 100:.3f} % of a 50 ms step "
             f"(target < 1 %)",
             f"  of which the one all-reduce that keeps the ranks in step (mode agree - plain): "
             f"{o['overhead_agree_s'] * 1e6:.1f} us",
             f"  disabled mode overhead: {o['overhead_disabled_s'] * 1e6:.1f} us per step"]
    if f:
        m = f["median"]
        lines += [f"reproduced fault -> training again on other hardware ({len(f['runs'])} runs, median):",
                  f"  reproduced -> job 1 exited (checkpoint, exit 16): {m['reproduced_to_exit_s']:.2f} s",
                  f"  job 1 exited -> job 2 launched (no scheduler here): {m['exit_to_relaunch_s']:.2f} s",
                  f"  job 2 launched -> step re-run, verdict, training again: {m['relaunch_to_verdict_s']:.2f} s",
                  f"  total: {m['total_s']:.2f} s"]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, port, steps, rounds, out = sys.argv[2:7]
        sys.path.insert(0, str(REPO))
        worker(int(rank), int(port), int(steps), int(rounds), Path(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500, help="steps per mode = steps x rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--fault-runs", type=int, default=2, help="0 skips part 2")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = ap.parse_args()
    res: dict[str, Any] = {"overhead": bench_overhead(args.steps, args.rounds)}
    if args.fault_runs:
        res["fault"] = bench_fault(args.fault_runs)
    res["load_avg"] = os.getloadavg()
    res["command"] = " ".join(["python", "bench/bench_rerun.py", *sys.argv[1:]])
    print(table(res))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
