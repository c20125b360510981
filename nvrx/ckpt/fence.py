"""Fencing checkpoints by launch and round: no split brain on disk.

A node cut off from the job (a partition, a frozen host) may still have ranks of a round the job has left when
the others restart without it; the coordinator among them could publish a checkpoint after the new round
resumed from an older one, and by publication time it would look newest. Under ``nvrx launch`` every rank knows
its launch (``NVRX_LAUNCH``: the rendezvous store host's start time in ns) and round (``NVRX_ROUND``), which
order the job's rounds. So:

* every published checkpoint's manifest carries ``fence: [launch, round]`` (and the run id);
* a round that looks for checkpoints (listing them, to resume or to prune) raises the fence: the file
  ``<root>/.nvrx_fence.json`` (hidden like partial saves) holding its ``[launch, round]`` and the names of the
  checkpoints present at that moment, written atomically, only ever to a later key;
* a publisher whose key is below the fence does not publish (CheckpointFenced), and the loader ignores a
  checkpoint whose key is below the fence unless the fence lists it (it was there before the new round looked):
  one published in the race between that check and the rename is still never taken for the newest;
* a round raising the fence lists only the checkpoints the fence in force accepts: one published in that race
  stays out in every later round (else the next round to look, a restart or the healed host rejoining, would
  list it, and it would be the newest: it was published last);
* a publisher that finds, after its rename, the fence past its key and its checkpoint not listed (that race)
  removes the checkpoint again before it moves ``latest`` (CheckpointFenced): nobody can have taken it.

Just-in-time checkpoints are global checkpoints written by one rank (``nvrx.ckpt.jit``): the same stamp, check
and filter apply to them.

Local checkpoints (``nvrx.ckpt.local``) live in each rank's directory on node-local storage, which the ranks of a
later round may never have looked at (a cut-off node's disk: it was not in the rounds that ran without it), so
"what was there when the new round looked" cannot be kept beside the files. Instead each file's header carries the
key, and the rounds keep a lineage: every ``find_latest`` records ``[launch, round, iteration]`` (the iteration
that round resumed from; the lowest if it looked twice) in ``<rank dir>/.nvrx_fence.json``, the ranks merge what
every directory holds (one all-gather, which find_latest does anyway), and a file is from a branch the job left
when some lineage entry is of a later round and resumed from an older iteration than the file's: a round that
resumed from iteration I never saw the files of older rounds past I. A save whose round is below a lineage entry
of its own directory is refused on every rank (the same agreement that ends a failed save).

Checkpoints saved without the launcher (no key) are never fenced out. Launches are ordered by the store host's
clock: a relaunch on another host with a clock behind by more than the time between the launches would be
ordered wrongly (its checkpoints would be ignored until the fence file is removed; one warning line says so).
The key's parts come only from signed sources: the round from the signed round records, the launch time from the
store host's signed answer to each joiner's greeting (nvrx/launcher/agent/store.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from nvrx.ckpt.errors import CheckpointError
from nvrx.ckpt.publish import atomic_write, discard
from nvrx.common import files

log = logging.getLogger(__name__)

FENCE_FILE = ".nvrx_fence.json"
ROUND_ENV = "NVRX_ROUND"
LAUNCH_ENV = "NVRX_LAUNCH"
RUN_ENV = "TORCHELASTIC_RUN_ID"


class CheckpointFenced(CheckpointError):
    """This rank's round was left by the job: its checkpoint is not published."""


def current_key() -> tuple[int, int] | None:
    """(launch, round) of this rank under nvrx launch; None elsewhere (torchrun, a plain script)."""
    launch, rnd = os.environ.get(LAUNCH_ENV, ""), os.environ.get(ROUND_ENV, "")
    if not (launch.isdigit() and rnd.isdigit()):
        return None
    return int(launch), int(rnd)


def stamp() -> dict[str, Any]:
    """Manifest fields that fence a checkpoint (empty outside nvrx launch)."""
    key = current_key()
    return {} if key is None else {"fence": list(key), "run_id": os.environ.get(RUN_ENV, "")}


def _key_of(value: Any) -> tuple[int, int] | None:
    if (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        return value[0], value[1]
    return None


def read_fence(root: Path) -> tuple[tuple[int, int], frozenset[str], str] | None:
    """(key, names known when it was raised, run id) of ROOT's fence, or None (absent or unreadable)."""
    try:
        data = json.loads((Path(root) / FENCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    key = _key_of(data.get("fence")) if isinstance(data, dict) else None
    known = data.get("known") if isinstance(data, dict) else None
    if key is None or not isinstance(known, list):
        return None
    return key, frozenset(n for n in known if isinstance(n, str)), str(data.get("run_id", ""))


def raise_fence(root: Path, present: list[tuple[str, dict[str, Any]]]) -> None:
    """Called by a rank about to choose among ROOT's checkpoints (PRESENT: name, manifest): from now on, rounds
    before this rank's are fenced out of ROOT. Lists only what the fence in force accepts, so a checkpoint
    published in the check-rename race stays out in every later round. Only ever moves the fence forward; a
    read-only root is left as it is."""
    key = current_key()
    if key is None:
        return
    fence = read_fence(root)
    if fence is not None and fence[0] >= key:
        return
    known = sorted(name for name, manifest in present if not fenced_out(manifest, name, fence, quiet=True))
    data = {"fence": list(key), "run_id": os.environ.get(RUN_ENV, ""), "known": known}
    try:
        atomic_write(Path(root) / FENCE_FILE, json.dumps(data).encode())
    except OSError as exc:
        log.debug("cannot write the checkpoint fence in %s: %s", root, exc)


def check_publish(root: Path, name: str) -> None:
    """Raise CheckpointFenced if ROOT's fence is past this rank's round (the job left it)."""
    key = current_key()
    fence = read_fence(root)
    if key is None or fence is None or fence[0] <= key:
        return
    raise CheckpointFenced(f"checkpoint {Path(root) / name} was not published: it was saved in round {key[1]}, "
                           f"which the job has left (round {fence[0][1]} fenced the checkpoint directory); "
                           "this node was cut off from the job")


def fenced_out(manifest: dict[str, Any], name: str, fence: tuple[tuple[int, int], frozenset[str], str] | None,
               quiet: bool = False) -> bool:
    """Whether a checkpoint (its MANIFEST, its NAME) is from a round the job had left when it was published."""
    if fence is None:
        return False
    key = _key_of(manifest.get("fence"))
    if key is None or key >= fence[0] or name in fence[1]:
        return False
    if not quiet:
        log.warning("ignoring checkpoint %s: published by round %d after round %d of the job began (a node cut off "
                    "from the job)", name, key[1], fence[0][1])
    return True


def check_published(root: Path, name: str, manifest: dict[str, Any], *paths: Path) -> None:
    """After the rename of checkpoint NAME (its MANIFEST) into ROOT: if a later round raised the fence between
    ``check_publish`` and the rename without listing it, no loader will ever take it (``fenced_out``): remove it
    (PATHS: the files it consists of; default ROOT/NAME) and raise CheckpointFenced, before ``latest`` moves."""
    fence = read_fence(root)
    if not fenced_out(manifest, name, fence, quiet=True):
        return
    for path in paths or (Path(root) / name,):
        try:
            discard(path)
        except OSError as exc:  # the loaders skip it anyway
            log.debug("cannot remove the fenced-out checkpoint %s: %s", path, exc)
    key = _key_of(manifest.get("fence")) or (0, 0)
    raise CheckpointFenced(f"checkpoint {Path(root) / name} was removed after its publication: it was saved in round "
                           f"{key[1]}, which the job has left (round {fence[0][1]} fenced the checkpoint directory "
                           "during the rename); this node was cut off from the job")


# ---------------------------------------------------------------- local checkpoints: the lineage of rounds

MAX_LINEAGE = 64  # entries kept: an older entry only matters for files older than every newer entry's iteration
Lineage = list  # [(launch, round, iteration)], sorted by key


def key_of(value: Any) -> tuple[int, int] | None:
    """A manifest's or header's ``fence`` as a key, or None (absent or malformed: never fenced out)."""
    return _key_of(value)


def _entry_of(value: Any) -> tuple[int, int, int] | None:
    if (isinstance(value, list) and len(value) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and value[0] >= 0
            and value[1] >= 0 and value[2] >= -1):
        return value[0], value[1], value[2]
    return None


def read_lineage(directory: Path) -> list[tuple[int, int, int]]:
    """The lineage recorded in DIRECTORY (a local checkpoint rank directory); [] when absent or unreadable."""
    try:
        data = json.loads((Path(directory) / FENCE_FILE).read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("lineage") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return []
    return merge_lineage([[e for e in map(_entry_of, entries[:4 * MAX_LINEAGE]) if e is not None]])


def merge_lineage(lineages: list[Any]) -> list[tuple[int, int, int]]:
    """One lineage from several (each rank's directory): per key the lowest iteration, the newest MAX_LINEAGE keys."""
    lowest: dict[tuple[int, int], int] = {}
    for lineage in lineages:
        for entry in lineage or []:
            e = _entry_of(list(entry))
            if e is not None:
                key = (e[0], e[1])
                lowest[key] = min(e[2], lowest.get(key, e[2]))
    return [(k[0], k[1], it) for k, it in sorted(lowest.items())[-MAX_LINEAGE:]]


def record_resume(lineage: list[tuple[int, int, int]], iteration: int) -> list[tuple[int, int, int]]:
    """LINEAGE with this rank's round resuming from ITERATION (-1: none) added; unchanged outside nvrx launch."""
    key = current_key()
    if key is None:
        return lineage
    return merge_lineage([lineage, [(key[0], key[1], iteration)]])


def write_lineage(directory: Path, lineage: list[tuple[int, int, int]]) -> None:
    """Store LINEAGE in DIRECTORY (atomically); a failure is logged, not raised (the files are still checked)."""
    if read_lineage(directory) == lineage:
        return
    try:
        files.atomic_write(Path(directory) / FENCE_FILE,  # private, like the local checkpoints beside it
                           json.dumps({"lineage": [list(e) for e in lineage]}).encode())
    except OSError as exc:
        log.debug("cannot write the local checkpoint lineage in %s: %s", directory, exc)


def left_branch(key: tuple[int, int] | None, iteration: int,
                lineage: list[tuple[int, int, int]]) -> tuple[int, int, int] | None:
    """The lineage entry showing that a local checkpoint of ITERATION written by round KEY is from a branch the job
    left (a later round resumed from an older iteration), or None when it is not (or has no key)."""
    if key is None:
        return None
    for entry in lineage:
        if key < (entry[0], entry[1]) and iteration > entry[2]:
            return entry
    return None


def local_save_refused(directory: Path) -> str | None:
    """Why this rank may not save a local checkpoint into DIRECTORY: a later round of the job already resumed
    there (this rank's round was left); None when it may."""
    key = current_key()
    if key is None:
        return None
    later = [e for e in read_lineage(directory) if (e[0], e[1]) > key]
    if not later:
        return None
    return (f"local checkpoint in {directory} not saved: it is of round {key[1]}, which the job has left (round "
            f"{later[-1][1]} resumed there); this node was cut off from the job")
