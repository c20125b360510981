"""Side-by-side launch benchmark: nvrx vs torchrun (shared rendezvous store) vs torchrun-noshare.

Three metrics, 2 ranks on CPU/gloo, ``--standalone``:

* startup:  from just before Popen to "process group ready in all ranks" (max over ranks of the
            time right after init_process_group("gloo") + a first all_reduce).
* shutdown: from the last rank's exit (its final recorded timestamp, after destroy_process_group)
            to the launcher process exiting (wait() returns here).
* restart:  SIGKILL rank 1 at tk while the job runs; latency = max over ranks of the time the
            ranks of attempt 1 are ready again (PG re-initialised + first all_reduce) minus tk.
            Runs that do not reach attempt-1 readiness (or time out) count as failures.

Usage (from the repo root)::

    python bench/bench_launch.py --runs 5 [--only startup,shutdown,restart]
                                 [--launchers nvrx,torchrun,torchrun-noshare]

Writes a table to stdout and the raw samples + summary to bench/results/launch.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

LOG = logging.getLogger("bench_launch")

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PROBE = BENCH_DIR / "rank_probe.py"
DEFAULT_OUTPUT = BENCH_DIR / "results" / "launch.json"

NPROC = 2
MAX_RESTARTS = 3
MARKER_ENV = "NVRX_BENCH_RUN_ID"  # set in every launched process tree, used to find leftovers
POLL_S = 0.005
METRICS = ("startup", "shutdown", "restart")
ALL_LAUNCHERS = ("nvrx", "torchrun", "torchrun-noshare")
SHARE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Targets: (metric, kind, reference launcher or None, bound). kind "ratio": nvrx/ref <= bound;
# kind "abs": nvrx median (seconds) <= bound.
TARGETS: dict[str, tuple[str, str | None, float]] = {
    "startup": ("ratio", "torchrun", 1.0),
    "shutdown": ("abs", None, 0.2),
    "restart": ("ratio", "torchrun-noshare", 0.5),
}


# --------------------------------------------------------------------------------------------
# Launchers and runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launcher:
    """How to invoke one launcher: the argv before the torchrun-style flags, and env changes."""

    name: str
    prefix: tuple[str, ...]
    env: dict[str, str | None] = field(default_factory=dict)  # None = remove the variable


def make_launchers() -> dict[str, Launcher]:
    py = sys.executable
    torchrun = (py, "-m", "torch.distributed.run")
    return {
        "nvrx": Launcher("nvrx", (py, "-m", "nvrx", "launch")),
        "torchrun": Launcher("torchrun", torchrun, {SHARE_ENV: None}),
        "torchrun-noshare": Launcher("torchrun-noshare", torchrun, {SHARE_ENV: "1"}),
    }


@dataclass
class RunDirs:
    root: Path
    out: Path
    logs: Path
    console: Path

    @classmethod
    def create(cls, launcher: str, kind: str) -> "RunDirs":
        root = Path(tempfile.mkdtemp(prefix=f"nvrx-bench-{launcher}-{kind}-"))
        out, logs = root / "out", root / "logs"
        out.mkdir()
        return cls(root=root, out=out, logs=logs, console=root / "launcher.log")


@dataclass
class Sample:
    """One run's result. ``values`` maps metric -> seconds for the metrics this run measured."""

    launcher: str
    kind: str  # "launch" (startup + shutdown) or "restart"
    index: int
    ok: bool
    values: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    log_tail: list[str] | None = None
    run_dir: str | None = None  # kept only for failed runs


def build_command(launcher: Launcher, dirs: RunDirs, run_id: str, mode: str) -> list[str]:
    flags = [
        "--standalone",
        "--nproc-per-node", str(NPROC),
        "--max-restarts", str(MAX_RESTARTS),
        "--rdzv-id", run_id,
        "--log-dir", str(dirs.logs),
    ]
    return [*launcher.prefix, *flags, str(PROBE), "--out", str(dirs.out), "--mode", mode]


def build_env(launcher: Launcher, run_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"  # torchrun sets it anyway (with a warning); same for everyone
    env[MARKER_ENV] = run_id
    for key, value in launcher.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def start_launcher(launcher: Launcher, dirs: RunDirs, mode: str) -> tuple[subprocess.Popen, str, float]:
    """Start the launcher; returns (process, run id, t0 taken just before Popen)."""
    run_id = f"bench-{uuid.uuid4().hex[:12]}"
    cmd = build_command(launcher, dirs, run_id, mode)
    env = build_env(launcher, run_id)
    console = open(dirs.console, "wb")  # noqa: SIM115 - closed in finish_run
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc._bench_console = console  # type: ignore[attr-defined]
    LOG.debug("started %s pid=%d: %s", launcher.name, proc.pid, " ".join(cmd))
    return proc, run_id, t0


def _has_marker(proc: psutil.Process, run_id: str) -> bool:
    try:
        return proc.environ().get(MARKER_ENV) == run_id
    except (psutil.Error, OSError):
        return False


def _is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_leftovers(proc: subprocess.Popen, run_id: str) -> int:
    """SIGKILL the launcher's process tree plus any process carrying this run's marker."""
    victims: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            victims[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        if p.pid != os.getpid() and p.pid not in victims and _has_marker(p, run_id):
            victims[p.pid] = p
    alive = [p for p in victims.values() if _is_alive(p)]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    if proc.poll() is None:
        proc.wait(timeout=5)
    leftover = [p.pid for p in alive if p.pid != proc.pid]
    if leftover:
        LOG.debug("killed %d leftover process(es) of %s: %s", len(leftover), run_id, leftover)
    return len(leftover)


def snapshot_tree(proc: subprocess.Popen) -> list[str]:
    """What the launcher's process tree looks like (for failed runs): pid, status, command line."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    lines = []
    for p in procs:
        try:
            lines.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            continue
    return lines


def finish_run(proc: subprocess.Popen, run_id: str, sample: Sample, dirs: RunDirs, keep_all: bool) -> None:
    if not sample.ok:
        sample.detail["process_tree_at_failure"] = snapshot_tree(proc)
    sample.detail["leftover_processes_killed"] = kill_leftovers(proc, run_id)
    proc._bench_console.close()  # type: ignore[attr-defined]
    if not sample.ok:
        sample.log_tail = tail(dirs.console, 25)
    if sample.ok and not keep_all:
        shutil.rmtree(dirs.root, ignore_errors=True)
    else:
        sample.run_dir = str(dirs.root)


def tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def read_records(out: Path, prefix: str, attempt: int) -> list[dict[str, Any]] | None:
    """All ranks' records of one attempt, or None if any rank's file is still missing."""
    records = []
    for rank in range(NPROC):
        path = out / f"{prefix}-a{attempt}-r{rank}.json"
        if not path.exists():
            return None
        records.append(json.loads(path.read_text()))
    return records


def wait_for_records(
    proc: subprocess.Popen, out: Path, prefix: str, attempt: int, deadline: float
) -> list[dict[str, Any]] | None:
    """Poll until all ranks wrote their record for ``attempt``; give up at the deadline, when the
    launcher exits, or when a later attempt already shows up (this one is lost)."""
    while time.time() < deadline:
        records = read_records(out, prefix, attempt)
        if records is not None:
            return records
        if proc.poll() is not None or any(a > attempt for a in attempts_seen(out)):
            return read_records(out, prefix, attempt)
        time.sleep(POLL_S)
    return None


# --------------------------------------------------------------------------------------------
# The two kinds of run
# --------------------------------------------------------------------------------------------


def run_launch(launcher: Launcher, index: int, timeout: float, keep_all: bool) -> Sample:
    """One clean run: measures startup and shutdown."""
    dirs = RunDirs.create(launcher.name, "launch")
    sample = Sample(launcher.name, "launch", index, ok=False)
    proc, run_id, t0 = start_launcher(launcher, dirs, "startup")
    try:
        try:
            rc = proc.wait(timeout=timeout)
            t_end = time.time()
        except subprocess.TimeoutExpired:
            sample.error = f"launcher did not exit within {timeout:.0f} s"
            return sample
        sample.detail["launcher_rc"] = rc
        ready = read_records(dirs.out, "ready", 0)
        exits = read_records(dirs.out, "exit", 0)
        if rc != 0 or ready is None or exits is None:
            sample.error = f"launcher rc={rc}, ready files={'ok' if ready else 'missing'}, " \
                           f"exit files={'ok' if exits else 'missing'}"
            return sample
        t_ready = max(r["t_ready"] for r in ready)
        t_exit = max(r["t_exit"] for r in exits)
        sample.values = {"startup": t_ready - t0, "shutdown": t_end - t_exit}
        sample.detail.update(
            to_user_code=max(r["t_script_start"] for r in ready) - t0,
            import_torch=max(r["t_import_done"] - r["t_script_start"] for r in ready),
            init_pg=max(r["t_ready"] - r["t_import_done"] for r in ready),
        )
        sample.ok = True
        return sample
    finally:
        finish_run(proc, run_id, sample, dirs, keep_all)


def run_restart(launcher: Launcher, index: int, timeout: float, restart_timeout: float, keep_all: bool) -> Sample:
    """One fault run: SIGKILL rank 1 once the job is up; measures the restart latency."""
    dirs = RunDirs.create(launcher.name, "restart")
    sample = Sample(launcher.name, "restart", index, ok=False)
    proc, run_id, t0 = start_launcher(launcher, dirs, "restart")
    try:
        first = wait_for_records(proc, dirs.out, "ready", 0, t0 + timeout)
        if first is None:
            sample.error = f"attempt 0 never got ready (launcher rc={proc.poll()})"
            sample.detail["setup_failure"] = True
            return sample
        victim = next(r for r in first if r["rank"] == 1)["pid"]
        time.sleep(0.2)  # let the all_reduce loop run for a bit
        tk = time.time()
        os.kill(victim, signal.SIGKILL)
        again = wait_for_records(proc, dirs.out, "ready", 1, tk + restart_timeout)
        sample.detail["launcher_rc_at_detection"] = proc.poll()
        if again is None:
            waited = time.time() - tk
            sample.detail.update(waited_s=waited, attempts_seen=attempts_seen(dirs.out))
            sample.error = (f"no attempt-1 readiness ({waited:.1f} s after the kill; launcher rc={proc.poll()}, "
                            f"attempts that got ready: {attempts_seen(dirs.out)})")
            note_late_recovery(proc, dirs.out, sample, tk, tk + restart_timeout)
            return sample
        t_back = max(r["t_ready"] for r in again)
        sample.values = {"restart": t_back - tk}
        sample.detail.update(
            to_user_code=max(r["t_script_start"] for r in again) - tk,
            init_pg=max(r["t_ready"] - r["t_script_start"] for r in again),
        )
        try:
            rc = proc.wait(timeout=max(5.0, restart_timeout - (time.time() - tk)))
        except subprocess.TimeoutExpired:
            rc = None
        sample.detail["launcher_rc"] = rc
        sample.ok = rc == 0
        if not sample.ok:
            sample.error = f"recovered, but the launcher then exited with rc={rc}"
        return sample
    finally:
        finish_run(proc, run_id, sample, dirs, keep_all)


def note_late_recovery(proc: subprocess.Popen, out: Path, sample: Sample, tk: float, deadline: float) -> None:
    """Attempt 1 was lost; if a later attempt started, record whether and when it got ready (info only)."""
    later = [a for a in attempts_seen(out) if a > 1]
    if not later:
        return
    records = wait_for_records(proc, out, "ready", later[0], deadline)
    if records is not None:
        sample.detail["recovered_in_attempt"] = later[0]
        sample.detail["recovered_after_s"] = max(r["t_ready"] for r in records) - tk
        sample.error = f"{sample.error}; recovered only in attempt {later[0]}, " \
                       f"{sample.detail['recovered_after_s']:.1f} s after the kill"


def attempts_seen(out: Path) -> list[int]:
    """Attempts (restart counts) for which at least one rank got ready."""
    return sorted({int(p.name.split("-")[1][1:]) for p in out.glob("ready-a*-r*.json")})


# --------------------------------------------------------------------------------------------
# Summary, table, JSON
# --------------------------------------------------------------------------------------------


def summarize(samples: list[Sample], launchers: list[str], metrics: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for name in launchers:
        summary[name] = {}
        for metric in metrics:
            kind = "restart" if metric == "restart" else "launch"
            runs = [s for s in samples if s.launcher == name and s.kind == kind]
            values = [s.values[metric] for s in runs if s.ok and metric in s.values]
            summary[name][metric] = {
                "median": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "n_ok": len(values),
                "n_runs": len(runs),
                "failures": len(runs) - len(values),
            }
    return summary


def ratio(summary: dict[str, dict[str, Any]], metric: str, num: str, den: str) -> float | None:
    try:
        a, b = summary[num][metric]["median"], summary[den][metric]["median"]
    except KeyError:
        return None
    return a / b if a is not None and b else None


def target_verdict(summary: dict[str, dict[str, Any]], metric: str) -> tuple[str, bool | None]:
    kind, ref, bound = TARGETS[metric]
    if kind == "abs":
        text = f"nvrx <= {bound:.2f} s"
        value = summary.get("nvrx", {}).get(metric, {}).get("median")
    else:
        text = f"nvrx/{ref} <= {bound:.1f}x"
        value = ratio(summary, metric, "nvrx", ref or "")
    failed_runs = summary.get("nvrx", {}).get(metric, {}).get("failures", 0)
    if value is None:
        return text, (False if failed_runs else None)  # nvrx ran but never produced a value: not met
    failed = summary.get("nvrx", {}).get(metric, {}).get("failures", 0)
    return text, value <= bound and not failed  # a launcher that loses runs does not meet a target


def fmt_s(entry: dict[str, Any], metric: str) -> str:
    med = entry["median"]
    text = "-" if med is None else f"{med:.3f} s"
    if metric == "restart" and entry["n_runs"]:
        text += f" (fail {entry['failures']}/{entry['n_runs']})"
    elif entry["failures"]:
        text += f" ({entry['failures']} bad)"
    return text


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table_rows(summary: dict[str, dict[str, Any]], launchers: list[str], metrics: list[str]) -> tuple[list[str], list[list[str]]]:
    refs = [r for r in ("torchrun", "torchrun-noshare") if "nvrx" in launchers and r in launchers]
    header = ["metric", *launchers, *(f"nvrx/{r}" for r in refs), "target", "met"]
    rows = []
    for metric in metrics:
        text, met = target_verdict(summary, metric)
        rows.append([
            metric,
            *(fmt_s(summary[name][metric], metric) for name in launchers),
            *(fmt_ratio(ratio(summary, metric, "nvrx", r)) for r in refs),
            text,
            {True: "yes", False: "NO", None: "n/a"}[met],
        ])
    return header, rows


def print_table(header: list[str], rows: list[list[str]], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print_plain_table(header, rows, title)
        return
    table = Table(title=title)
    for col in header:
        table.add_column(col, justify="left" if col in ("metric", "target") else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(160, shutil.get_terminal_size().columns)).print(table)


def print_plain_table(header: list[str], rows: list[list[str]], title: str) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print(title)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print(line)
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def machine_info() -> dict[str, Any]:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        "cpu_count": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "load_avg_at_start": list(os.getloadavg()),
    }


def save_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def parse_list(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{what}: {', '.join(bad) or '(empty)'}; choose from {', '.join(allowed)}")
    return [a for a in allowed if a in items]  # canonical order


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark nvrx launch against torchrun (startup, shutdown, restart).")
    p.add_argument("--runs", type=int, default=5, help="measured runs per launcher and kind (default 5)")
    p.add_argument("--only", type=lambda v: parse_list(v, METRICS, "--only"), default=list(METRICS),
                   help="comma list of metrics: startup,shutdown,restart")
    p.add_argument("--launchers", type=lambda v: parse_list(v, ALL_LAUNCHERS, "--launchers"),
                   default=list(ALL_LAUNCHERS), help="comma list: nvrx,torchrun,torchrun-noshare")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured launch runs per launcher first (default 1)")
    add_run_options(p, DEFAULT_OUTPUT, timeout=90.0, restart_timeout=40.0)
    return parse_checked(p, argv)


def add_run_options(p: argparse.ArgumentParser, output: Path, timeout: float, restart_timeout: float) -> None:
    """Options every launch-driving benchmark shares (this one and bench_detection.py)."""
    p.add_argument("--timeout", type=float, default=timeout, help="per-run limit for a launch / attempt 0 (s)")
    p.add_argument("--restart-timeout", type=float, default=restart_timeout,
                   help="after the fault, how long to wait for attempt 1 before calling the run a failure (s)")
    p.add_argument("--output", type=Path, default=output, help=f"JSON output (default {output})")
    p.add_argument("--keep-run-dirs", action="store_true", help="keep every run's temp dir (failed ones are always kept)")
    p.add_argument("-v", "--verbose", action="store_true")


def parse_checked(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return args


def describe(sample: Sample) -> str:
    if not sample.ok:
        return f"FAILED: {sample.error}"
    return ", ".join(f"{k} {v:.3f} s" for k, v in sample.values.items())


def plan_runs(args: argparse.Namespace, launchers: dict[str, Launcher]) -> list[tuple[str, Callable[[], Sample]]]:
    """Interleave launchers within each round so slow drifts of the machine hit all of them alike."""
    kinds = []
    if {"startup", "shutdown"} & set(args.only):
        kinds.append("launch")
    if "restart" in args.only:
        kinds.append("restart")
    plan: list[tuple[str, Callable[[], Sample]]] = []
    for i in range(args.runs):
        for kind in kinds:
            for name in args.launchers:
                lau = launchers[name]
                if kind == "launch":
                    fn = lambda lau=lau, i=i: run_launch(lau, i, args.timeout, args.keep_run_dirs)  # noqa: E731
                else:
                    fn = lambda lau=lau, i=i: run_restart(  # noqa: E731
                        lau, i, args.timeout, args.restart_timeout, args.keep_run_dirs)
                plan.append((f"{name} {kind} run {i + 1}/{args.runs}", fn))
    return plan


def byte_compile_nvrx() -> None:
    """Byte-compile the nvrx package, as installing a wheel does (torch's own came compiled with pip).

    A source checkout run with PYTHONDONTWRITEBYTECODE=1 (as on the dev VM) would otherwise compile every
    module in every process it starts (agent, template, monitors): ~1 s of CPU per start that no
    installed copy pays. Stale files are recompiled by Python from the sources' timestamps, never used.
    """
    import compileall

    compileall.compile_dir(str(REPO_ROOT / "nvrx"), quiet=2)


def warm_up(args: argparse.Namespace, launchers: dict[str, Launcher]) -> list[dict[str, Any]]:
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=False)  # page cache
    byte_compile_nvrx()
    results = []
    for _ in range(args.warmup):
        for name in args.launchers:
            s = run_launch(launchers[name], -1, args.timeout, args.keep_run_dirs)
            LOG.info("warm-up %s: %s", name, describe(s))
            results.append(asdict(s))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    launchers = make_launchers()
    info = machine_info()
    LOG.info("machine: %s cpus, torch %s, python %s", info["cpu_count"], info["torch"], info["python"])
    t_start = time.monotonic()
    warmups = warm_up(args, launchers)
    samples: list[Sample] = []
    for label, fn in plan_runs(args, launchers):
        sample = fn()
        samples.append(sample)
        level = logging.INFO if sample.ok else logging.WARNING
        LOG.log(level, "%s: %s", label, describe(sample))
        leftovers = sample.detail.get("leftover_processes_killed", 0)
        if sample.ok and leftovers:
            LOG.warning("  %d process(es) of this run were still alive after the launcher exited (killed)", leftovers)
        if not sample.ok and sample.log_tail:
            LOG.warning("  launcher output, last lines (all of it in %s/launcher.log):\n    %s",
                        sample.run_dir, "\n    ".join(line[:300] for line in sample.log_tail[-6:]))
    elapsed = time.monotonic() - t_start

    summary = summarize(samples, args.launchers, args.only)
    header, rows = table_rows(summary, args.launchers, args.only)
    title = f"launch benchmark: {NPROC} ranks, gloo/CPU, --standalone, median of {args.runs} run(s)"
    print()
    print_table(header, rows, title)
    ratios = {m: {"nvrx/torchrun": ratio(summary, m, "nvrx", "torchrun"),
                  "nvrx/torchrun-noshare": ratio(summary, m, "nvrx", "torchrun-noshare")} for m in args.only}
    targets = {m: {"target": target_verdict(summary, m)[0], "met": target_verdict(summary, m)[1]} for m in args.only}
    save_json(args.output, {
        "machine": info,
        "config": {"runs": args.runs, "metrics": args.only, "launchers": args.launchers, "nproc_per_node": NPROC,
                   "max_restarts": MAX_RESTARTS, "timeout_s": args.timeout, "restart_timeout_s": args.restart_timeout,
                   "warmup": args.warmup,
                   "commands": {n: list(launchers[n].prefix) for n in args.launchers},
                   "env_overrides": {n: launchers[n].env for n in args.launchers}},
        "elapsed_s": elapsed,
        "summary": summary,
        "ratios": ratios,
        "targets": targets,
        "samples": [asdict(s) for s in samples],
        "warmup_samples": warmups,
    })
    print(f"\nelapsed {elapsed:.0f} s; raw samples and summary saved to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
