"""Training script for the node-loss test (run by `nvrx launch --local-ckpt-dir`, 2 ranks per node). Arg: WORK.

Attempt 0: local checkpoints (asynchronous, replicated to the other node) at steps 1..4, rank 0 writes WORK/saved,
then every rank waits in collectives until a node is lost (its collective fails). Attempt 1: restore the newest
local checkpoint (WORK/restored-rank<R>.json says what and from where), save steps 5 and 6, exit 0.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nvrx.ckpt.local import LazyCliqueReplicationStrategy, LocalCheckpointManager, default_root


def state(rank: int, step: int) -> dict:
    return {"w": torch.full((4096,), float(100 * step + rank)), "step": step}


def main() -> None:
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    mgr = LocalCheckpointManager(default_root(), repl_strategy=LazyCliqueReplicationStrategy())
    start = 0
    if mgr.find_latest() >= 0:
        restored, _ = mgr.load()
        sd = restored.state_dict
        start = sd["step"]
        (work / f"restored-rank{rank}.json").write_text(json.dumps(
            {"attempt": attempt, "step": start, "w": sorted(set(sd["w"].tolist())), "source": mgr.last_load_source,
             "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "dir": str(mgr.session_dir)}))
    for step in range(start + 1, 5 if attempt == 0 else 7):
        mgr.save(state(rank, step), step, is_async=True)
    mgr.wait()
    if attempt == 0:
        if rank == 0:
            (work / "saved").write_text(str(mgr.session_dir))
        for _ in range(100_000):  # until the test kills node 1's agent: then a collective here fails
            dist.barrier()
        sys.exit(3)
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
