"""Pure parts of the local tier, no processes: the spec's cliques for several (W, J, F), exchange plans, the
file format's checks, the tensor-aware state dict round trip, and bad input as one clear line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nvrx.ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager, NoReplicasAvailableError, clique_groups
from nvrx.ckpt.local.ckpt_managers.local_manager import ckpt_id, newest_restorable
from nvrx.ckpt.local.codec import pack, read_file, unpack, verify_file, write_file
from nvrx.ckpt.local.errors import LocalCheckpointCorruptError, LocalCheckpointError
from nvrx.ckpt.local.replication.group_utils import make_plan, resolve_jump
from nvrx.common.errors import ConfigError, NvrxError


def test_the_spec_example_world_32_jump_8_factor_2() -> None:
    expected = [[n, n + 8] for n in list(range(8)) + list(range(16, 24))]
    assert clique_groups(32, 8, 2) == expected


@pytest.mark.parametrize("w,j,f", [(4, 2, 2), (8, 1, 2), (12, 2, 3), (16, 4, 2), (24, 4, 3), (6, 3, 1), (8, 8, 1)])
def test_cliques_partition_the_world_and_span_failure_domains(w: int, j: int, f: int) -> None:
    groups = clique_groups(w, j, f)
    assert len(groups) == w // f and all(len(g) == f for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(w))
    for g in groups:
        assert all(b - a == j for a, b in zip(g, g[1:]))  # members J apart: J = ranks per node -> F different nodes
        if f > 1 and j > 1:
            assert len({r // j for r in g}) == f


def test_three_copies_example() -> None:
    assert clique_groups(12, 2, 3) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]


@pytest.mark.parametrize("w,j,f", [(30, 8, 2), (10, 4, 2), (6, 2, 2)])
def test_a_world_size_not_divisible_by_j_times_f_is_refused_in_one_line(w: int, j: int, f: int) -> None:
    with pytest.raises(ConfigError) as info:
        clique_groups(w, j, f)
    msg = str(info.value)
    assert "\n" not in msg and f"world size {w} is not divisible" in msg and f"= {j} * {f} = {j * f}" in msg


def test_default_jump_is_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_jump(0) == 8 and resolve_jump(3) == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE is not set"):
        resolve_jump(0)


def test_plan_uses_own_copy_else_lowest_holder_else_no_replicas() -> None:
    a, b = ckpt_id(5, 0), ckpt_id(5, 2)
    plan = make_plan([0, 2], {0: [a, b], 2: []}, [a, b])
    assert dict(plan.local) == {0: a} and plan.transfers == ((0, 2, b),)
    with pytest.raises(NoReplicasAvailableError, match="no copy of iter_000000005_2_local"):
        make_plan([0, 2], {0: [a], 2: []}, [a, b])
    assert issubclass(NoReplicasAvailableError, NvrxError)


def test_newest_restorable_needs_every_shard_from_a_rank_it_can_reach() -> None:
    sources = [[0, 2], [1, 3], [0, 2], [1, 3]]
    avail = {0: [ckpt_id(2, 0), ckpt_id(2, 2), ckpt_id(1, 0)], 1: [ckpt_id(2, 1), ckpt_id(1, 1)],
             2: [ckpt_id(1, 2)], 3: [ckpt_id(1, 3)]}
    it, skipped = newest_restorable(avail, sources)
    assert it == 1 and skipped == ["iteration 2: no intact copy (own file or replica) of the shard of rank(s) [3]"]
    # without replication, rank 2 cannot take its shard from rank 0's files
    assert newest_restorable({0: [ckpt_id(1, 0), ckpt_id(1, 1)], 1: []}, [[0], [1]])[0] == -1


def _state() -> dict:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "h": torch.ones(3, dtype=torch.bfloat16),
            "opt": {"state": {0: {"step": torch.tensor(7)}}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
            "flag": torch.tensor([True, False]), "empty": torch.empty(0, 2), "name": "run", "nothing": None}


def test_file_round_trip_and_every_kind_of_damage_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "x.nvrxl"
    write_file(path, pack(_state(), "x"))
    assert oct(path.stat().st_mode & 0o777) == "0o600" and not list(tmp_path.glob(".*"))
    back = unpack(read_file(path)).state_dict
    assert torch.equal(back["w"], _state()["w"]) and back["h"].dtype == torch.bfloat16
    assert back["opt"] == {"state": {0: {"step": torch.tensor(7)}}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    assert back["empty"].shape == (0, 2) and back["name"] == "run" and back["nothing"] is None
    _, identity = verify_file(path)
    assert torch.equal(unpack(read_file(path, trusted=identity)).state_dict["w"], _state()["w"])
    good = path.read_bytes()
    payload_bit_flip = lambda d: d[:-3] + bytes([d[-3] ^ 1]) + d[-2:]  # noqa: E731
    for damage in (lambda d: d[:-1], lambda d: d + b"x", lambda d: d[:20], lambda d: b"X" + d[1:],
                   payload_bit_flip, lambda d: d[:30] + b"{" + d[31:]):
        path.write_bytes(damage(good))
        with pytest.raises(LocalCheckpointCorruptError):
            read_file(path)
        with pytest.raises(LocalCheckpointCorruptError):
            verify_file(path)
        if damage is not payload_bit_flip:  # header and size checks run even for a file trusted since find_latest
            with pytest.raises(LocalCheckpointCorruptError):
                read_file(path, trusted=identity)


def test_tensor_aware_state_dict_pop_init_insert() -> None:
    sd = BasicTensorAwareStateDict(_state())
    tensors = sd.pop_tensors()
    assert sd.is_hollow and len(tensors) == 5
    with pytest.raises(LocalCheckpointError, match="hollow"):
        _ = sd.tensors
    sd.init_tensors()
    assert [t.shape for t in sd.tensors] == [t.shape for t in tensors]
    sd.pop_tensors()
    sd.insert_tensors(tensors)
    assert all(a is b for a, b in zip(sd.tensors, tensors)) and list(sd.values())[-1] is None
    sd.copy_tensors_to_cpu()
    sd.restore_tensor_device()


def test_objects_that_would_need_pickle_are_refused_in_one_line() -> None:
    with pytest.raises(LocalCheckpointError) as info:
        pack({"sched": {"fn": object()}}, "x")
    assert "state_dict['sched']['fn'] is a object" in str(info.value) and "\n" not in str(info.value)


def test_a_directory_others_can_read_is_refused(tmp_path: Path) -> None:
    (tmp_path / "default").mkdir(mode=0o755)
    os.chmod(tmp_path / "default", 0o755)
    with pytest.raises(LocalCheckpointError, match="is not private .*mode 0755"):
        LocalCheckpointManager(tmp_path)
    mgr = LocalCheckpointManager(tmp_path, session_id="own")  # single process: no process group, no replication
    assert mgr.find_latest() == -1
    mgr.save(_state(), 3)
    mgr.save(_state(), 4, is_async=True)
    assert mgr.find_latest() == 4 and [p.name for p in mgr.local_dir.iterdir()] == ["iter_000000004_0_local.nvrxl"]
    state, id_ = mgr.load()
    assert id_ == "iter_000000004_0_local" and torch.equal(state.state_dict["w"], _state()["w"])
