"""Resume benchmark: what ``PeriodicCheckpointer.resume`` costs a restarted rank, part by part (goodput workload).

    python bench/bench_resume.py                 # 2 ranks, 5 rounds of each way (~1 minute)
    python bench/bench_resume.py --rounds 3 --big

The workload of bench/bench_goodput.py (bench/goodput_train.py: a 2.1 M-parameter MLP + Adam under DDP, gloo).
Once: 20 steps with a checkpoint every 10. Then per round, fresh rank processes (torch, DCP and the optimizer
already warm, as in nvrx's rank template) resume from that directory two ways, alternated:

* ``direct`` (what ``resume`` does): each item read straight into its tensor, CRC-32 checked while reading, one
  all-reduce (``nvrx.ckpt.direct_load``).
* ``dcp``: the previous way, a checksum pass over every file, then ``torch.distributed.checkpoint.load``.

Per rank, after a barrier: constructor (its own gloo group), optimizer-state allocation, the load, the rest of ``resume``
(sweep, plan cache, staging reservation, ``set_state_dict``), and the first training step after it.
The slowest rank counts; medians over rounds; ratios direct / dcp from the same run. JSON: bench/results/resume.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("construct", "alloc_optim", "load", "rest_of_resume", "resume", "first_step")


def rank_main(args: argparse.Namespace) -> None:
    """One rank: save (the first run) or resume once the given way and print its timings as JSON."""
    import datetime

    sys.path[:0] = [str(REPO), str(REPO / "bench")]
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - warm, as the rank template is
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from nvrx import ckpt
    import nvrx.ckpt.loader
    from nvrx import ckpt
    import nvrx.ckpt.periodic
    import goodput_train as gt

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(gt.build_model(args.big))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    scratch = torch.nn.Linear(2, 2)  # the template built an optimizer once (torch._dynamo imported)
    torch.optim.Adam(scratch.parameters())
    times: dict[str, float] = {}

    def timed(owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a: object, **k: object) -> object:
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                times[label] = times.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, name, wrapper)

    if args.way == "dcp":
        def old_load(root: object, state: dict, *, process_group: object = None, verify: object = "full",
                     allow_shared_writable: object = None) -> object:
            info = ckpt.loader.list_checkpoints(root)[0]
            ckpt.loader.verify_checkpoint(info.path, full=True)
            torch.distributed.checkpoint.load(state, checkpoint_id=str(info.path), process_group=process_group)
            return info
        ckpt.api.load_latest = old_load
    timed(ckpt.api, "load_latest", "load")
    timed(ckpt.periodic, "_allocate_optimizer_state", "alloc_optim")
    dist.barrier()  # both ranks start resuming together (process start-up skew is not the resume's)
    t = time.perf_counter()
    saver = ckpt.periodic.PeriodicCheckpointer(args.dir, model=model.module, optimizer=opt, every_steps=10)
    times["construct"] = time.perf_counter() - t
    t = time.perf_counter()
    start = saver.resume()
    times["resume"] = time.perf_counter() - t
    gen = torch.Generator()
    steps = 20 if args.way == "save" else 1
    t = time.perf_counter()
    for step in range(start, start + steps):
        gt.train_step(model, opt, saver, gen, step, dist.get_rank(), 0.0)
    times["first_step"] = time.perf_counter() - t
    times["rest_of_resume"] = times["resume"] - times.get("load", 0.0) - times.get("alloc_optim", 0.0)
    saver.close()
    print(json.dumps({"rank": dist.get_rank(), "start": start, **times}), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(way: str, directory: str, world: int, big: bool) -> list[dict[str, float]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1")  # as bench_goodput runs its ranks
        cmd = [sys.executable, __file__, "--rank-of", way, "--dir", directory] + (["--big"] if big else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"bench_resume: a {way} rank failed (exit {p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--big", action="store_true", help="~21 M parameters instead of ~2.1 M")
    ap.add_argument("--output", default=str(REPO / "bench/results/resume.json"))
    ap.add_argument("--rank-of", dest="way", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.way:
        return rank_main(args)
    if args.rounds < 1 or args.world < 1:
        ap.error("--rounds and --world must be >= 1")
    loads = [" ".join(f"{x:.2f}" for x in os.getloadavg())]
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-resume-") as tmp:
        run_ranks("save", tmp, args.world, args.big)
        samples: dict[str, list[dict[str, float]]] = {"direct": [], "dcp": []}
        for _ in range(args.rounds):
            for way in samples:
                ranks = run_ranks(way, tmp, args.world, args.big)
                if any(r["start"] != 20 for r in ranks):
                    raise SystemExit(f"bench_resume: {way} resumed at {[r['start'] for r in ranks]}, not 20")
                samples[way].append({k: max(r.get(k, 0.0) for r in ranks) for k in PARTS})
        loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
    med = {way: {k: statistics.median(s[k] for s in rows) for k in PARTS} for way, rows in samples.items()}
    lines = ["| part (slowest rank, median) | direct | dcp (before) | direct / dcp |", "|---|---|---|---|"]
    for k in PARTS:
        d, o = med["direct"][k], med["dcp"][k]
        lines.append(f"| {k} | {d * 1000:.1f} ms | {o * 1000:.1f} ms | {d / o:.2f}x |" if o else f"| {k} | - | - | - |")
    print("\n".join(lines))
    print(f"load average before / after: {loads[0]} / {loads[1]}")
    Path(args.output).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world": args.world, "big": args.big, "rounds": args.rounds,
        "load_before_after": loads, "median_s": med, "samples_s": samples}, indent=1) + "\n")
    print(f"written {args.output}")


if __name__ == "__main__":
    main()
