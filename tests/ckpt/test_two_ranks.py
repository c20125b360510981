"""Two real ranks (gloo) with their own writer processes: resharding both ways through plain DCP, snapshot
semantics with a sharded DTensor, plan cache reuse / invalidation / reuse after resume, ranks that disagree."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from nvrx import ckpt
from tests.ckpt.conftest import run_two_ranks
from tests.conftest import tagged_processes

HERE = Path(__file__).resolve().parent


def dcp_load(state: dict, path: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))
    return state


def test_two_ranks_reshard_both_ways_snapshot_cache_and_mismatch(tmp_path: Path) -> None:
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    one = ckpt.AsyncCheckpointer()
    one.async_save({"w": full * 10}, tmp_path / "from_one")  # written by one process, loaded by two
    one.wait()

    (r0, r1), token = run_two_ranks(HERE / "two_ranks.py", tmp_path, 150)

    # 1 -> 2: each rank got its rows of the tensor one process saved
    assert torch.equal(torch.tensor(r0["loaded_shard"]), full[:4] * 10)
    assert torch.equal(torch.tensor(r1["loaded_shard"]), full[4:] * 10)

    # 2 -> 1: the sharded tensor saved by two ranks loads whole here, with the values of the save call
    template = {"w": torch.zeros(8, 4), "b": torch.zeros(3), "meta": {"step": 0, "name": "", "lrs": [0.0, 0.0]}}
    step1 = dcp_load(template, tmp_path / "root" / "step_1")
    assert torch.equal(step1["w"], full) and torch.equal(step1["b"], torch.full((3,), 5.0))
    assert step1["meta"] == {"step": 7, "name": "run-a", "lrs": [0.1, 0.2]}
    step2 = dcp_load({**template, "meta": {"step": 0, "name": "", "lrs": [0.0, 0.0]}}, tmp_path / "root" / "step_2")
    assert torch.equal(step2["w"], full + 1000) and step2["meta"]["step"] == 8

    # plan cache: identical structure reused, changed structure planned again
    for r in (r0, r1):
        assert (r["after_identical"]["hits"], r["after_identical"]["misses"]) == (1, 1)
        assert r["after_identical"]["validated_cache_reuse"] is True
        assert (r["after_changed"]["hits"], r["after_changed"]["misses"]) == (1, 2)
        assert r["after_changed"]["validated_cache_reuse"] is False
    step3 = dcp_load({**template, "meta": {"step": 0, "name": "", "lrs": [0.0, 0.0]}, "extra": torch.zeros(2, 2)},
                     tmp_path / "root" / "step_3")
    assert torch.equal(step3["extra"], torch.full((2, 2), 3.0))

    # ranks that disagree on a shape: the same clear error on both, nothing pending, nothing left behind
    assert r0["mismatch_error"] == r1["mismatch_error"]
    assert "'x' is float32 [4] on rank 0 but float32 [5] on rank 1" in r0["mismatch_error"]
    assert r0["pending_after_mismatch"] == r1["pending_after_mismatch"] == 0
    assert not (tmp_path / "root" / "bad").exists() and not (tmp_path / "root" / ".bad.partial").exists()

    # resume: the plans recorded in step_3 were verified on both ranks and reused, no planning at all
    for r in (r0, r1):
        assert r["resumed_from"] == "step_3" and r["resumed_meta_step"] == 8
        assert r["after_resume"]["validated_loaded_metadata_reuse"] is True
        assert (r["after_resume"]["hits"], r["after_resume"]["misses"]) == (1, 0)
    step4 = dcp_load({**template, "meta": {"step": 0, "name": "", "lrs": [0.0, 0.0]}, "extra": torch.zeros(2, 2)},
                     tmp_path / "root" / "step_4")
    assert torch.equal(step4["w"], full + 1000) and torch.equal(step4["extra"], torch.full((2, 2), 3.0))

    assert r0["finalize_nothing"] == []
    assert (tmp_path / "root" / "latest").read_text().strip() == "step_4"
    found = ckpt.list_checkpoints(tmp_path / "root")
    assert sorted(c.path.name for c in found) == ["step_1", "step_2", "step_3", "step_4"]
    for info in found:
        ckpt.verify_checkpoint(info.path)
        assert info.manifest["world_size"] == 2
    assert tagged_processes(token) == []  # ranks and their writer processes are all gone
