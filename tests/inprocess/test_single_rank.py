"""The whole Wrapper in this process: one rank, a custom store (StoreMixin + torch's FileStore)."""

from __future__ import annotations

import datetime
import threading

import psutil
import torch
import torch.distributed as dist

from nvrx.launcher.rank import inprocess
from nvrx.launcher.rank.inprocess.store import StoreMixin
from tests.conftest import free_port


class FileStore(StoreMixin, dist.FileStore):
    """A user-defined store: any torch store class plus StoreMixin."""

    def __init__(self, path: str, world_size: int = 1) -> None:
        dist.FileStore.__init__(self, path, world_size)


def test_restart_in_process_with_a_custom_store_and_call_wrapper_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    seen = []
    threads_before = threading.active_count()
    children_before = {c.pid for c in psutil.Process().children()}  # e.g. other tests' persistent workers

    @inprocess.Wrapper(store_factory=FileStore, store_kwargs={"path": str(tmp_path / "store")},
                       initialize=inprocess.initialize.RetryController(max_iterations=3),
                       finalize=inprocess.finalize.ThreadedFinalize(lambda state: seen.append(("finalize", state.iteration)), 5.0),
                       health_check=inprocess.Compose(inprocess.health_check.CudaHealthCheck(),
                                                      inprocess.health_check.FaultCounter(max_rank_faults=2)),
                       monitor_process_logfile=str(tmp_path / "monitor{rank}.log"))
    def train(scale, call_wrapper=None):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        call_wrapper.ping()
        with call_wrapper.atomic():
            seen.append(("run", call_wrapper.iteration, dist.get_world_size()))
        if call_wrapper.iteration == 0:
            raise RuntimeError("first attempt fails")
        dist.destroy_process_group()
        return float(t[0])

    assert train(3) == 3.0
    assert seen == [("run", 0, 1), ("finalize", 0), ("run", 1, 1)]
    assert (tmp_path / "monitor0.log").read_text().count("stopped by the rank") == 1
    assert [c for c in psutil.Process().children() if c.pid not in children_before] == []  # monitor reaped
    assert threading.active_count() == threads_before  # the Wrapper's threads ended with its call
