"""nvrx.ckpt.jit in one process: the step gate, who saves, the sharded fallback, the step accounting."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from nvrx import ckpt
from nvrx.ckpt import jit
from nvrx.ckpt.periodic import STEP_KEY


def saver_for(tmp_path, state, steps=5):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    return jit.JitCheckpointer(tmp_path, opt, lambda: dict(state), lambda gate: steps, lambda: None), opt


def test_only_the_lowest_surviving_rank_saves_and_the_state_is_published(tmp_path):
    saver, _ = saver_for(tmp_path, {"w": torch.arange(4.0)})
    assert saver.save([0], 1, 3, time.monotonic() + 5)["saved"]  # rank 0 lost: rank 1 saves
    assert saver.save([0], 2, 3, time.monotonic() + 5)["skipped"].startswith("rank 1 saves")
    (info,) = ckpt.list_checkpoints(tmp_path)
    assert info.path.name == "jit_step_000000005"
    ckpt.verify_checkpoint(info.path)
    state = {"w": torch.zeros(4), STEP_KEY: -1}
    ckpt.load_latest(tmp_path, state)
    assert torch.equal(state["w"], torch.arange(4.0)) and state[STEP_KEY] == 5


def test_the_saver_the_agents_chose_saves_when_no_lost_rank_is_named(tmp_path):
    # a node lost with its agent: the stop names no lost rank, the claiming agent names its lowest live rank
    saver, _ = saver_for(tmp_path, {"w": torch.arange(4.0)})
    assert saver.save([], 0, 4, time.monotonic() + 5, saver=2)["skipped"].startswith("rank 2 saves")
    assert ckpt.list_checkpoints(tmp_path) == []
    assert saver.save([], 2, 4, time.monotonic() + 5, saver=2)["saved"]
    assert [i.path.name for i in ckpt.list_checkpoints(tmp_path)] == ["jit_step_000000005"]


def test_a_thread_inside_optimizer_step_keeps_the_save_out_until_the_deadline(tmp_path):
    saver, opt = saver_for(tmp_path, {"w": torch.ones(2)})
    inside, release = threading.Event(), threading.Event()
    opt.register_step_pre_hook(lambda *_: (inside.set(), release.wait(10)) and None)
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    stepping = threading.Thread(target=opt.step)
    stepping.start()
    assert inside.wait(10)
    result = saver.save([1], 0, 2, time.monotonic() + 0.3)
    release.set()
    stepping.join()
    assert not result["saved"] and "inside optimizer.step()" in result["error"]
    assert ckpt.list_checkpoints(tmp_path) == []
    assert saver.gate.steps == 1 and saver.save([1], 0, 2, time.monotonic() + 5)["saved"]  # between steps: saved


def test_a_sharded_state_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        saver, _ = saver_for(tmp_path, {"w": distribute_tensor(torch.ones(4), mesh, [Shard(0)])})
        result = saver.save([1], 0, 2, time.monotonic() + 5)
    finally:
        dist.destroy_process_group()
    assert not result["saved"] and "sharded state (DTensor)" in result["error"] and "[1]" in result["error"]
    assert ckpt.list_checkpoints(tmp_path) == []


def test_the_steps_done_are_refused_when_step_was_not_called_per_optimizer_step(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = ckpt.PeriodicCheckpointer(tmp_path, model=model, optimizer=opt, every_steps=100, background=False)
    saver._marker = (7, 3)  # 7 steps done when the gate had counted 3 optimizer steps
    assert saver._jit_steps(3) == 7 and saver._jit_steps(4) == 8
    assert "stepped 2 times" in saver._jit_steps(5)


def test_the_lost_ranks_of_a_stop_record():
    from nvrx.events.records import StopDetail
    from nvrx.launcher.agent.jit_request import lost_ranks

    assert lost_ranks("failed", StopDetail(rank=5, group_rank=1), 4) == [5]
    assert lost_ranks("node_left", StopDetail(node="n2", group_rank=2), 4) == [8, 9, 10, 11]
    assert lost_ranks("failed", StopDetail(monitor_failed=True), 4) == []
    assert lost_ranks("failed", StopDetail(peer_failed=0, describe="a peer is gone"), 4) == []
