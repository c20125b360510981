"""An elastic job that shrank (4 ranks -> 2) resumes through TwoTierCheckpointer: the local tier, saved at world size
4, is not used (per-rank shards do not reshard) and says so; the global tier's DCP checkpoint is resharded onto 2
ranks, DTensor and ShardedTensor shards included. Real ranks, gloo, 2 emulated nodes."""

from __future__ import annotations

import json
from pathlib import Path


from tests.ckpt.conftest import run_rank_procs
from tests.conftest import tagged_processes

HERE = Path(__file__).resolve().parent


def run(work: Path, world: int, scenario: str) -> list[dict]:
    token = run_rank_procs(HERE / "reshard_ranks.py", work, 120, str(world), scenario, world=world)
    assert tagged_processes(token) == []
    return [json.loads((work / f"{scenario}-rank{r}.json").read_text()) for r in range(world)]


def test_four_ranks_save_two_ranks_resume_from_the_resharded_global_tier(tmp_path: Path) -> None:
    saved = run(tmp_path, 4, "save")
    for r in saved:
        assert r["kinds"] == ["local", "global", "local"]
        assert r["same_world"] == [3, "local"] and r["same_world_ok"]  # same size: the local tier, shard for shard
    assert (tmp_path / "node0" / "job" / "rank1").is_dir()  # files of the 4-rank job where the 2-rank job looks

    res = run(tmp_path, 2, "load")
    for rank, r in enumerate(res):
        assert (r["iteration"], r["tier"]) == (2, "global"), r
        assert "saved at world size 4 are not used at world size 2" in r["reason"]
        assert r["dt_full_ok"] and r["same_object"]
        assert r["dt_local"] == [[1000.0 * 2 + 4 * row + c for c in range(4)] for row in range(4 * rank, 4 * rank + 4)]
        assert r["st_ok"] and r["st_rows"] == [4 * rank, 4]  # 8 rows were 4 shards of 2, now 2 shards of 4
        assert r["rep"] == [2.0] * 3 and r["step"] == 2
