"""How far a training run got: the iteration in a progress file or of the newest checkpoint.

`nvrx resume` compares it before and after each attempt to stop restart storms (attempts that keep
failing without moving the run forward).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from nvrx.common.files import read_regular

log = logging.getLogger("nvrx.resume")

_CKPT_NAME = re.compile(r"(?:^|[-_])(?:iter|global_step|step|checkpoint)[-_=]?(\d+)(?:\.(?:ckpt|pt|pth))?$")
_TRACKER_FILES = ("latest_checkpointed_iteration.txt", "latest")
MAX_PROGRESS_BYTES = 64 * 1024  # an iteration number; anything bigger is the wrong file


@dataclass(frozen=True)
class ProgressSource:
    """Where the iteration the training reached can be read; both empty: progress is not tracked."""

    progress_file: Path | None = None
    checkpoint_dir: Path | None = None

    @property
    def tracked(self) -> bool:
        return self.progress_file is not None or self.checkpoint_dir is not None


def read_progress(source: ProgressSource) -> int | None:
    """The newest iteration from the progress file and/or the checkpoint dir (None: nothing found)."""
    found = [v for v in (_progress_file_value(source.progress_file),
                         newest_checkpoint_iteration(source.checkpoint_dir)) if v is not None]
    return max(found) if found else None


def _progress_file_value(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        text = _read_small(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("progress file %s cannot be read (%s): ignored", path, exc.strerror or exc)
        return None
    token = text.split()[0] if text else ""
    if not token.isdigit():
        log.warning("progress file %s does not hold an iteration number (%r): ignored", path, text[:40])
        return None
    return int(token)


def newest_checkpoint_iteration(ckpt_dir: Path | None) -> int | None:
    """The tracker file's iteration (Megatron's latest_checkpointed_iteration.txt, DeepSpeed's latest),
    else the largest N among entries named iter_N, step-N, step_N, global_stepN, checkpoint-N, ...-step=N."""
    if ckpt_dir is None:
        return None
    for name in _TRACKER_FILES:
        try:
            text = _read_small(ckpt_dir / name)
        except OSError:
            continue
        if text.isdigit():
            return int(text)
        match = _CKPT_NAME.search(text)
        if match:
            return int(match.group(1))
    best = None
    try:
        names = [entry.name for entry in os.scandir(ckpt_dir)]
    except OSError:
        return None
    for name in names:
        match = _CKPT_NAME.search(name)
        if match and (best is None or int(match.group(1)) > best):
            best = int(match.group(1))
    return best


def _read_small(path: Path) -> str:
    """The stripped text of PATH, a regular file of at most MAX_PROGRESS_BYTES: a fifo in its place must not
    block the driver, nor a huge file stall it (OSError, e.g. NotRegularFile or FileTooLarge, otherwise)."""
    return read_regular(path, MAX_PROGRESS_BYTES).decode(errors="replace").strip()
