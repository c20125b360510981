"""A staging failure on one rank of two (real processes, gloo): both ranks raise the same clear error at the
save call, nobody hangs in finalize, nothing half-written is left, the previous checkpoint stays `latest` and
loadable, and the next save - even to the same name - works."""

from __future__ import annotations

from pathlib import Path

from nvrx import ckpt
from tests.ckpt.conftest import run_two_ranks
from tests.conftest import tagged_processes

HERE = Path(__file__).resolve().parent
JOIN_TIMEOUT = 120.0  # the ranks' own gloo timeout is 20 s: a rank stuck in a collective ends long before this


def test_staging_failure_on_one_rank_is_agreed_by_all_ranks(tmp_path: Path) -> None:
    ranks, token = run_two_ranks(HERE / "staging_fault_ranks.py", tmp_path, JOIN_TIMEOUT)
    root = tmp_path / "root"
    for case, injected in (("A", "rank 1: MemoryError: cannot allocate"), ("B", "rank 1: RuntimeError: device lost")):
        errors = [r[case]["error"] for r in ranks]
        assert errors[0] is not None and errors[0] == errors[1], (case, errors)  # the same error on both ranks
        assert f"{root / 'step_2'} was not saved" in errors[0] and injected in errors[0], errors[0]
        assert "every rank abandoned this save and the previous checkpoint is intact" in errors[0]
        assert "rank 0:" not in errors[0] and "\n" not in errors[0]
        for r in ranks:
            assert r[case]["pending"] == 0  # nothing scheduled that a later maybe_finalize would wait on
            assert r[case]["listing"] == {"visible": ["latest", "step_1"], "hidden": [], "latest": "step_1"}, case
            assert r[case]["step_1"] == 1.0  # the previous checkpoint loads (collectively, on both ranks)
    for r in ranks:
        assert r["after"] == {"visible": ["latest", "step_1", "step_2"], "hidden": [], "latest": "step_2"}
        assert r["step_2"] == 4.0
        assert r["writer_pid_after"] == r["writer_pid"]  # the persistent writer survived both failures
    ckpt.verify_checkpoint(root / "step_1")
    ckpt.verify_checkpoint(root / "step_2")
    assert tagged_processes(token) == []  # ranks and their writer processes are gone
