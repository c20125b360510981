"""A training process that saves checkpoints back to back until told to stop (for the SIGKILL trials).

usage: python crash_trainer.py ROOT STATUS_FILE STOP_FILE

Every checkpoint step_N holds tensors filled with N and meta.step == N, so a reader can tell a
checkpoint that mixes two saves. Appends "writer PID", "saved N" and "failed N: reason" lines to
STATUS_FILE; a failed save (writer killed) is reported and training goes on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from nvrx import ckpt
from nvrx.ckpt.async_ckpt.writer_process import default_writer


def status(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    root, status_file, stop_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    state = {"a": torch.empty(3 << 20), "b": torch.empty(1 << 20), "meta": {"step": 0, "tag": "crash"}}
    found = ckpt.list_checkpoints(root)
    step = int(found[0].path.name.split("_")[1]) + 1 if found else 0  # continue after the newest complete one
    cp = ckpt.AsyncCheckpointer(keep_last=3, files_per_rank=2, overlap_write=True)  # the more involved path
    while not os.path.exists(stop_file):
        state["a"].fill_(float(step))
        state["b"].fill_(float(step))
        state["meta"]["step"] = step
        try:
            cp.async_save(state, root / f"step_{step:05d}")
            status(status_file, f"writer {default_writer().pid}")
            cp.wait()
            status(status_file, f"saved {step}")
        except ckpt.CheckpointWriteError as exc:
            status(status_file, f"failed {step}: {exc}")
        step += 1
    cp.finalize_before_exit()
    status(status_file, "stopped")


if __name__ == "__main__":
    main()
