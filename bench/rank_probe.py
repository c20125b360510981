"""Rank script used by bench_launch.py: records wall-clock timestamps into an output directory.

Run by a launcher (nvrx or torchrun) on every rank. Modes:

* ``startup``: init the gloo process group, do one all_reduce, record "ready", destroy the
  process group, record "exit" as the very last action, return normally.
* ``restart``: in attempt 0 (TORCHELASTIC_RESTART_COUNT=0) record "ready" (with the pid) and then
  all_reduce every ~10 ms until the benchmark SIGKILLs a rank. In any later attempt record
  "ready" and exit 0 (after destroying the process group).

Files written (atomically: temp file + rename), one JSON object each:
``ready-a{attempt}-r{rank}.json`` and ``exit-a{attempt}-r{rank}.json``.

The output directory comes from ``--out DIR`` or the env var ``NVRX_BENCH_OUT``.
"""

from __future__ import annotations

import time

T_SCRIPT_START = time.time()  # first thing: when user code started running in this rank

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

LOOP_PERIOD_S = 0.010
LOOP_SAFETY_LIMIT_S = 180.0  # attempt-0 loop gives up on its own after this long
# Short enough that a round stuck connecting (stale peer address) fails fast; a healthy init takes ~0.1 s.
PG_TIMEOUT_S = float(os.environ.get("NVRX_BENCH_PG_TIMEOUT", "30"))


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("NVRX_BENCH_OUT"), help="output directory")
    parser.add_argument("--mode", choices=("startup", "restart"), default="startup")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("give --out DIR or set NVRX_BENCH_OUT")
    return args


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically so the benchmark never reads a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _env_int(name: str, default: int = 0) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _init_and_first_allreduce() -> tuple[Any, Any, float, float]:
    """Import torch, form the gloo group, run one all_reduce; return (torch, dist, t_import, t_ready)."""
    import torch
    import torch.distributed as dist

    t_import = time.time()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return torch, dist, t_import, time.time()


def _loop_until_killed(torch: Any, dist: Any) -> None:
    """Keep the group busy; a peer's death makes all_reduce raise (or the launcher kills us)."""
    tensor = torch.ones(1)
    deadline = time.monotonic() + LOOP_SAFETY_LIMIT_S
    while time.monotonic() < deadline:
        dist.all_reduce(tensor)
        time.sleep(LOOP_PERIOD_S)
    raise SystemExit("rank_probe: attempt-0 loop was never interrupted")


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    out = Path(args.out)
    rank = _env_int("RANK")
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT")
    torch, dist, t_import, t_ready = _init_and_first_allreduce()
    _write_json(
        out / f"ready-a{attempt}-r{rank}.json",
        {
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            "world_size": _env_int("WORLD_SIZE"),
            "t_script_start": T_SCRIPT_START,
            "t_import_done": t_import,
            "t_ready": t_ready,
        },
    )
    if args.mode == "restart" and attempt == 0:
        _loop_until_killed(torch, dist)
    dist.destroy_process_group()
    # Very last action: record the exit time, then return normally.
    _write_json(out / f"exit-a{attempt}-r{rank}.json", {"rank": rank, "attempt": attempt, "t_exit": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
