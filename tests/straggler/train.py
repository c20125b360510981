"""A lock-step gloo training loop for the straggler and workload-control tests, run under `nvrx launch`.

Each step: a timed ``compute`` section (a real matmul plus a sleep, the rank's own work), then an all-reduce
(every rank waits for the slowest there), then a heartbeat. Environment:

  STEPS            steps to run (default 60)
  STEP_SLEEP       seconds of sleep per step inside the compute section (default 0.03)
  SLOW_RANK        this global rank sleeps SLOW_FACTOR times as long (default: none)
  SLOW_FACTOR      (default 2.0)
  SLOW_FROM        the slow rank slows down from this step on (default 0)
  SLOW_MARK        a file the slow rank writes the time (time.time()) it slows down at into
  CONTROL          ExcludeThisNode | ShutdownWorkload: rank CONTROL_RANK sends this request after 5 steps,
                   then every rank keeps stepping (the agent must stop them)
  CONTROL_RANK     (default 0)
  CRASH_RANK       this global rank raises at step CRASH_STEP of the first attempt (a fault: the job restarts)
  CRASH_STEP       (default 30)
"""

import os
import time

import torch
import torch.distributed as dist

from nvrx.monitors import RankMonitorClient, WorkloadAction, WorkloadControlRequest

dist.init_process_group("gloo")
rank = dist.get_rank()
steps = int(os.environ.get("STEPS", "60"))
nap = float(os.environ.get("STEP_SLEEP", "0.03"))
slow = os.environ.get("SLOW_RANK") == str(rank)
factor = float(os.environ.get("SLOW_FACTOR", "2.0"))
slow_from = int(os.environ.get("SLOW_FROM", "0"))
control = os.environ.get("CONTROL")
ft = RankMonitorClient()
ft.init_workload_monitoring()
a = torch.randn(128, 128)
grad = torch.ones(1024)
for step in range(steps if not control else 10**9):
    if slow and step == slow_from and os.environ.get("SLOW_MARK"):
        with open(os.environ["SLOW_MARK"], "w") as fh:
            fh.write(repr(time.time()))
    ft.start_section("compute")
    for _ in range(4):
        a = torch.tanh(a @ a)
    time.sleep(nap * (factor if slow and step >= slow_from else 1.0))
    ft.end_section("compute")
    dist.all_reduce(grad)
    ft.send_heartbeat()
    if (os.environ.get("CRASH_RANK") == str(rank) and step == int(os.environ.get("CRASH_STEP", "30"))
            and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
        raise RuntimeError("test: injected fault")
    if control and step == 5 and rank == int(os.environ.get("CONTROL_RANK", "0")):
        ft.send_workload_control_request(WorkloadControlRequest(WorkloadAction[control], "test: bad node"))
ft.shutdown_workload_monitoring()
dist.destroy_process_group()
