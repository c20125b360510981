"""``PeriodicCheckpointer`` copies the state once, partly on its publishing thread: a checkpoint still holds
exactly the values of its save call, though training went on at once (the optimizer waits for the copy)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from nvrx.ckpt.snapshot import capture
from tests.ckpt.conftest import run_rank_procs
from tests.conftest import tagged_processes

HERE = Path(__file__).resolve().parent


def test_a_snapshot_keeps_the_structure_and_the_values_of_the_call() -> None:
    live = {"w": torch.arange(6.0).reshape(2, 3).requires_grad_(), "n": {"k": 3, "t": torch.ones(4, dtype=torch.int64)},
            "l": [torch.zeros(0), 2.5]}
    snap = capture(live, defer=lambda t: t.dtype == torch.int64)
    try:
        with torch.no_grad():
            live["w"].mul_(10)
        live["n"]["k"] = 4
        assert snap.state["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # copied at the call
        assert snap.state["w"].requires_grad  # saved with the original's properties
        assert snap.state["n"]["k"] == 3 and snap.state["l"][1] == 2.5
        live["n"]["t"].fill_(7)  # deferred: the caller keeps it unchanged until finish_copy; here it did not
        snap.finish_copy()
        assert snap.state["n"]["t"].tolist() == [7, 7, 7, 7]
        assert snap.state["l"][0].numel() == 0
        base = snap.buffer.bytes_view().data_ptr()
        assert all(base <= t.data_ptr() < base + snap.buffer.capacity for t in (snap.state["w"], snap.state["n"]["t"]))
    finally:
        snap.release()


def test_checkpoints_hold_the_values_of_the_save_call(tmp_path: Path) -> None:
    token = run_rank_procs(HERE / "snapshot_ranks.py", tmp_path, 120)
    assert tagged_processes(token) == []
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    names = sorted(ranks[0]["saved"])
    assert names == sorted(ranks[1]["saved"])  # the ranks saved together
    # the first at step 3; later ones when the slow publisher is free again (a due save waits, never piles up)
    assert names[0] == "step_000000003" and names[-1] == "step_000000009" and len(names) >= 2, names
    for name in names:
        expected = ranks[0]["saved"][name]  # rank 0's values (DCP keeps the coordinator's copy of replicated keys)
        loaded = {k: torch.zeros(shape) for k, (shape, _) in expected.items()}
        dcp.load(_nest(loaded), checkpoint_id=str(tmp_path / "ckpts" / name))
        for key, (_, values) in expected.items():
            got = loaded[key].flatten().tolist()
            assert got == values, f"{name}: {key} differs from its value at the save call"
    for rank in ranks:
        assert rank["second_copies"] == 0  # the writer used the snapshot's bytes where they lay
        assert rank["copy_wait"] > 0  # the optimizer step right after a save waited for its slow copy


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    out: dict = {}
    for key, tensor in flat.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = tensor
    return out
