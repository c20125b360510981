"""Goodput under faults, end to end: nvrx and torchrun side by side on one training job.

The workload (``bench/goodput_train.py``): 2 ranks (gloo), a ~2.1 M-parameter MLP with Adam under DDP,
steps of ~50 ms, resumed from its newest checkpoint at start. A fault injector in this process (outside the
ranks) SIGKILLs (crash) or SIGSTOPs (hang) one rank after a seeded number of seconds of training in each
attempt; every launcher gets the same schedule. Variants:

* ``save200``: ``torch.save`` every 200 steps (the user changed nothing); every launcher runs the same script.
* ``every10``: checkpoints every 10 steps; nvrx with its asynchronous checkpoint (``nvrx.ckpt.PeriodicCheckpointer``,
  ``--async-ckpt``), torchrun with ``torch.save``. Goodput is against the launcher's fault-free run *without*
  checkpoints, so the checkpoint cost counts.

goodput = fault-free wall / faulty wall (wall: launch -> the last rank's last step). Per fault, from the
timestamps the ranks write and the injector's own observations of the rank processes:
detect (fault -> the first rank process of the attempt ends on its own or by the launcher), stop (-> all gone),
respawn (-> every new rank in user code), worker init (-> every new rank's first step done), recompute
(-> the step reached before the fault is done again). Their sum is the time lost to the fault.

Usage (from the repo root)::

    python bench/bench_goodput.py --quick                     # a few minutes
    python bench/bench_goodput.py                             # the issue's workload: 2000 steps, 4 faults
    python bench/bench_goodput.py --steps 1000 --faults 3 --interval 12 --variants save200,every10

Prints a table, writes bench/results/goodput.json and one SVG plot per variant and fault kind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_launch as bl  # noqa: E402  (launcher table, env, cleanup, table and JSON helpers)
import goodput_svg  # noqa: E402

LOG = logging.getLogger("bench_goodput")
TRAIN = BENCH_DIR / "goodput_train.py"
RESULTS = BENCH_DIR / "results"
VARIANTS = ("save200", "every10", "inprocess")
TRAIN_INPROCESS = BENCH_DIR / "goodput_inprocess_train.py"
KINDS = ("crash", "hang")
LAUNCHERS = ("nvrx", "torchrun-noshare", "torchrun", "ft_launcher")
POLL_S = 0.01
WORLD = 2
# A reference run whose machine load (1-minute average per core) differs from the measured run's by more than
# this does not measure the same machine: the figures derived from it are "invalid: rerun".
LOAD_MARGIN_PER_CORE = 0.5
# The range each derived figure can have; a value outside it is a measurement artefact (a slow reference, a
# load swing), never a result: goodput 1.70 or a checkpoint cost of -1.3 % were once reported as targets met.
FIGURE_RANGES: dict[str, tuple[float, float]] = {
    "goodput": (0.0, 1.0), "goodput_from_lost": (0.0, 1.0), "ckpt_cost_of_wall": (0.0, math.inf),
    "ckpt_blocked_of_wall": (0.0, 1.0), "goodput_vs_peer": (0.0, math.inf)}


@dataclass(frozen=True)
class Settings:
    """Everything that defines the runs (saved in the JSON)."""

    steps: int
    faults: int
    interval: float  # mean seconds of training in an attempt before its fault
    jitter: float  # +- uniform
    seed: int
    save_every: int  # the save200 variant's interval (steps)
    pause: float
    hang_timeout: float  # nvrx's automatic-heartbeat timeout
    pg_timeout: float
    big: bool
    variants: tuple[str, ...]
    kinds: tuple[str, ...]
    launchers: tuple[str, ...]
    run_timeout: float
    auto_timeout: str = "off"  # nvrx's heartbeat_timeout_auto (off | suggest | set; off: runs before it existed)
    auto_timeout_min: float = 0.1  # ... and its floor (heartbeat_timeout_auto_min)
    auto_timeout_warmup: float = 20.0  # ... and its warm-up (heartbeat_timeout_auto_warmup_seconds)
    soft_timeout: float = 1.0  # inprocess variant: the script's Wrapper(soft_timeout=...)


@dataclass(frozen=True)
class Fault:
    after_s: float  # seconds of training in the attempt (from its first step done)
    rank: int


@dataclass(frozen=True)
class RunSpec:
    """One launch: which launcher, which variant, which faults ("none": fault-free), which checkpointing."""

    launcher: str
    variant: str
    kind: str  # none | crash | hang
    ckpt: str  # none | torch_save | nvrx
    every: int

    @property
    def label(self) -> str:
        return f"{self.variant}/{self.kind}/{self.ckpt}/{self.launcher}"


@dataclass
class RunResult:
    spec: RunSpec
    t0: float = 0.0  # time.time() just before the launcher was started
    load: float | None = None  # 1-minute load average when the run started
    ok: bool = False
    error: str | None = None
    wall_s: float | None = None
    exit_s: float | None = None
    rc: int | None = None
    step_median_s: float | None = None
    ckpt_blocked_s: float | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)
    progress: list[tuple[float, int]] = field(default_factory=list)  # (s since launch, steps done), rank 0
    log_tail: list[str] | None = None
    run_dir: str | None = None
    monitor: dict[str, Any] | None = None  # nvrx: what its rank monitors logged (hangs, automatic timeouts)


# ------------------------------------------------------------------------------------------ schedule and runs


def make_schedule(seed: int, count: int, mean: float, jitter: float) -> list[Fault]:
    """The same faults for every launcher: seconds of training per attempt, and the rank hit."""
    rng = random.Random(seed)
    return [Fault(round(rng.uniform(mean - jitter, mean + jitter), 2), rng.randrange(WORLD)) for _ in range(count)]


def plan(settings: Settings) -> list[RunSpec]:
    """Runs in an order that interleaves launchers, and fault-free reference runs with faulty ones: a fresh
    reference right before each fault kind's runs, so each faulty run is compared with one made under the same
    machine load (load drifts over a long benchmark; one reference at the start measured another machine)."""
    runs: list[RunSpec] = []
    for variant in settings.variants:
        for i, kind in enumerate(settings.kinds or ("none",)):
            for name in settings.launchers:  # the references of this kind's runs
                ckpt = _ckpt_of(variant, name)
                if variant == "save200":
                    runs.append(RunSpec(name, variant, "none", ckpt, settings.save_every))
                    continue
                runs.append(RunSpec(name, variant, "none", "none", 10))  # the reference without checkpoints
                if i == 0:
                    runs.append(RunSpec(name, variant, "none", ckpt, 10))  # the checkpoint cost alone, once
            if kind == "none":
                continue
            for name in settings.launchers:
                every = settings.save_every if variant == "save200" else 10
                runs.append(RunSpec(name, variant, kind, _ckpt_of(variant, name), every))
    return runs


def _ckpt_of(variant: str, launcher: str) -> str:
    """The checkpointing of VARIANT's runs under LAUNCHER."""
    if variant == "save200":
        return "torch_save"
    if variant == "inprocess":  # nvrx: model in memory, snapshots in memory; torchrun: torch.save
        return "memory" if launcher == "nvrx" else "torch_save"
    return "nvrx" if launcher == "nvrx" else "torch_save"


def command(spec: RunSpec, settings: Settings, dirs: bl.RunDirs, run_id: str, launcher: bl.Launcher) -> list[str]:
    flags = ["--standalone", "--nproc-per-node", str(WORLD), "--max-restarts", str(settings.faults + 3),
             "--rdzv-id", run_id, "--log-dir", str(dirs.logs)]
    if spec.launcher == "nvrx" and spec.variant == "inprocess":  # the Wrapper in the script handles the faults
        flags.append("--inprocess")
    elif spec.launcher == "nvrx":  # set once by the user; the same for every nvrx run
        flags += ["--ft-param-auto-heartbeat", "true", "--ft-param-rank-heartbeat-timeout", f"{settings.hang_timeout:g}",
                  "--ft-param-heartbeat-timeout-auto", settings.auto_timeout,
                  "--ft-param-heartbeat-timeout-auto-min", f"{settings.auto_timeout_min:g}",
                  "--ft-param-heartbeat-timeout-auto-warmup-seconds", f"{settings.auto_timeout_warmup:g}"]
        if spec.ckpt == "nvrx":
            flags.append("--async-ckpt")
    ckpt_dir = dirs.root / "ckpt"
    ckpt_dir.mkdir(exist_ok=True)
    args = ["--out", str(dirs.out), "--steps", str(settings.steps), "--pause", f"{settings.pause:g}",
            "--ckpt", spec.ckpt, "--every", str(spec.every), "--ckpt-dir", str(ckpt_dir),
            "--pg-timeout", f"{settings.pg_timeout:g}", *(["--big"] if settings.big else [])]
    if spec.variant == "inprocess":
        args += ["--soft-timeout", f"{settings.soft_timeout:g}"]
    return [*launcher.prefix, *flags, str(TRAIN_INPROCESS if spec.variant == "inprocess" else TRAIN), *args]


def launchers() -> dict[str, bl.Launcher]:
    table = bl.make_launchers()
    exe = shutil.which("ft_launcher")
    if exe:
        table["ft_launcher"] = bl.Launcher("ft_launcher", (exe,))
    return table


def ft_launcher_available() -> bool:
    return shutil.which("ft_launcher") is not None or importlib.util.find_spec("nvidia_resiliency_ext") is not None


# ------------------------------------------------------------------------------------------ the injector


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ready_records(out: Path, attempt: int) -> list[dict[str, Any]] | None:
    records = [read_json(out / f"ready-a{attempt}-r{r}.json") for r in range(WORLD)]
    return None if any(r is None for r in records) else records  # type: ignore[return-value]


def training_done(out: Path) -> bool:
    return all((out / f"done-r{r}.json").exists() for r in range(WORLD))


def newest_ready_attempt(out: Path, since: int) -> tuple[int, list[dict[str, Any]]] | None:
    """The newest attempt >= SINCE whose ranks all wrote their ready record."""
    attempts = sorted({int(p.name.split("-")[1][1:]) for p in out.glob("ready-a*-r*.json")}, reverse=True)
    for a in attempts:
        if a >= since and (records := ready_records(out, a)) is not None:
            return a, records
    return None


def first_step_time(out: Path, attempt: int, rank: int) -> float | None:
    try:
        with open(out / f"progress-a{attempt}-r{rank}.txt") as fh:
            line = fh.readline()
    except OSError:
        return None
    parts = line.split()
    return float(parts[1]) if len(parts) == 2 and line.endswith("\n") else None


def gone(pid: int) -> bool:
    """Dead (exited, or a zombie its parent has not reaped); a stopped process is alive."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


class Injector:
    """Fires the schedule into one run and watches the rank processes of each faulted attempt end."""

    def __init__(self, proc: subprocess.Popen, out: Path, kind: str, deadline: float, inrank: bool = False) -> None:
        self.proc, self.out, self.kind, self.deadline = proc, out, kind, deadline
        self.inrank = inrank  # inprocess variant: an exception (SIGUSR1) or a hang (SIGUSR2) inside the rank

    def alive(self) -> bool:
        return self.proc.poll() is None and not training_done(self.out) and time.time() < self.deadline

    def run(self, schedule: list[Fault]) -> list[dict[str, Any]]:
        fired, attempt = [], 0
        for fault in schedule:
            found = self._wait_attempt(attempt)
            if found is None:
                break
            attempt, records = found
            t_first = self._wait_first_step(attempt)
            if t_first is None or not self._sleep_until(t_first + fault.after_s):
                break
            fired.append(self._fire(fault, attempt, records))
            attempt += 1
        return fired

    def _wait_attempt(self, since: int) -> tuple[int, list[dict[str, Any]]] | None:
        while self.alive():
            if (found := newest_ready_attempt(self.out, since)) is not None:
                return found
            time.sleep(POLL_S)
        return None

    def _wait_first_step(self, attempt: int) -> float | None:
        while self.alive():
            times = [first_step_time(self.out, attempt, r) for r in range(WORLD)]
            if all(t is not None for t in times):
                return max(times)  # type: ignore[type-var]
            time.sleep(POLL_S)
        return None

    def _sleep_until(self, t: float) -> bool:
        while self.alive():
            left = t - time.time()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))
        return False

    def _fire(self, fault: Fault, attempt: int, records: list[dict[str, Any]]) -> dict[str, Any]:
        victim = records[fault.rank]["pid"]
        t_fault = time.time()
        if self.inrank:
            os.kill(victim, signal.SIGUSR1 if self.kind == "crash" else signal.SIGUSR2)
        else:
            os.kill(victim, signal.SIGKILL if self.kind == "crash" else signal.SIGSTOP)
        pids = [r["pid"] for r in records]
        watched = [p for p in pids if p != victim] if self.kind == "crash" and not self.inrank else pids
        t_first_gone, t_all_gone = self._watch_gone(watched, pids, attempt if self.inrank else None)
        in_place = t_all_gone is not None and t_all_gone < 0
        if in_place:  # restarted in the same processes: detection and restart show in "respawn"
            t_first_gone = t_all_gone = t_fault
        return {"attempt": attempt, "rank": fault.rank, "after_s": fault.after_s, "pid": victim, "t_fault": t_fault,
                "t_first_gone": t_first_gone, "t_all_gone": t_all_gone, "in_place": in_place}

    def _watch_gone(self, first_of: list[int], all_of: list[int],
                    attempt: int | None = None) -> tuple[float | None, float | None]:
        """When the first of FIRST_OF and all of ALL_OF ended; (-1, -1) if ATTEMPT's successor started in them."""
        t_first = None
        while time.time() < self.deadline:
            now = time.time()
            if attempt is not None and t_first is None and newest_ready_attempt(self.out, attempt + 1) is not None:
                return -1.0, -1.0
            if t_first is None and any(gone(p) for p in first_of):
                t_first = now
            if all(gone(p) for p in all_of):
                return t_first or now, now
            time.sleep(POLL_S)
        return t_first, None


# ------------------------------------------------------------------------------------------ reading a run


def progress(out: Path, attempt: int, rank: int) -> list[tuple[int, float]]:
    try:
        lines = (out / f"progress-a{attempt}-r{rank}.txt").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def attempts(out: Path) -> list[int]:
    return sorted({int(p.name.split("-")[1][1:]) for p in out.glob("progress-a*-r*.txt")})


def step_done_at(out: Path, attempt: int, step: int) -> float | None:
    """When every rank of ATTEMPT had done STEP (None if one never did)."""
    times = [next((t for s, t in progress(out, attempt, r) if s == step), None) for r in range(WORLD)]
    return None if any(t is None for t in times) else max(times)  # type: ignore[type-var]


def breakdown(out: Path, fault: dict[str, Any]) -> dict[str, Any]:
    """Split one fault's cost using the injector's times and the ranks' timestamps."""
    a, t_fault = fault["attempt"], fault["t_fault"]
    reached = min((max((s for s, t in progress(out, a, r) if t <= t_fault), default=-1) for r in range(WORLD)))
    nxt = next((b for b in attempts(out) if b > a and ready_records(out, b)), None)
    row = {**fault, "step_reached": reached, "next_attempt": nxt}
    if nxt is None or fault["t_all_gone"] is None:
        return row
    ready = ready_records(out, nxt) or []
    t_user = max(r["t_start"] for r in ready)
    t_step1 = step_done_at(out, nxt, ready[0]["start_step"])
    back_in = nxt if reached < ready[0]["start_step"] else recovered_in(out, nxt, reached)
    t_back = t_step1 if reached < ready[0]["start_step"] else (
        step_done_at(out, back_in, reached) if back_in is not None else None)
    if t_step1 is None or t_back is None:
        return row
    row.update(recovered_in_attempt=back_in, resumed_at=ready[0]["start_step"],
               steps_redone=max(0, reached + 1 - ready[0]["start_step"]),
               detect=fault["t_first_gone"] - t_fault, stop=fault["t_all_gone"] - fault["t_first_gone"],
               respawn=t_user - fault["t_all_gone"], init=t_step1 - t_user, recompute=t_back - t_step1,
               lost=t_back - t_fault, init_parts={
                   "import": max(r["t_imported"] - r["t_start"] for r in ready),
                   "process_group": max(r["t_pg"] - r["t_imported"] for r in ready),
                   "model_optimizer": max(r["t_built"] - r["t_pg"] for r in ready),
                   "checkpoint_load": max(r["t_loaded"] - r["t_built"] for r in ready),
                   "first_step": t_step1 - max(r["t_loaded"] for r in ready)})
    return row


def recovered_in(out: Path, first: int, step: int) -> int | None:
    """The first attempt from FIRST on whose ranks all did STEP again (a later one if the next fault came first)."""
    return next((b for b in attempts(out) if b >= first and step_done_at(out, b, step) is not None), None)


def monitor_facts(logs: Path) -> dict[str, Any] | None:
    """nvrx's rank monitor events of a run: each hang detected (reason, timeout; in a run without hangs a false
    alarm), the automatic heartbeat timeouts set (heartbeat_timeout_auto), busy gaps let through."""
    files = sorted(logs.rglob("monitor-*.jsonl"))
    if not files:
        return None
    hangs, autos, deferred = [], [], 0
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("ev") == "hang_detected":
                hangs.append({k: e.get(k) for k in ("t", "rank", "global_rank", "reason", "timeout", "elapsed")})
            elif e.get("ev") == "heartbeat_timeout_auto":
                autos.append({k: e.get(k) for k in ("t", "rank", "mode", "timeout", "reason", "longest_gap", "p99",
                                                     "gaps", "observed_s")})
            elif e.get("ev") == "heartbeat_timeout_auto_deferred":
                deferred += 1
    return {"hangs": sorted(hangs, key=lambda h: h["t"] or 0), "auto_timeouts": sorted(autos, key=lambda a: a["t"]),
            "busy_gaps_let_through": deferred}


def rank0_progress(out: Path, t0: float) -> list[tuple[float, int]]:
    points = sorted((t - t0, s + 1) for a in attempts(out) for s, t in progress(out, a, 0))
    return points[::5] + points[-1:] if points else []


def step_median(out: Path) -> float | None:
    gaps = [t2 - t1 for a in attempts(out) for r in range(WORLD)
            for (_, t1), (_, t2) in zip(progress(out, a, r), progress(out, a, r)[1:])]
    return statistics.median(gaps) if gaps else None


# ------------------------------------------------------------------------------------------ one run


def execute(spec: RunSpec, settings: Settings, schedule: list[Fault], table: dict[str, bl.Launcher],
            keep: bool) -> RunResult:
    dirs = bl.RunDirs.create(spec.launcher, f"{spec.variant}-{spec.kind}")
    run_id = f"goodput-{uuid.uuid4().hex[:12]}"
    launcher = table[spec.launcher]

    def injector(proc: subprocess.Popen, t0: float) -> Injector:
        return Injector(proc, dirs.out, spec.kind, t0 + settings.run_timeout, spec.variant == "inprocess")

    def after(result: RunResult) -> None:
        if spec.launcher == "nvrx":
            result.monitor = monitor_facts(dirs.logs)

    return run_measured(spec, settings, schedule, dirs, run_id, command(spec, settings, dirs, run_id, launcher),
                        bl.build_env(launcher, run_id), injector, after, keep)


def run_measured(spec: RunSpec, settings: Settings, schedule: list[Fault], dirs: bl.RunDirs, run_id: str,
                 cmd: list[str], env: dict[str, str], make_injector: Any, after: Any, keep: bool) -> RunResult:
    """Run CMD, inject the SCHEDULE's faults (MAKE_INJECTOR(proc, t0)), measure; AFTER(result) adds facts.

    Leaves no process behind and removes the run's files unless it failed or KEEP (bench_goodput_local too).
    """
    result = RunResult(spec)
    faults = len(schedule) if spec.kind != "none" else 0
    console = open(dirs.console, "wb")  # noqa: SIM115 - closed below
    t0 = result.t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=bl.REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=console,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        fired = make_injector(proc, t0).run(schedule) if faults else []
        try:
            result.rc = proc.wait(timeout=max(1.0, t0 + settings.run_timeout - time.time()))
        except subprocess.TimeoutExpired:
            result.error = f"not finished within {settings.run_timeout:.0f} s"
        result.exit_s = time.time() - t0
        collect(result, dirs.out, t0, fired, faults)
        after(result)
    finally:
        bl.kill_leftovers(proc, run_id)
        console.close()
        if not result.ok:
            result.log_tail = bl.tail(dirs.console, 20)
        if result.ok and not keep:
            shutil.rmtree(dirs.root, ignore_errors=True)
        else:
            result.run_dir = str(dirs.root)
    return result


def collect(result: RunResult, out: Path, t0: float, fired: list[dict[str, Any]], expected: int) -> None:
    done = [read_json(out / f"done-r{r}.json") for r in range(WORLD)]
    result.faults = [breakdown(out, f) for f in fired]
    result.progress = rank0_progress(out, t0)
    result.step_median_s = step_median(out)
    if result.error:
        return
    if any(d is None for d in done) or result.rc != 0:
        result.error = f"training did not finish (launcher rc {result.rc})"
        return
    result.wall_s = max(d["t_end"] for d in done) - t0  # type: ignore[index]
    result.ckpt_blocked_s = max(d["ckpt_blocked_s"] for d in done)  # type: ignore[index]
    if len(fired) != expected or any("lost" not in f for f in result.faults):
        result.error = f"{len(fired)} of {expected} faults fired and measured (training too short for the schedule?)"
        return
    result.ok = True


# ------------------------------------------------------------------------------------------ summary


COMPONENTS = ("detect", "stop", "respawn", "init", "recompute", "lost")


def reference(results: list[RunResult], run: RunResult) -> RunResult | None:
    """The fault-free run RUN's goodput is measured against (every10: the one without checkpoints): of the
    matching references, the one started closest in time (plan() runs one right before each fault kind)."""
    spec = run.spec
    ckpt = "none" if spec.variant in ("every10", "inprocess") else spec.ckpt
    refs = [r for r in results if r.ok and r.spec.launcher == spec.launcher and r.spec.variant == spec.variant
            and r.spec.kind == "none" and r.spec.ckpt == ckpt and r is not run]
    if not refs:
        return run if run.ok and spec.kind == "none" and spec.ckpt == ckpt else None
    return min(refs, key=lambda r: abs(r.t0 - run.t0))


def validity(run: RunResult, ref: RunResult | None, row: dict[str, Any], cores: int) -> str | None:
    """Why ROW's figures cannot be trusted ("invalid: rerun"), or None: a figure outside its possible range,
    or a reference measured under a machine load that differs from RUN's by more than the margin."""
    for key, (low, high) in FIGURE_RANGES.items():
        value = row.get(key)
        if value is not None and not low <= value <= high:
            return f"{key} {value:.3f} is outside [{low:g}, {high:g}]"
    if ref is not None and ref is not run and run.load is not None and ref.load is not None:
        diff = abs(run.load - ref.load) / max(1, cores)
        if diff > LOAD_MARGIN_PER_CORE:
            return (f"reference load {ref.load:.1f} vs {run.load:.1f} on {cores} cores: "
                    f"{diff:.2f} per core > {LOAD_MARGIN_PER_CORE:g}")
    return None


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(results: list[RunResult], cores: int | None = None) -> list[dict[str, Any]]:
    cores = cores or os.cpu_count() or 1
    rows = []
    for r in results:
        ref = reference(results, r)
        row: dict[str, Any] = {"variant": r.spec.variant, "kind": r.spec.kind, "ckpt": r.spec.ckpt,
                               "launcher": r.spec.launcher, "ok": r.ok, "error": r.error, "wall_s": r.wall_s,
                               "faults": len(r.faults), "step_median_s": r.step_median_s,
                               "ckpt_blocked_s": r.ckpt_blocked_s}
        if r.ok and ref is not None and ref.wall_s:
            row["goodput"] = ref.wall_s / r.wall_s if r.wall_s else None
            row["reference_wall_s"] = ref.wall_s
            if r.spec.kind == "none" and r.spec.ckpt != "none" and r.spec.variant in ("every10", "inprocess"):
                row["ckpt_cost_of_wall"] = r.wall_s / ref.wall_s - 1  # type: ignore[operator]
                row["ckpt_blocked_of_wall"] = (r.ckpt_blocked_s or 0) / ref.wall_s
        if r.monitor is not None:
            row.update(hang_figures(r))
        if r.ok and ref is not None and ref.wall_s and r.spec.kind != "none":
            row["goodput_from_lost"] = goodput_from_lost(r, ref.wall_s)
        for c in COMPONENTS:
            row[c] = med([f[c] for f in r.faults if c in f])
        if r.faults:
            row["lost_minus_recompute"] = med([f["lost"] - f["recompute"] for f in r.faults if "lost" in f])
        row["invalid"] = validity(r, ref, row, cores)
        rows.append(row)
    return rows


def hang_figures(run: RunResult) -> dict[str, Any]:
    """nvrx's hang detection in one run: what caught each hang, the automatic timeout, false alarms.

    A hang detected in a run without injected hangs is a false alarm. In a hang run, the rank waiting for the
    stopped one in a collective may be caught too (after it), which is not counted as one.
    """
    m = run.monitor or {}
    hangs = m.get("hangs") or []
    reasons: dict[str, int] = {}
    for h in hangs:
        reasons[str(h.get("reason"))] = reasons.get(str(h.get("reason")), 0) + 1
    autos = [a["timeout"] for a in m.get("auto_timeouts") or [] if a.get("mode") == "set"]
    return {"hangs_detected": len(hangs), "hang_reasons": reasons,
            "false_alarms": len(hangs) if run.spec.kind != "hang" else None,
            "auto_timeout_s": med(autos), "auto_timeout_max_s": max(autos) if autos else None,
            "busy_gaps_let_through": m.get("busy_gaps_let_through")}


def goodput_from_lost(run: RunResult, reference_wall: float) -> float:
    """Goodput rebuilt from what the faults cost, measured one by one: reference / (reference + lost + saving).

    The wall-clock ratio compares two runs minutes apart, and on a shared machine the step time drifts
    between them by more than the faults cost; the time lost per fault is measured within one run, around
    the fault. Saving counts only where the reference did not save (every10: its time blocked in checkpoint calls).
    """
    saving = (run.ckpt_blocked_s or 0.0) if run.spec.variant in ("every10", "inprocess") else 0.0
    return reference_wall / (reference_wall + covered([(f["t_fault"], f["t_fault"] + f["lost"]) for f in run.faults])
                             + saving)


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of SPANS (a fault that strikes before the last one was made good overlaps it)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def add_ratios(rows: list[dict[str, Any]], peer: str) -> None:
    """nvrx / PEER in the same variant and fault kind: goodput and time lost per fault."""
    for row in rows:
        if row["launcher"] != "nvrx" or row["kind"] == "none":
            continue
        other = next((o for o in rows if o["launcher"] == peer and o["variant"] == row["variant"]
                      and o["kind"] == row["kind"]), None)
        if other and other.get("goodput") and row.get("goodput"):
            row["goodput_vs_peer"] = row["goodput"] / other["goodput"]
        if other and other.get("goodput_from_lost") and row.get("goodput_from_lost"):
            row["goodput_from_lost_vs_peer"] = row["goodput_from_lost"] / other["goodput_from_lost"]
        if other and other.get("lost") and row.get("lost"):
            row["lost_vs_peer"] = row["lost"] / other["lost"]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, judged on this run's nvrx rows."""
    def find(variant: str, kind: str, ckpt: str | None = None) -> dict[str, Any] | None:
        return next((r for r in rows if r["launcher"] == "nvrx" and r["variant"] == variant and r["kind"] == kind
                     and (ckpt is None or r["ckpt"] == ckpt)), None)

    out: list[dict[str, Any]] = []

    def judge(row: dict[str, Any], target: str, value: Any, met: bool | None) -> None:
        """A target's verdict; from an invalid row (impossible figure, reference under another load): none."""
        if row.get("invalid"):
            out.append({"target": target, "value": value, "met": None, "invalid": f"invalid: rerun ({row['invalid']})"})
        else:
            out.append({"target": target, "value": value, "met": met})

    for kind in KINDS:
        row = find("save200", kind)
        if row:
            value = row.get("lost_minus_recompute")
            judge(row, f"save200 {kind}: lost per fault - recompute <= 0.4 s", value, value is not None and value <= 0.4)
        row = find("every10", kind)
        if row:
            bound = 0.97 if kind == "crash" else 0.95
            for key, what in (("goodput", "goodput (wall)"), ("goodput_from_lost", "goodput (from time lost)")):
                value = row.get(key)
                judge(row, f"every10 {kind}: {what} >= {bound}", value, value is not None and value >= bound)
    for kind in KINDS:
        row = find("inprocess", kind)
        if row:
            for key, what in (("goodput", "goodput (wall)"), ("goodput_from_lost", "goodput (from time lost)")):
                value = row.get(key)
                judge(row, f"inprocess {kind}: {what} >= 0.97", value, value is not None and value >= 0.97)
    row = find("every10", "none", "nvrx")
    if row:
        value = row.get("ckpt_cost_of_wall")
        judge(row, "every10: checkpoint cost <= 1% of the fault-free wall", value, value is not None and value <= 0.01)
        judge(row, "(same, time blocked in the checkpoint calls)", row.get("ckpt_blocked_of_wall"), None)
    return out


def fmt(value: Any, unit: str = "s") -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "%":
        return f"{100 * value:.2f}%"
    if unit == "":
        return f"{value:.3f}"
    return f"{value:.2f} s" if value >= 1 else f"{1000 * value:.0f} ms"


def table(rows: list[dict[str, Any]], peer: str) -> tuple[list[str], list[list[str]]]:
    header = ["variant", "faults", "ckpt", "launcher", "wall", "goodput", "x peer", "from lost", "x peer", "lost/fault",
              "lost x peer", "detect", "stop", "respawn", "worker init", "recompute", "ckpt blocked"]
    body = []
    for r in rows:
        kind = r["kind"] if r["ok"] else f"{r['kind']} FAILED"
        body.append([r["variant"], kind, r["ckpt"], r["launcher"], fmt(r["wall_s"]), fmt(r.get("goodput"), ""),
                     fmt(r.get("goodput_vs_peer"), "x"), fmt(r.get("goodput_from_lost"), ""),
                     fmt(r.get("goodput_from_lost_vs_peer"), "x"), fmt(r.get("lost")), fmt(r.get("lost_vs_peer"), "x"),
                     fmt(r.get("detect")), fmt(r.get("stop")), fmt(r.get("respawn")), fmt(r.get("init")),
                     fmt(r.get("recompute")), fmt(r.get("ckpt_blocked_s"))])
    return header, body


def plots(results: list[RunResult], settings: Settings, prefix: str) -> list[str]:
    written = []
    for variant in settings.variants:
        for kind in settings.kinds:
            series = [goodput_svg.Series(f"{r.spec.launcher} ({r.spec.ckpt})", r.progress,
                                         [f["t_fault"] - r.t0 for f in r.faults])
                      for r in results if r.spec.variant == variant and r.spec.kind == kind and r.progress]
            series += [goodput_svg.Series(f"{r.spec.launcher}, no fault", r.progress, dashed=True)
                       for r in results if r.spec.variant == variant and r.spec.kind == "none" and r.progress
                       and r.spec.ckpt != "none"]
            if not series:
                continue
            path = RESULTS / f"{prefix}-{variant}-{kind}.svg"
            goodput_svg.write(path, series, f"{variant}: progress under {kind}es" if kind == "crash"
                              else f"{variant}: progress under hangs")
            written.append(str(path.relative_to(bl.REPO_ROOT)))
    return written


# ------------------------------------------------------------------------------------------ driver


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    p = argparse.ArgumentParser(description="Goodput under crashes and hangs: nvrx vs torchrun, side by side.")
    p.add_argument("--steps", type=int, help="training steps (default 2000; --quick 400)")
    p.add_argument("--faults", type=int, help="faults per faulty run (default 4; --quick 2)")
    p.add_argument("--interval", type=float, help="mean seconds of training per attempt before its fault (default 16:"
                   " 4 faults must fit in ~85 s of fault-free training on this 2-core VM)")
    p.add_argument("--jitter", type=float, help="+- seconds around --interval (default 3)")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--save-every", type=int, help="the save200 variant's torch.save interval in steps (default 200)")
    p.add_argument("--pause", type=float, default=0.01, help="seconds slept per step after its compute (default 0.01)")
    p.add_argument("--hang-timeout", type=float, default=5.0,
                   help="nvrx's configured heartbeat timeout (--ft-param-rank-heartbeat-timeout; default 5): the bound; "
                        "the automatic timeout detects hangs once warm (--auto-timeout off: this one does)")
    p.add_argument("--auto-timeout", choices=("off", "suggest", "set"), default="set",
                   help="nvrx's automatic heartbeat timeout (--ft-param-heartbeat-timeout-auto; default set)")
    p.add_argument("--auto-timeout-min", type=float, default=0.1,
                   help="its floor in seconds (--ft-param-heartbeat-timeout-auto-min; default 0.1)")
    p.add_argument("--auto-timeout-warmup", type=float, default=10.0,
                   help="its warm-up in seconds (--ft-param-heartbeat-timeout-auto-warmup-seconds; default 10)")
    p.add_argument("--soft-timeout", type=float, default=1.0,
                   help="inprocess variant: the script's Wrapper(soft_timeout=...) in seconds (default 1)")
    p.add_argument("--pg-timeout", type=float, default=10.0, help="the script's gloo timeout (default 10)")
    p.add_argument("--big", action="store_true", help="~21 M parameters instead of ~2.1 M")
    p.add_argument("--variants", default=None,
                   help="comma list: save200,every10,inprocess (default save200,every10; --quick save200)")
    p.add_argument("--kinds", default="crash,hang", help="comma list: crash,hang")
    p.add_argument("--launchers", default="nvrx,torchrun-noshare",
                   help="comma list: nvrx,torchrun-noshare,torchrun,ft_launcher (ft_launcher only if installed)")
    p.add_argument("--quick", action="store_true", help="400 steps, 2 faults every 7 +- 2 s, save200 only")
    p.add_argument("--output", type=Path, default=RESULTS / "goodput.json")
    p.add_argument("--from-json", type=Path, help="summarize a saved run again instead of running")
    p.add_argument("--keep-run-dirs", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    quick = args.quick
    pick = lambda value, normal, fast: value if value is not None else (fast if quick else normal)  # noqa: E731
    steps = pick(args.steps, 2000, 400)
    wanted = [n for n in bl.parse_list(args.launchers, LAUNCHERS, "--launchers")]
    if "ft_launcher" in wanted and not ft_launcher_available():
        LOG.warning("ft_launcher is not installed here (no nvidia_resiliency_ext): left out")
        wanted.remove("ft_launcher")
    settings = Settings(
        steps=steps, faults=pick(args.faults, 4, 2), interval=pick(args.interval, 16.0, 7.0),
        jitter=pick(args.jitter, 3.0, 2.0), seed=args.seed, save_every=pick(args.save_every, 200, 100),
        pause=args.pause, hang_timeout=args.hang_timeout, auto_timeout=args.auto_timeout,
        auto_timeout_min=args.auto_timeout_min, auto_timeout_warmup=args.auto_timeout_warmup, soft_timeout=args.soft_timeout, pg_timeout=args.pg_timeout,
        big=args.big,
        variants=tuple(bl.parse_list(args.variants or ("save200" if quick else "save200,every10"), VARIANTS,
                                     "--variants")),
        kinds=tuple(bl.parse_list(args.kinds, KINDS, "--kinds")), launchers=tuple(wanted),
        run_timeout=steps * 0.2 + 600)
    return settings, args


def run_all(settings: Settings, schedule: list[Fault], keep: bool) -> list[RunResult]:
    table_ = launchers()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=False)  # page cache
    results: list[RunResult] = []
    for spec in plan(settings):
        load = os.getloadavg()[0]
        result = execute(spec, settings, schedule, table_, keep)
        result.load = load
        results.append(result)
        LOG.log(logging.INFO if result.ok else logging.WARNING, "%s: %s (load %.1f)", spec.label,
                f"wall {result.wall_s:.1f} s, {len(result.faults)} fault(s)" if result.ok
                else f"FAILED: {result.error}; kept {result.run_dir}", load)
    return results


def report(results: list[RunResult], settings: Settings, schedule: list[Fault], output: Path,
           extra: dict[str, Any]) -> None:
    """Table, targets, plots and JSON for RESULTS (fresh, or read back with --from-json)."""
    peer = next((n for n in settings.launchers if n != "nvrx"), "torchrun-noshare")
    cores = (extra.get("machine") or {}).get("cpu_count") or os.cpu_count() or 1
    rows = summarize(results, cores)
    add_ratios(rows, peer)
    goals = targets(rows)
    header, body = table(rows, peer)
    print()
    bl.print_table(header, body, f"goodput (peer: {peer}): {WORLD} ranks gloo, {settings.steps} steps, "
                                 f"{settings.faults} faults per run, schedule "
                                 f"{', '.join(f'{f.after_s:g}s/r{f.rank}' for f in schedule)}")
    for row in rows:
        if row["launcher"] == "nvrx" and "hangs_detected" in row:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(row["hang_reasons"].items())) or "none"
            print(f"  nvrx {row['variant']}/{row['kind']}/{row['ckpt']}: hangs detected {row['hangs_detected']} "
                  f"({reasons}); automatic timeout median {fmt(row['auto_timeout_s'])}, max "
                  f"{fmt(row['auto_timeout_max_s'])}; busy gaps let through {row['busy_gaps_let_through']}"
                  + (f"; FALSE ALARMS {row['false_alarms']}" if row.get("false_alarms") else ""))
    for goal in goals:
        value = goal["value"]
        percent = "cost" in goal["target"] or "blocked" in goal["target"]
        text = "-" if value is None else (f"{100 * value:.2f}%" if percent else f"{value:.3f}")
        verdict = goal.get("invalid") or ('' if goal['met'] is None else ('met' if goal['met'] else 'MISSED'))
        print(f"  {goal['target']}: {text} {verdict}")
    for row in rows:
        if row.get("invalid"):
            print(f"  invalid: rerun: {row['variant']}/{row['kind']}/{row['ckpt']}/{row['launcher']}: {row['invalid']}")
    svgs = plots(results, settings, output.stem)
    bl.save_json(output, {
        **extra, "settings": asdict(settings), "schedule": [asdict(f) for f in schedule],
        "ft_launcher": "included" if "ft_launcher" in settings.launchers else
                       ("installed, not requested" if ft_launcher_available() else "not installed here: left out"),
        "rows": rows, "targets": goals, "plots": svgs,
        "runs": [{**asdict(r), "progress": r.progress} for r in results]})
    print(f"\nsaved {output} and {', '.join(svgs)}")


def load_results(path: Path) -> tuple[Settings, list[Fault], list[RunResult], dict[str, Any]]:
    """A saved run, to summarize again (e.g. after a change of the summary) without running it again."""
    data = json.loads(path.read_text())
    settings = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["settings"].items()})
    schedule = [Fault(**f) for f in data["schedule"]]
    results = []
    for raw in data["runs"]:
        fields = {k: v for k, v in raw.items() if k in RunResult.__dataclass_fields__}
        fields["spec"] = RunSpec(**raw["spec"])
        results.append(RunResult(**fields))
    extra = {k: data[k] for k in ("machine", "commands", "elapsed_s") if k in data}
    return settings, schedule, results, extra


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.from_json:
        settings, schedule, results, extra = load_results(args.from_json)
        report(results, settings, schedule, args.output, extra)
        return 0
    schedule = make_schedule(settings.seed, settings.faults, settings.interval, settings.jitter)
    LOG.info("fault schedule (seconds of training in an attempt, rank): %s",
             ", ".join(f"{f.after_s:g} s r{f.rank}" for f in schedule))
    info = bl.machine_info()
    t_start = time.monotonic()
    results = run_all(settings, schedule, args.keep_run_dirs)
    elapsed = time.monotonic() - t_start
    report(results, settings, schedule, args.output, {
        "machine": info, "elapsed_s": elapsed,
        "commands": {n: list(launchers()[n].prefix) for n in settings.launchers}})
    print(f"elapsed {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
