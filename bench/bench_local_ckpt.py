"""Local checkpoint tier (nvrx.ckpt.local, replicated) vs the global DCP tier, side by side, same state, same run.

    python bench/bench_local_ckpt.py                          # 1 GiB per rank, 2 and 4 ranks
    python bench/bench_local_ckpt.py --size-mib 256 --worlds 2,4 --saves 3

Ranks are real processes (gloo), split over 2 emulated nodes (W/2 ranks each), each node with its own local root
under --local-dir (default /dev/shm); the global tier is --global-dir (default a temporary directory on disk).
Replication: J = ranks per node, F = 2, so every shard has a copy on the other node.

Per save (warm saves after one untimed cold save; medians; the slowest rank counts):
  local        LocalCheckpointManager.save(is_async=True): blocked = snapshot into a staging memfd (+ a size
               all-gather in the clique); the replication exchange runs on a thread, the files are written by the
               persistent checkpoint writer process; durable = + files written and agreed on every rank (wait())
  global       ckpt.AsyncCheckpointer.async_save -> wait() (our DCP writer process)
  dcp_async    torch.distributed.checkpoint.async_save -> result()
  copy floor   one copy of the state into a preallocated buffer (what any snapshot must pay)
Restore: local after node 1's local directory is deleted (its ranks fetch their shards from replicas) vs the
global tier (ckpt.resume). The global files were just written, so they come from the page cache: the global
restore here is a lower bound of what a parallel file system would take.

Memory: the phases run one after another and each frees what it used (files, staging) before the next. A local
save holds, per rank, the state, a staging buffer for its shard and its F-1 replicas, and on the local root both
the previous and the new iteration (F copies each). When that does not fit in /dev/shm next to the rest
(e.g. 4 ranks x 1 GiB on a 24 GiB machine: ~28 GiB), the local root goes to --spill-dir on disk instead, and the
table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_launch import machine_info, save_json  # noqa: E402


# ---------------------------------------------------------------- rank side


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _save_series(saves: int, run: Callable[[int], Callable[[], None]], finish: Callable[[int], None]) -> dict[str, float]:
    """Blocked and durable medians over SAVES warm saves (one cold save first, untimed); FINISH(i) waits for save i."""
    import torch.distributed as dist

    run(0)()
    finish(0)
    blocked, durable = [], []
    for i in range(1, saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        run(i)()
        blocked.append(time.perf_counter() - t0)
        finish(i)
        durable.append(time.perf_counter() - t0)
    return {"blocked_s": statistics.median(blocked), "durable_s": statistics.median(durable)}


def _free(*paths: Path) -> None:
    """Between phases: drop what the last phase left (files under PATHS, by rank 0; Python garbage), so the next
    phase has the machine's memory (/dev/shm files and staging buffers are RAM)."""
    import gc

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
    gc.collect()
    dist.barrier()


def rank_main(rank: int, world: int, port: int, work: Path, local_root: Path, global_root: Path,
              size_mib: int, saves: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from nvrx import ckpt
    from nvrx.ckpt.async_ckpt.staging import default_pool
    from nvrx.ckpt.local import LazyCliqueReplicationStrategy, LocalCheckpointManager

    per_node = world // 2
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                      LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    key = f"w_rank{rank}"
    state = {key: torch.rand(size_mib * (1 << 18)), "step": torch.tensor(0)}
    out: dict[str, Any] = {}

    buf = torch.empty_like(state[key])
    out["copy_floor_s"] = statistics.median(_timed(lambda: buf.copy_(state[key])) for _ in range(3))
    del buf

    # local tier: saves, then restore after node 1 lost its local directory
    def manager() -> LocalCheckpointManager:
        return LocalCheckpointManager(local_root / f"node{rank // per_node}", session_id="bench",
                                      repl_strategy=LazyCliqueReplicationStrategy())

    mgr = manager()
    out["local"] = _save_series(saves, lambda i: lambda: mgr.save(state, i, is_async=True), lambda i: mgr.wait())
    mgr.close()
    del mgr
    _free(local_root / "node1")
    fresh = manager()
    fresh.repl_strategy.replication_strategy  # make the clique groups outside the timing (done once per job)
    holder: dict[str, Any] = {}
    out["restore_local_find_s"] = _timed(fresh.find_latest)  # headers and sizes of every local file
    out["restore_local_load_s"] = _timed(lambda: holder.update(sd=fresh.load()[0]))  # reads + CRC-32s + transfers
    out["restore_local_s"] = out["restore_local_find_s"] + out["restore_local_load_s"]
    out["restore_local_source"] = fresh.last_load_source
    out["restore_local_ok"] = bool(torch.equal(holder["sd"].state_dict[key], state[key]))
    holder.clear()
    fresh.close()
    del fresh
    _free(local_root / "node0")

    # global tier (our DCP writer process), then its restore
    saver = ckpt.AsyncCheckpointer()

    def global_finish(i: int) -> None:
        saver.wait()
        if rank == 0 and i > 0:
            shutil.rmtree(global_root / f"iter_{i - 1:09d}", ignore_errors=True)  # keep the disk use bounded

    out["global"] = _save_series(saves, lambda i: lambda: saver.async_save(state, global_root / f"iter_{i:09d}"),
                                 global_finish)
    target = {key: torch.zeros_like(state[key]), "step": torch.tensor(-1)}
    out["restore_global_s"] = _timed(lambda: saver.resume(global_root, target))
    out["restore_global_ok"] = bool(torch.equal(target[key], state[key]))
    del target
    saver.close()
    default_pool().wait_reserved()  # resume reserved staging for the next save (a thread faults it in): let it end
    default_pool().close()
    _free(global_root)

    # plain torch.distributed.checkpoint.async_save
    futures: list[Any] = []
    out["dcp_async"] = _save_series(
        saves, lambda i: lambda: futures.append(dcp.async_save(state, checkpoint_id=str(work / "dcp" / f"s{i}"))),
        lambda i: futures.pop().result())
    _free(work / "dcp")
    (work / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver


def _available_bytes() -> int:
    """MemAvailable (what new pages can take without swapping or killing)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def pick_local_dir(world: int, size_mib: int, local_dir: Path, spill_dir: Path) -> Path:
    """LOCAL_DIR unless it is memory (tmpfs) and a local save's peak would not fit: then SPILL_DIR (disk)."""
    peak = world * size_mib * (1 << 20) * (1 + 2 + 2 * 2)  # state + staging (own + replica) + 2 iterations x 2 copies
    on_memory = str(local_dir.resolve()).startswith("/dev/shm")
    if on_memory and peak > 0.85 * _available_bytes():
        print(f"W={world}: a local save's peak (~{peak >> 30} GiB) does not fit in memory next to the rest: "
              f"local root on {spill_dir} (disk) instead of {local_dir}", file=sys.stderr)
        return spill_dir
    return local_dir


def run_world(world: int, size_mib: int, saves: int, local_dir: Path, global_dir: Path | None,
              spill_dir: Path) -> dict[str, Any]:
    """Run one measurement with WORLD ranks; the slowest rank's figures."""
    from tests.conftest import free_port

    local_dir = pick_local_dir(world, size_mib, local_dir, spill_dir)
    with tempfile.TemporaryDirectory(prefix="bench-local-") as tmp, \
            tempfile.TemporaryDirectory(prefix="bench-local-", dir=local_dir) as local_root:
        work = Path(tmp)
        groot = Path(global_dir) / f"bench-global-{os.getpid()}-{world}" if global_dir else work / "global"
        groot.mkdir(mode=0o700, parents=True)
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port", str(port),
                                   "--work", str(work), "--local-root", local_root, "--global-root", str(groot),
                                   "--size-mib", str(size_mib), "--saves", str(saves)]) for r in range(world)]
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if global_dir:
                shutil.rmtree(groot, ignore_errors=True)
        if any(codes):
            raise SystemExit(f"bench ranks exited {codes}")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]
    worst = {k: max(r[k] for r in ranks) for k in ("copy_floor_s", "restore_local_s", "restore_local_find_s",
                                                   "restore_local_load_s", "restore_global_s")}
    for tier in ("local", "global", "dcp_async"):
        worst[tier] = {k: max(r[tier][k] for r in ranks) for k in ("blocked_s", "durable_s")}
    worst["restore_sources"] = [r["restore_local_source"] for r in ranks]
    worst["restored_correctly"] = all(r["restore_local_ok"] and r["restore_global_ok"] for r in ranks)
    worst["local_blocked_over_copy_floor"] = worst["local"]["blocked_s"] / worst["copy_floor_s"]
    worst["local_dir"] = str(local_dir)
    return worst


def table(results: dict[str, Any], size_mib: int) -> str:
    rows = [f"state {size_mib} MiB per rank; seconds, slowest rank, median of warm saves",
            f"{'W':>2} {'tier':<10} {'blocked':>8} {'durable':>8}   {'restore':>8}"]
    for world, r in results.items():
        rows.append(f"{world:>2} {'copy floor':<10} {r['copy_floor_s']:8.3f}")
        rows.append(f"{world:>2} {'local':<10} {r['local']['blocked_s']:8.3f} {r['local']['durable_s']:8.3f}   "
                    f"{r['restore_local_s']:8.3f}  (root {r['local_dir']}; node 1 lost: "
                    f"{r['restore_sources'].count('replica')} shards from replicas; find_latest "
                    f"{r['restore_local_find_s']:.3f} + load {r['restore_local_load_s']:.3f})")
        rows.append(f"{world:>2} {'global':<10} {r['global']['blocked_s']:8.3f} {r['global']['durable_s']:8.3f}   "
                    f"{r['restore_global_s']:8.3f}")
        rows.append(f"{world:>2} {'dcp_async':<10} {r['dcp_async']['blocked_s']:8.3f} {r['dcp_async']['durable_s']:8.3f}")
        rows.append(f"{world:>2} local blocked / copy floor = {r['local_blocked_over_copy_floor']:.2f}; "
                    f"restore local/global = {r['restore_local_s'] / r['restore_global_s']:.2f}; "
                    f"restored correctly: {r['restored_correctly']}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--local-dir", default="/dev/shm")
    ap.add_argument("--global-dir", default=None, help="shared storage for the global tier (default: a temp dir)")
    ap.add_argument("--spill-dir", default=tempfile.gettempdir(),
                    help="node-local disk for the local tier when /dev/shm cannot hold a run (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "local_ckpt.json"))
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--local-root", help=argparse.SUPPRESS)
    ap.add_argument("--global-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, Path(args.work), Path(args.local_root), Path(args.global_root),
                  args.size_mib, args.saves)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w < 2 or w % 2 for w in worlds):
        raise SystemExit(f"--worlds: each world size must be even and >= 2 (2 emulated nodes), got {args.worlds}")
    results = {w: run_world(w, args.size_mib, args.saves, Path(args.local_dir), args.global_dir, Path(args.spill_dir))
               for w in worlds}
    text = table(results, args.size_mib)
    print(text)
    save_json(Path(args.out), {"machine": machine_info(), "command": " ".join(sys.argv), "size_mib": args.size_mib,
                               "saves": args.saves, "results": results, "table": text})


if __name__ == "__main__":
    main()
