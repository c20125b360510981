"""A training loop that ends in one of several ways (for the graceful-stop and no-orphan tests).

usage: python exit_trainer.py ROOT MODE     MODE: graceful | return | raise
graceful: saves every 20 steps; on SIGTERM (job_control.should_stop) saves the agreed step, finalizes, exits 0.
return / raise: schedules a save and ends at once without finalizing (normal end / uncaught exception).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from nvrx import ckpt
from nvrx.ckpt.async_ckpt.writer_process import default_writer
from nvrx.launcher.rank import job_control
def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    state = {"x": torch.zeros(1 << 18), "meta": {"step": 0}}
    if mode in ("return", "raise"):
        ckpt.async_save(state, root / "step_000000")
        print(f"writer {default_writer().pid}", flush=True)
        if mode == "raise":
            raise RuntimeError("training failed")
        return
    for step in range(1_000_000):
        state["x"].fill_(float(step))
        state["meta"]["step"] = step
        time.sleep(0.005)
        ckpt.maybe_finalize()
        if job_control.should_stop(step):
            ckpt.async_save(state, root / f"step_{step:06d}")
            ckpt.finalize_before_exit()
            print(f"stopped {step}", flush=True)
            return
        if step % 20 == 0:
            ckpt.async_save(state, root / f"step_{step:06d}")
            if step:  # (step 0's save is scheduled before the writer line)
                print(f"saving {step}", flush=True)  # tells the test a periodic save is in flight
        if step == 1:
            print(f"writer {default_writer().pid}", flush=True)


if __name__ == "__main__":
    main()
