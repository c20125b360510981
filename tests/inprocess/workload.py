"""A rank of the in-process restart tests: `python workload.py` with the torchrun environment.

NVRX_TEST_PLAN (JSON) says what to do: Wrapper arguments, the number of all_reduce steps, and
faults to inject, keyed by iteration and initial rank. Every event is appended as a JSON line to
NVRX_TEST_OUT/rank<initial rank>.jsonl, so the test can check pids, ranks and iterations.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx.launcher.rank import inprocess
from nvrx.launcher.rank.inprocess import pg_graveyard
from nvrx.launcher.rank.inprocess import rank_assignment as ra
from nvrx.launcher.rank.inprocess import rank_filter as rf

PLAN = json.loads(os.environ["NVRX_TEST_PLAN"])
OUT = Path(os.environ["NVRX_TEST_OUT"])
INITIAL_RANK = int(os.environ["RANK"])


def record(event: str, **fields: object) -> None:
    line = json.dumps({"event": event, "pid": os.getpid(), "initial_rank": INITIAL_RANK, "t": time.time(), **fields})
    with open(OUT / f"rank{INITIAL_RANK}.jsonl", "a") as fh:
        fh.write(line + "\n")


class FailOnce(inprocess.health_check.HealthCheck):
    """A user-defined health check: unhealthy on one rank at the start of one iteration (before the run)."""

    def __init__(self, rank: int, iteration: int) -> None:
        self.rank, self.iteration = rank, iteration

    def __call__(self, state):
        record("health_check", iteration=state.iteration, rank=state.rank)
        if INITIAL_RANK == self.rank and state.iteration == self.iteration:
            record("unhealthy", iteration=state.iteration)
            raise RuntimeError("user health check: this rank is unhealthy")
        return state


def components() -> dict[str, object]:
    """Wrapper keyword arguments that cannot travel as JSON."""
    out: dict[str, object] = {}
    assignment = PLAN.get("rank_assignment")
    if assignment == "groups_of_2":
        out["rank_assignment"] = inprocess.Compose(
            ra.ShiftRanks(), ra.FilterGroupedByKey(key_or_fn=lambda rank, _: rank // 2, condition=lambda n: n == 2))
    if PLAN.get("max_active"):
        out["rank_filter"] = rf.MaxActiveWorldSize(PLAN["max_active"])
    if PLAN.get("unhealthy"):
        out["health_check"] = inprocess.Compose(inprocess.health_check.CudaHealthCheck(),
                                                FailOnce(**PLAN["unhealthy"]))
    if PLAN.get("store_timeout"):  # NVRx's examples pass the store timeout as a timedelta
        out["store_kwargs"] = {"timeout": datetime.timedelta(seconds=PLAN["store_timeout"])}
    if PLAN.get("max_iterations"):
        out["initialize"] = inprocess.initialize.RetryController(max_iterations=PLAN["max_iterations"])
    if PLAN.get("file_store"):  # NVRx's FileStore: one file, no rank hosts the Wrapper's store
        out["store_factory"] = inprocess.store.FileStore
        out["store_kwargs"] = {"file_name": PLAN["file_store"]}
    if PLAN.get("tree_pairs_backfill"):  # pairs of ranks; a lost active rank is backfilled from the whole job
        out["rank_assignment"] = ra.Tree([
            ra.Layer(key_or_fn="job", flag=ra.LayerFlag.BACKFILL),
            ra.Layer(key_or_fn=lambda state: state.initial_rank // 2, flag=ra.LayerFlag.BACKFILL)])
    return out


def inject(action: str, call_wrapper: inprocess.CallWrapper) -> None:
    record("inject", action=action, iteration=call_wrapper.iteration)
    if action == "raise":
        raise ValueError("injected fault")
    if action == "raise_late":  # after the peers are well inside this step
        time.sleep(0.3)
        raise ValueError("injected fault")
    if action == "die_hard":  # the whole "node" goes: this rank and its monitor process, no goodbye
        import shutil

        import psutil
        shutil.rmtree(call_wrapper._recorder.directory)  # a lost node's /dev/shm is gone too; keep the test host's clean
        for child in psutil.Process().children():
            child.kill()
        os.kill(os.getpid(), 9)
    if action == "exit":
        os._exit(3)
    if action == "sleep":  # blocking call that releases the GIL
        time.sleep(120)
    if action == "gil_hang":  # a C call that keeps the GIL: no Python thread of this process can run
        ctypes.PyDLL(None).sleep(120)
    if action == "gil_hang_ignore_term":  # the same, deaf to SIGTERM: only the SIGKILL after the grace time ends it
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record("ignoring_sigterm")
        ctypes.PyDLL(None).sleep(120)
    if action == "recv_hang":  # waits in gloo for a message no peer sends, while the peers wait in all_reduce
        dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
    if action == "raise_after":  # a second fault, PLAN["raise_after_seconds"] after the first
        time.sleep(float(PLAN.get("raise_after_seconds", 1.0)))
        raise ValueError("injected fault")
    if action == "swallow":
        try:
            time.sleep(120)
        except BaseException as exc:  # the bug this action demonstrates
            record("swallowed", kind=type(exc).__name__)
    if action == "spin":  # a livelock: bytecode keeps running (automatic heartbeat) but pings stop
        call_wrapper.ping()
        spins = 0
        while True:
            spins += 1
    if action == "atomic":
        with call_wrapper.atomic():
            record("atomic_enter")
            time.sleep(float(PLAN.get("atomic_seconds", 1.0)))
            record("atomic_exit")
        time.sleep(120)


def make_ddp(layers: int) -> torch.nn.Module:
    """A DDP model whose gradients travel in one gloo all-reduce per layer, started during backward.

    Buckets of one small layer each: after an abort the gloo workers still hold many of these all-reduce works,
    and each one, created inside ``backward()``, carries a Python object that only the GIL can release."""
    torch.manual_seed(0)  # the same initial weights on every rank and iteration
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(layers)))
    first_bucket = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1  # the first bucket too holds one layer
    try:
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 100 + dist.get_rank()))


def in_init_process_group(thread_id: int) -> bool:
    """Whether THREAD_ID is inside torch's init_process_group right now (read from its Python frames)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and "distributed" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def kill_inside_init(iteration: int) -> None:
    """PLAN["kill_in_init"] = {"rank": R, "iteration": I}: SIGKILL rank R (only its process: its monitor process
    lives on) once its main thread is inside init_process_group of iteration I and every peer has entered it too."""
    spec = PLAN.get("kill_in_init")
    if not spec or spec["rank"] != INITIAL_RANK or spec["iteration"] != iteration:
        return
    import signal
    import threading

    main = threading.get_ident()
    peers = [r for r in range(int(os.environ["WORLD_SIZE"])) if r != INITIAL_RANK]

    def entered(rank: int) -> bool:
        path = OUT / f"rank{rank}.jsonl"
        return path.exists() and any(json.loads(line).get("event") == "init_enter"
                                     and json.loads(line).get("iteration") == iteration
                                     for line in path.read_text().splitlines())

    late = PLAN.get("late_init", {})
    waited_for = [r for r in peers if not (late.get("rank") == r and late.get("iteration") == iteration)]

    def killer() -> None:
        while not (in_init_process_group(main) and all(entered(r) for r in waited_for)):
            time.sleep(0.01)
        time.sleep(float(spec.get("delay", 0.2)))  # let the peers get into the store/gloo rendezvous
        record("killed_in_init", iteration=iteration, inside=in_init_process_group(main))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()


def join_late(iteration: int, call_wrapper: inprocess.CallWrapper) -> None:
    """PLAN["late_init"] = {"rank": R, "iteration": I, and "seconds": S or "after_kill": true}: rank R, busy (it
    keeps making progress), reaches init_process_group S seconds late, or only after another rank was killed
    inside it; the peers wait there for it meanwhile."""
    late = PLAN.get("late_init", {})
    if late.get("rank") != INITIAL_RANK or late.get("iteration") != iteration:
        return
    killed = lambda: any("killed_in_init" in p.read_text() for p in OUT.glob("rank*.jsonl"))  # noqa: E731
    until = time.monotonic() + float(late.get("seconds", 60))
    record("joining_late", iteration=iteration)
    while time.monotonic() < until and not (late.get("after_kill") and killed()):
        call_wrapper.ping()
        time.sleep(0.01)
    if late.get("after_kill"):
        time.sleep(0.2)
        if late.get("then") == "raise":  # gives up instead of joining a group whose store host is gone
            raise RuntimeError("injected: gave up joining late")


def train(call_wrapper: inprocess.CallWrapper) -> str:
    iteration = call_wrapper.iteration
    kill_inside_init(iteration)
    join_late(iteration, call_wrapper)
    record("init_enter", iteration=iteration)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PLAN.get("gloo_timeout", 60)))
    rank, world = dist.get_rank(), dist.get_world_size()
    record("start", iteration=iteration, rank=rank, world=world, env_rank=os.environ["RANK"],
           timings=call_wrapper.restart_timings, slot_dir=str(call_wrapper._recorder.directory))
    planned = PLAN.get("actions", {})
    actions = planned.get(str(iteration), planned.get("*", {})).get(str(INITIAL_RANK), {})
    tensor = torch.ones(4)
    ddp = make_ddp(PLAN["ddp_layers"]) if PLAN.get("ddp_layers") else None
    try:
        for step in range(PLAN.get("steps", 3)):
            if actions.get("at_step") == step:
                inject(actions["do"], call_wrapper)
            if ddp is None:
                dist.all_reduce(tensor)
            else:  # inline: no frame of a helper keeps the model alive in a traceback
                ddp.zero_grad(set_to_none=True)
                ddp(batch(step)).square().mean().backward()
                with torch.no_grad():
                    for p in ddp.parameters():
                        p -= 0.01 * p.grad
            time.sleep(PLAN.get("step_seconds", 0.01))
        if ddp is not None:
            tensor = torch.stack([p.detach().double().sum() for p in ddp.parameters()]).sum().reshape(1)
    except inprocess.RestartInterrupt:
        # recorded first: dropping a big DDP model can take longer than a short soft timeout on a loaded machine,
        # and the Wrapper then raises the interrupt again (taken as swallowed), which would skip the record
        record("interrupted", iteration=iteration)
        ddp = None  # a user dropping the model at once: its reducer held the last reference to the process group
        raise
    except Exception as exc:
        record("error", iteration=iteration, error=f"{type(exc).__name__}: {str(exc)[:120]}")
        ddp = None
        exc.__traceback__ = None  # nor do the frames of the call that raised
        raise
    record("done", iteration=iteration, rank=rank, world=world, value=float(tensor[0]))
    dist.destroy_process_group()
    return f"rank {rank} done"


def main() -> int:
    if PLAN.get("ddp_layers"):  # DDP imports torch._dynamo on first use (~1 s): as a user's optimizer would, before
        import torch._dynamo  # noqa: F401  # the Wrapper, so a soft timeout never lands inside that import
    wrapper = inprocess.Wrapper(**PLAN.get("wrapper", {}), **components())
    if PLAN.get("debug"):
        import logging
        logging.getLogger("nvrx.launcher.rank.inprocess").setLevel(logging.DEBUG)
    if PLAN.get("no_gc"):  # nothing the Wrapper holds may wait for the garbage collector to be released
        import gc
        gc.disable()
    wrapped = wrapper(train)
    for call in range(PLAN.get("calls", 1)):
        try:
            result = wrapped()
        except BaseException as exc:
            record("wrapper_error", kind=type(exc).__name__, message=str(exc), call=call)
            raise
        record("returned", result=result, call=call, kept_groups=pg_graveyard.kept())
    return 0


if __name__ == "__main__":
    sys.exit(main())
