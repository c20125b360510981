"""Find the newest complete checkpoint under a directory, verify it, load it.

Complete means published (not a dot-name) with a manifest; ``verify`` compares sizes and
checksums recorded at save time. A damaged newest checkpoint is skipped with a warning and
the next older one is used, so a resume never starts from half-written data.

Loading a DCP checkpoint unpickles its ``.metadata`` (torch's format): whoever can write the checkpoint
directory can run code in every rank that loads it. So the loader refuses a checkpoint root, checkpoint
directory or ``.metadata`` that is group- or world-writable or owned by another user, unless the caller opts in
(``allow_shared_writable=True`` or ``NVRX_CKPT_ALLOW_SHARED_WRITABLE=1``); nvrx creates checkpoint roots 0700.
"""

from __future__ import annotations

import logging
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvrx.ckpt import fence as fence_mod
from nvrx.ckpt import manifest as manifest_mod
from nvrx.ckpt.errors import CheckpointError
from nvrx.ckpt.publish import is_hidden, read_latest

log = logging.getLogger("nvrx.ckpt.loader")

ALLOW_SHARED_WRITABLE_ENV = "NVRX_CKPT_ALLOW_SHARED_WRITABLE"
DCP_METADATA = ".metadata"


def shared_writable_allowed(allow: bool | None) -> bool:
    """The caller's choice, else the environment's (``NVRX_CKPT_ALLOW_SHARED_WRITABLE=1``); default no."""
    if allow is not None:
        return allow
    return os.environ.get(ALLOW_SHARED_WRITABLE_ENV, "").strip().lower() in ("1", "true", "yes")


def check_private(path: str | Path, allow: bool | None = None) -> None:
    """Raise CheckpointError if PATH, or any entry a load of it unpickles from (``.metadata``), can be
    written by other users (group- or world-writable, or owned by another user: its owner can rewrite it),
    unless ALLOW (or the environment) says so. Owned by root is fine: root can rewrite anything anyway."""
    if shared_writable_allowed(allow):
        return
    path = Path(path)
    me = os.getuid()
    for p in (path.parent, path, path / DCP_METADATA):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise CheckpointError(f"cannot check checkpoint {path}: {p} ({exc.strerror})") from None
        mode = st.st_mode
        if st.st_uid not in (me, 0):
            raise CheckpointError(
                f"refusing to load checkpoint {path}: {p} belongs to another user (uid {st.st_uid}), who could "
                f"rewrite the metadata that loading unpickles; copy the checkpoint into a directory of yours, or set "
                f"{ALLOW_SHARED_WRITABLE_ENV}=1 (allow_shared_writable=True) if you trust that user")
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "everyone" if mode & stat.S_IWOTH else "its group"
            raise CheckpointError(
                f"refusing to load checkpoint {path}: {p} is writable by {who} (mode {stat.S_IMODE(mode):o}), and "
                f"loading unpickles its metadata; run `chmod go-w {p}`, or set {ALLOW_SHARED_WRITABLE_ENV}=1 "
                "(allow_shared_writable=True) if you trust every writer")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: where it is, what kind (``dcp`` directory or ``torch_save`` file), when published."""

    path: Path
    kind: str
    published_at_ns: int
    manifest: dict[str, Any]


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints directly under ROOT, newest first (in-progress and deleted ones are hidden)."""
    root = Path(root)
    found = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoints in {root}: {exc.strerror}") from None
    for entry in entries:
        if is_hidden(entry.name) or entry.name.endswith(manifest_mod.SIDECAR_SUFFIX):
            continue
        data = manifest_mod.read(entry)
        if data is None or data.get("name") != entry.name:
            continue
        found.append(CheckpointInfo(entry, data.get("kind", "dcp"), int(data.get("published_at_ns", 0)), data))
    # no split brain on disk (nvrx/ckpt/fence.py): this round fences out older ones, then skips what they
    # published after that (a checkpoint the fence in force skips stays out: raise_fence does not list it)
    fence_mod.raise_fence(root, [(c.path.name, c.manifest) for c in found])
    fence = fence_mod.read_fence(root)
    found = [c for c in found if not fence_mod.fenced_out(c.manifest, c.path.name, fence)]
    latest = read_latest(root)
    # newest first; on equal times the one `latest` names wins
    found.sort(key=lambda c: (c.published_at_ns, c.path.name == latest), reverse=True)
    return found


def verify_checkpoint(path: str | Path, full: bool = True) -> None:
    """Raise CheckpointError unless PATH is complete and its sizes (and, if FULL, checksums) match."""
    manifest_mod.verify(Path(path), full=full)


def find_latest_checkpoint(root: str | Path, verify: str | None = "full") -> CheckpointInfo | None:
    """The newest complete checkpoint under ROOT that passes VERIFY ("full", "sizes" or None); None if there is none."""
    if verify not in ("full", "sizes", None):
        raise ValueError(f"verify must be 'full', 'sizes' or None, not {verify!r}")
    for info in list_checkpoints(root):
        if verify is None:
            return info
        try:
            manifest_mod.verify(info.path, full=verify == "full")
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
            continue
        return info
    return None


def load_latest(root: str | Path, state_dict: dict[str, Any], *, process_group: Any = None,
                verify: str | None = "full", allow_shared_writable: bool | None = None) -> CheckpointInfo | None:
    """Load the newest complete DCP checkpoint under ROOT into STATE_DICT (in place); None if there is none.

    Every rank must call it (collective) and sees the same files. CheckpointError if that checkpoint can be
    written by other users (``check_private``). Each rank reads straight into its tensors, checking the
    recorded CRC-32 of every item it reads ("full"; ``nvrx.ckpt.direct_load``), and the ranks agree in one
    all-reduce; a state that reader cannot take goes through ``torch.distributed.checkpoint.load`` after a
    verification pass. A damaged newest checkpoint is skipped for the next older one; if it had already
    overwritten part of STATE_DICT and no older one loads, CheckpointError (not None: the state is not fresh).
    """
    from nvrx.ckpt.direct_load import DAMAGED, LOADED
    from nvrx.ckpt import direct_load

    if verify not in ("full", "sizes", None):
        raise ValueError(f"verify must be 'full', 'sizes' or None, not {verify!r}")
    touched = None
    for info in list_checkpoints(root):
        if info.kind != "dcp":
            continue
        check_private(info.path, allow_shared_writable)
        status, why = LOADED, ""
        try:
            if verify is not None:
                manifest_mod.verify(info.path, full=False)
            metadata = load_metadata(info.path, allow_shared_writable)
        except CheckpointError as exc:
            status, why = DAMAGED, str(exc)
        except Exception as exc:  # noqa: BLE001 - an unreadable .metadata: that checkpoint is damaged
            status, why = DAMAGED, f"checkpoint {info.path} is damaged: unreadable metadata ({exc})"
        read = status == LOADED  # the direct read writes into STATE_DICT as it goes
        if read:
            status, why = direct_load.load_direct(info.path, info.manifest, metadata, state_dict,
                                                  check_crc=verify == "full")
            if status == DAMAGED:
                why = f"checkpoint {info.path} is damaged: {why}"
        agreed = max_over_ranks(status, process_group)
        if agreed == LOADED:
            return info
        if agreed == DAMAGED:
            log.warning("skipping %s", why or f"{info.path} (damaged on another rank)")
            touched = touched or (info.path if read else None)
            continue
        log.debug("%s: loading through DCP (%s)", info.path, why or "another rank needs it")
        if verify == "full":
            try:
                manifest_mod.verify(info.path, full=True)
            except CheckpointError as exc:
                log.warning("skipping %s", exc)
                continue
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # torch warns that one process loads alone; that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, checkpoint_id=str(info.path), process_group=process_group)
        return info
    if touched is not None:
        raise CheckpointError(f"checkpoint {touched} was damaged after part of it was loaded, and no older "
                              f"complete checkpoint under {root} could be loaded; the state is not a fresh start")
    return None


def max_over_ranks(value: int, process_group: Any = None) -> int:
    """The largest VALUE over the ranks of PROCESS_GROUP (one tiny all-reduce; this rank's own without a group).

    How ranks reach one answer (the worst load status, "anyone due for a save?") without a store round trip.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(process_group) <= 1:
        return value
    flag = torch.tensor([value], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
    return int(flag.item())


def load_metadata(path: str | Path, allow_shared_writable: bool | None = None) -> Any:
    """The DCP metadata of checkpoint PATH (for ``init_checkpoint_metadata_cache``); refused like load_latest."""
    from nvrx.ckpt.async_ckpt.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader

    check_private(path, allow_shared_writable)  # (read once per version of the file: resume reads it three times)
    return CachedMetadataFileSystemReader(str(path)).read_metadata()
