"""Two tiers end to end (2 real ranks on 2 emulated nodes, gloo): the newest restorable iteration wins, whichever
tier has it; a damaged local tier falls back to a replica, then to the global tier; the answer says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nvrx.ckpt.local.ckpt_managers.local_manager import SUFFIX, ckpt_id
from tests.ckpt.conftest import run_rank_procs
from tests.conftest import tagged_processes

HERE = Path(__file__).resolve().parent


def run2(work: Path, scenario: str, *extra: str, timeout: float = 90) -> list[dict]:
    token = run_rank_procs(HERE / "tier_ranks.py", work, timeout, scenario, *extra)
    assert tagged_processes(token) == []
    return [json.loads((work / f"{scenario}-rank{r}.json").read_text()) for r in (0, 1)]


def shard(work: Path, holder: int, owner: int, iteration: int = 7) -> Path:
    return work / f"node{holder}" / "job" / f"rank{holder}" / (ckpt_id(iteration, owner) + SUFFIX)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("trained")
    res = run2(work, "train")
    assert res[0]["kinds"] == ["local", "local", "global", "local", "local", "global", "local"]
    return work


@pytest.fixture
def work(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "w", ignore=shutil.ignore_patterns("train-rank*.json"))
    return tmp_path / "w"


def assert_values(res: list[dict], iteration: int, tier: str) -> None:
    for rank, r in enumerate(res):
        assert (r["iteration"], r["tier"]) == (iteration, tier), r
        assert r["w"] == 10.0 * iteration and r["own"] == 10.0 * iteration + rank
        assert r["step"] == iteration and r["same_tensor"]


@pytest.mark.slow
def test_tier_choice_and_fallbacks(work: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(work, base)

    res = run2(work, "resume")  # local 7 beats global 6
    assert_values(res, 7, "local")
    assert "local iteration 7 is at least as new as the global tier's (6)" in res[0]["reason"]

    shard(work, 0, 0).write_bytes(shard(work, 0, 0).read_bytes()[:-5])  # rank 0's own copy torn: its replica serves
    assert_values(run2(work, "resume"), 7, "local")

    shard(work, 1, 1).unlink()  # both copies of rank 1's shard of 7 gone: the global tier, saying why
    shard(work, 0, 1).unlink()
    res = run2(work, "resume")
    assert_values(res, 6, "global")
    assert "local iteration" not in res[0]["reason"] and "no restorable local checkpoint" in res[0]["reason"]

    res = run2(base, "resume", "1")  # intact local copies, but the user's check rejects rank 1's state
    assert_values(res, 6, "global")
    assert "validation hook rejected rank 1" in res[0]["reason"]

    shutil.rmtree(base / "global")  # nothing usable anywhere: a fresh start, said plainly (no exception, no loop)
    for holder in (0, 1):
        for owner in (0, 1):
            shard(base, holder, owner).unlink()
    res = run2(base, "resume")
    assert all(r["iteration"] == -1 and r["tier"] is None and "starting fresh" in r["reason"] for r in res)
