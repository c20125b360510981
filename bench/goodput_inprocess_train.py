"""Rank script of bench_goodput.py's ``inprocess`` variant: goodput_train.py's job, written for in-process restart.

Under ``nvrx launch --inprocess`` (``NVRX_INPROCESS=1``) the model and the optimizer are built once and stay in
memory; the training function is wrapped in ``nvrx.launcher.rank.inprocess.Wrapper`` (the NVRx way: the script's
Wrapper runs the session, the launcher's stands aside) and restarted in place after a fault. ``--ckpt memory``
keeps the two newest in-memory snapshots (every ``--every`` steps); a restart resumes from the newest one every
rank holds (one MIN all-reduce: a rank that failed between the other's snapshot and its own is one behind).
Elsewhere (torchrun), the same job restarts as processes and resumes from ``torch.save`` (``--ckpt torch_save``):
torchrun's best equivalent.

Faults come from the benchmark's injector as signals, acted on at the next step inside the training loop:
SIGUSR1 = an exception raised in the rank, SIGUSR2 = the rank hangs in communication (it waits for a message no
peer sends while the peers wait for it in the step's all-reduce). The same instrumentation
files as goodput_train.py (``ready-a*``, ``progress-a*``, ``done-r*``), the attempt being the Wrapper's iteration
(or torchrun's restart count).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from goodput_train import TorchSaveCheckpoint, build_model, train_step, write_json  # noqa: E402

INPROCESS = os.environ.get("NVRX_INPROCESS") == "1"
PENDING: list[str] = []  # faults asked for by the injector, acted on at the next step


class InjectedFault(RuntimeError):
    """The benchmark's exception inside a rank."""


def on_signal(signum: int, _frame: Any) -> None:
    PENDING.append("raise" if signum == signal.SIGUSR1 else "hang")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="goodput benchmark rank (in-process restart)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--pause", type=float, default=0.01)
    p.add_argument("--ckpt", choices=("none", "memory", "torch_save"), default="memory")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--big", action="store_true")
    p.add_argument("--pg-timeout", type=float, default=10.0)
    p.add_argument("--soft-timeout", type=float, default=1.0, help="the Wrapper's soft timeout (no progress), s")
    return p.parse_args()


class MemorySnapshots:
    """The two newest copies of model + optimizer state, taken at step boundaries."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, every: int) -> None:
        self.model, self.opt, self.every = model, opt, every
        self.kept: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
        self.take(0)

    def take(self, steps_done: int) -> None:
        """Copy into the older snapshot's buffers once there are two (no allocation on the training path)."""
        model, opt = self.model.state_dict(), self.opt.state_dict()
        if len(self.kept) == 2:
            _, old_model, old_opt = self.kept[0]
            if _copy_into(old_model, model) and _copy_into(old_opt, opt):
                self.kept = [self.kept[1], (steps_done, old_model, old_opt)]
                return
        self.kept = [*self.kept[-1:], (steps_done, _clone(model), _clone(opt))]

    def step(self, step: int) -> None:
        if (step + 1) % self.every == 0:
            self.take(step + 1)

    def resume(self) -> int:
        """Restore the newest snapshot every rank holds; returns its step."""
        newest = torch.tensor([self.kept[-1][0]], dtype=torch.int64)
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        steps, model, opt = next(k for k in self.kept if k[0] == int(newest))
        self.model.load_state_dict(model)
        self.opt.load_state_dict(_clone(opt))
        self.kept = [k for k in self.kept if k[0] <= steps]
        return steps


def _copy_into(dst: Any, src: Any) -> bool:
    """Copy SRC's tensors into DST's (same structure and shapes); False if they differ (then clone instead)."""
    if isinstance(src, torch.Tensor):
        if not isinstance(dst, torch.Tensor) or dst.shape != src.shape or dst.dtype != src.dtype:
            return False
        dst.copy_(src.detach())
        return True
    if isinstance(src, dict):
        if not isinstance(dst, dict) or dst.keys() != src.keys():
            return False
        for k, v in src.items():
            if isinstance(v, (torch.Tensor, dict, list)):
                if not _copy_into(dst[k], v):
                    return False
            else:
                dst[k] = v
        return True
    if isinstance(src, list):
        if not isinstance(dst, list) or len(dst) != len(src):
            return False
        for i, v in enumerate(src):
            if isinstance(v, (torch.Tensor, dict, list)):
                if not _copy_into(dst[i], v):
                    return False
            else:
                dst[i] = v
        return True
    return False


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def train_loop(args: argparse.Namespace, ddp: torch.nn.Module, opt: torch.optim.Optimizer, saver: Any, start: int,
               attempt: int, rank: int) -> float:
    """Steps START..STEPS-1; returns the seconds spent in checkpoint calls."""
    gen = torch.Generator()
    blocked = 0.0
    out = Path(args.out)
    with open(out / f"progress-a{attempt}-r{rank}.txt", "a", buffering=1) as progress:
        for step in range(start, args.steps):
            while PENDING:
                fault = PENDING.pop(0)
                if fault == "raise":
                    raise InjectedFault(f"bench: injected exception in rank {rank} at step {step}")
                # hang: wait for a message no peer sends, while the peers wait in the step's all-reduce (a
                # mismatched collective, the common hang of a distributed job); only an abort (the Wrapper's)
                # or the process group's timeout ends it
                dist.recv(torch.zeros(1), src=(rank + 1) % dist.get_world_size())
            blocked += train_step(ddp, opt, saver, gen, step, rank, args.pause)
            progress.write(f"{step} {time.time():.6f}\n")
    return blocked


def run_attempt(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, saver: Any,
                attempt: int, t_enter: float) -> None:
    """One attempt: process group, DDP, resume, train, done record."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    t_pg = time.time()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    t_built = time.time()
    start = saver.resume() if saver is not None else 0
    write_json(Path(args.out) / f"ready-a{attempt}-r{rank}.json", {
        "rank": rank, "attempt": attempt, "pid": os.getpid(), "start_step": start, "t_start": t_enter,
        "t_imported": t_enter, "t_pg": t_pg, "t_built": t_built, "t_loaded": time.time()})
    blocked = train_loop(args, ddp, opt, saver, start, attempt, rank)
    write_json(Path(args.out) / f"done-r{rank}.json", {"rank": rank, "attempt": attempt, "t_end": time.time(),
                                                       "ckpt_blocked_s": blocked, "start_step": start})


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGUSR2, on_signal)
    model = build_model(args.big)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if not INPROCESS:
        saver = TorchSaveCheckpoint(Path(args.ckpt_dir) / "ckpt.pt", args.every, model, opt) \
            if args.ckpt == "torch_save" else None
        run_attempt(args, model, opt, saver, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), T_START)
        dist.destroy_process_group()
        return
    from nvrx.launcher.rank import inprocess

    saver = MemorySnapshots(model, opt, args.every) if args.ckpt == "memory" else None
    soft = args.soft_timeout

    @inprocess.Wrapper(soft_timeout=datetime.timedelta(seconds=soft), hard_timeout=datetime.timedelta(seconds=soft + 20),
                       monitor_thread_interval=datetime.timedelta(milliseconds=20),
                       progress_watchdog_interval=datetime.timedelta(milliseconds=20),
                       heartbeat_timeout=datetime.timedelta(seconds=30))
    def train(call_wrapper: inprocess.CallWrapper = None) -> None:
        t_enter = time.time()
        PENDING.clear()  # a fault asked for during the restart belongs to the attempt that ended
        run_attempt(args, model, opt, saver, call_wrapper.iteration, t_enter)

    train()


if __name__ == "__main__":
    main()
