"""Names of local checkpoint files: ``iter_<I:09d>_<owner rank>_local.nvrxl`` (one module, so the manager and the
writer process agree on what a valid name is)."""

from __future__ import annotations

import re

SUFFIX = ".nvrxl"
_ID = re.compile(r"^iter_(\d{9})_(\d+)_local$")


def ckpt_id(iteration: int, rank: int) -> str:
    """The id of rank RANK's shard of ITERATION (also its file name, without the suffix)."""
    return f"iter_{iteration:09d}_{rank}_local"


def parse_id(id_: str) -> tuple[int, int] | None:
    """(iteration, owner rank) of ID_, or None if it is not a local checkpoint id."""
    m = _ID.match(id_)
    return (int(m.group(1)), int(m.group(2))) if m else None
