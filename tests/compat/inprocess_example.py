"""A rank script written the way NVRx's in-process documentation and examples write one.

Porting it from NVRx changed one line: ``import nvidia_resiliency_ext.inprocess as inprocess`` became the
import below. Everything else is NVRx's call shapes: ``timedelta`` durations, ``store_kwargs`` with a port
and a timeout, the Tree/Layer rank assignment with a spare, ``ThreadedFinalize(timeout, fn)``,
``RetryController``, ``CudaHealthCheck(timeout=...)``, completion/terminate components, an injected
``CallWrapper`` (``iteration``, ``ping()``, ``atomic()``), a long-lived base TCPStore wrapped in a
``PrefixStore`` per iteration, and the model/optimizer built once outside the wrapped function.

Plan (env NVRX_TEST_PLAN, JSON): {"exit_rank": R, "exit_step": S, "steps": N}; each rank appends what it
saw to $NVRX_TEST_OUT/rank<initial rank>.jsonl (the format of tests/inprocess/harness.py).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch

import nvrx.launcher.rank.inprocess as inprocess  # NVRx: import nvidia_resiliency_ext.inprocess as inprocess

PLAN = json.loads(os.environ["NVRX_TEST_PLAN"])
OUT = Path(os.environ["NVRX_TEST_OUT"])
INITIAL_RANK = int(os.environ["RANK"])


def record(**fields) -> None:
    with open(OUT / f"rank{INITIAL_RANK}.jsonl", "a") as f:
        f.write(json.dumps(fields) + "\n")


class Completed(inprocess.completion.Completion):
    def __call__(self, state):
        record(event="completion", rank=state.rank, active_rank=state.active_rank, mode=state.mode.name)
        return state


class Terminated(inprocess.terminate.Terminate):
    def __call__(self, state):
        record(event="terminate", iteration=state.iteration)
        return state


def finalize_fn() -> None:
    record(event="finalize")


rl = inprocess.rank_assignment


@inprocess.Wrapper(
    store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2, "timeout": datetime.timedelta(seconds=30)},
    initialize=inprocess.initialize.RetryController(max_iterations=4),
    finalize=inprocess.finalize.ThreadedFinalize(timeout=datetime.timedelta(seconds=10), fn=finalize_fn),
    health_check=inprocess.health_check.CudaHealthCheck(timeout=datetime.timedelta(seconds=5)),
    rank_assignment=rl.Tree([rl.Layer(min_ranks=1, max_ranks=2, key_or_fn=lambda _: 0,
                                      flag=rl.LayerFlag.RESERVE)]),
    completion=Completed(),
    terminate=Terminated(),
    monitor_thread_interval=datetime.timedelta(milliseconds=50),
    monitor_process_interval=datetime.timedelta(milliseconds=200),
    heartbeat_timeout=datetime.timedelta(seconds=10),
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
    barrier_timeout=datetime.timedelta(seconds=30),
    completion_timeout=datetime.timedelta(seconds=30),
    monitor_process_logfile=os.environ.get("NVRX_EXAMPLE_MONITOR_LOG"),
)
def train(base_store, model, opt, call_wrapper: inprocess.CallWrapper = None):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record(event="start", iteration=call_wrapper.iteration, rank=rank, world_size=world_size, pid=os.getpid())
    store = torch.distributed.PrefixStore(str(call_wrapper.iteration), base_store)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=20))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(PLAN["steps"]):
        if call_wrapper.iteration == 0 and INITIAL_RANK == PLAN["exit_rank"] and step == PLAN["exit_step"]:
            os._exit(17)  # the process dies: its monitor process stops beating, the others restart
        opt.zero_grad()
        ddp(torch.ones(4, 8)).square().mean().backward()
        opt.step()
        call_wrapper.ping()
    with call_wrapper.atomic():
        weights = float(sum(p.detach().sum() for p in model.parameters()))
    record(event="done", iteration=call_wrapper.iteration, rank=rank, weights=weights)
    return weights  # as in NVRx's examples: the process group is left to the Wrapper (its abort destroys it)


def main() -> int:
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    base_store = torch.distributed.TCPStore(host_name=os.environ["MASTER_ADDR"],
                                            port=int(os.environ["MASTER_PORT"]) + 1, world_size=world_size,
                                            is_master=INITIAL_RANK == 0, multi_tenant=True, wait_for_workers=True,
                                            timeout=datetime.timedelta(seconds=30))
    result = train(base_store, model, opt)
    record(event="returned", value=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
