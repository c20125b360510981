"""Rank script of bench_goodput.py: a small data-parallel training job written as a user would for torchrun.

2 ranks (gloo), an MLP of ~2.1 M parameters (``--big``: ~21 M) with Adam under DDP, steps of about 50 ms
(the compute, then a fixed pause standing in for the rest of a real step, so the two cores are not saturated
and saving costs show up in full), resumed from its newest checkpoint at start. Checkpointing (``--ckpt``):

* ``torch_save``: rank 0 ``torch.save``s model + optimizer every ``--every`` steps (temp file, rename), then a
  barrier; every rank loads that file at start. What a user who changed nothing does.
* ``nvrx``: ``nvrx.ckpt.PeriodicCheckpointer`` (asynchronous DCP, one call per step), run with ``--async-ckpt``;
  ``--every auto``: its self-tuning interval (bench/bench_interval.py).
* ``nvrx_jit``: the same with ``save_on_failure=True``, run with ``--jit-ckpt`` (bench/bench_jit.py).
* ``twotier`` / ``twotier_jit``: local + global tiers (bench/goodput_twotier.py; bench_goodput_local.py,
  bench_nodeloss.py), ``twotier_jit`` with ``save_on_failure=True`` (run with ``--jit-ckpt``).
* ``none``: no checkpoint (the fault-free reference whose wall the checkpoint cost counts against).

Instrumentation for the benchmark (the same under every launcher, written to ``--out``):
``ready-a{attempt}-r{rank}.json`` (pid and start-up timestamps), ``progress-a{attempt}-r{rank}.txt`` (one line
per step done: ``step time``), ``done-r{rank}.json`` (end time, time blocked in checkpoint calls).
"""

from __future__ import annotations

import time

T_START = time.time()  # first line of user code in this rank

import sys  # noqa: E402

WARM = "torch._dynamo" in sys.modules  # forked from a warmed-up template (DDP's first use imports torch._dynamo)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T_IMPORTED = time.time()

IN_FEATURES = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="goodput benchmark rank")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--pause", type=float, default=0.04, help="seconds slept per step after the compute")
    p.add_argument("--ckpt", choices=("none", "torch_save", "nvrx", "nvrx_jit", "twotier", "twotier_jit"),
                   default="torch_save")
    p.add_argument("--every", type=every_steps, default=200,
                   help="checkpoint every N steps (nvrx: or auto, the self-tuning interval: bench_interval.py)")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--global-every", type=int, default=200, help="twotier: global checkpoint every N steps")
    p.add_argument("--local-dir", default=None, help="twotier: node-local root (bench/goodput_twotier.py); default: "
                   "the launcher's --local-ckpt-dir, replicated to the other node")
    p.add_argument("--sharded", action="store_true", help="twotier: the state also holds a DTensor sharded over ranks")
    p.add_argument("--digests", action="store_true",
                   help="twotier: rank 0 writes each step's weight digest (digest-a<attempt>-r0.txt; bench_nodeloss)")
    p.add_argument("--big", action="store_true", help="~21 M parameters instead of ~2.1 M")
    p.add_argument("--pg-timeout", type=float, default=10.0, help="process-group (gloo) timeout, seconds")
    return p.parse_args()


def every_steps(text: str) -> int | str:
    return text if text == "auto" else int(text)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Atomically (temp file + rename): the benchmark polls these files."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def build_model(big: bool) -> torch.nn.Module:
    hidden = 4096 if big else 1024
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, IN_FEATURES))


class TorchSaveCheckpoint:
    """Rank 0 writes one file every N steps; every rank reads it at start (the plain torch way)."""

    def __init__(self, path: Path, every: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.path, self.every, self.model, self.opt = path, every, model, opt

    def resume(self) -> int:
        if not self.path.exists():
            return 0
        state = torch.load(self.path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        return int(state["step"])

    def step(self, step: int) -> None:
        if (step + 1) % self.every:
            return
        if dist.get_rank() == 0:
            tmp = self.path.with_suffix(".tmp")
            torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, self.path)
        dist.barrier()

    def close(self) -> None:
        pass


def make_checkpoint(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    if args.ckpt == "torch_save":
        return TorchSaveCheckpoint(Path(args.ckpt_dir) / "ckpt.pt", args.every, model, opt)
    if args.ckpt == "nvrx_jit":  # bench_jit.py: the same, plus a just-in-time save on failure (--jit-ckpt)
        from nvrx import ckpt

        return ckpt.PeriodicCheckpointer(args.ckpt_dir, model=model, optimizer=opt, every_steps=args.every,
                                         save_on_failure=True)
    if args.ckpt == "nvrx":
        from nvrx import ckpt

        return ckpt.PeriodicCheckpointer(args.ckpt_dir, model=model, optimizer=opt, every_steps=args.every)
    if args.ckpt in ("twotier", "twotier_jit"):  # local every --every steps, global every --global-every
        from goodput_twotier import TwoTierSaver

        return TwoTierSaver(model, opt, Path(args.ckpt_dir), Path(args.local_dir) if args.local_dir else None,
                            args.every, args.global_every, jit=args.ckpt == "twotier_jit", sharded=args.sharded)
    return None


def train(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, saver: Any,
          start: int, log: Callable[[int], None]) -> float:
    """Run steps START..STEPS-1; returns the seconds spent blocked in checkpoint calls."""
    rank = dist.get_rank()
    gen = torch.Generator()
    blocked = 0.0
    for step in range(start, args.steps):
        blocked += train_step(model, opt, saver, gen, step, rank, args.pause)
        log(step)
    return blocked


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, saver: Any, gen: torch.Generator, step: int,
               rank: int, pause: float) -> float:
    """One step of the benchmark workload (the same batch for a step on every run); the seconds SAVER blocked."""
    gen.manual_seed(step * 1000 + rank)
    x = torch.randn(64, IN_FEATURES, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), x)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    blocked = 0.0
    if saver is not None:
        t = time.perf_counter()
        saver.step(step)
        blocked = time.perf_counter() - t
    time.sleep(pause)
    return blocked


def log_step(progress: Any, digests: Any, model: torch.nn.Module, step: int) -> None:
    """One progress line per step done; with --digests (rank 0) the weights' digest after it, written after the
    progress line so the bench's step times do not include it (bench_nodeloss checks restored weights with it)."""
    progress.write(f"{step} {time.time():.6f}\n")
    if digests is not None:
        from goodput_twotier import digest

        digests.write(f"{step + 1} {digest(model)}\n")


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    t_pg = time.time()
    model = torch.nn.parallel.DistributedDataParallel(build_model(args.big))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    t_built = time.time()
    saver = make_checkpoint(args, model.module, opt)
    start = saver.resume() if saver is not None else 0
    write_json(out / f"ready-a{attempt}-r{rank}.json", {
        "rank": rank, "attempt": attempt, "pid": os.getpid(), "start_step": start, "t_start": T_START,
        "t_imported": T_IMPORTED, "t_pg": t_pg, "t_built": t_built, "t_loaded": time.time(),
        "restored": getattr(saver, "restored", None), "host": socket.gethostname(), "warm": WARM})
    digests = open(out / f"digest-a{attempt}-r{rank}.txt", "a", buffering=1) if args.digests and rank == 0 else None
    with open(out / f"progress-a{attempt}-r{rank}.txt", "a", buffering=1) as progress:
        blocked = train(args, model, opt, saver, start, lambda step: log_step(progress, digests, model.module, step))
    if digests is not None:
        digests.close()
    if saver is not None:
        t = time.perf_counter()
        saver.close()
        blocked += time.perf_counter() - t
        blocked += getattr(saver, "copy_wait_seconds", 0.0)  # optimizer steps that waited for a background copy
    write_json(out / f"done-r{rank}.json", {"rank": rank, "attempt": attempt, "t_end": time.time(),
                                            "ckpt_blocked_s": blocked, "start_step": start})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
