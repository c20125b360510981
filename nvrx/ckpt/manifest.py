"""The manifest of a checkpoint: every file's size and every item's checksum, recorded at save time.

A DCP checkpoint directory holds ``nvrx_manifest.json`` (written last, before the directory is
published); a torch.save-style file NAME has a sidecar ``NAME.nvrx.json``. ``verify`` re-reads the
files and compares sizes and checksums with what was recorded.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

from nvrx.ckpt.async_ckpt.file_writer import FileSlice, verify_blob, verify_bytes, zip_digest
from nvrx.ckpt.errors import CheckpointError

FORMAT = "nvrx-ckpt/1"
MANIFEST = "nvrx_manifest.json"
SIDECAR_SUFFIX = ".nvrx.json"


def sidecar_path(path: Path) -> Path:
    return path.parent / (path.name + SIDECAR_SUFFIX)


def encode(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"


def read(path: Path) -> dict[str, Any] | None:
    """The manifest of checkpoint PATH (directory or torch.save file), or None if it has none or it is unreadable."""
    target = path / MANIFEST if path.is_dir() else sidecar_path(path)
    try:
        data = json.loads(target.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    return data


def _verify_dcp(path: Path, manifest: dict[str, Any], full: bool) -> list[str]:
    problems = []
    for name, entry in sorted(manifest.get("files", {}).items()):
        file = path / name
        try:
            size = file.stat().st_size
        except OSError as exc:
            problems.append(f"{name}: {exc.strerror}")
            continue
        if size != entry["size"]:
            problems.append(f"{name}: {size} bytes, {entry['size']} recorded")
            continue
        if not full:
            continue
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for item in entry["items"]:
                check = verify_blob if item["kind"] == "tensor" else verify_bytes
                problem = check(fd, item["offset"], item["length"], item["crc32"])
                if problem:
                    problems.append(f"{name} at {item['offset']}: {problem}")
                    break
        finally:
            os.close(fd)
    return problems


def _verify_file(path: Path, manifest: dict[str, Any], full: bool) -> list[str]:
    try:
        size = path.stat().st_size
    except OSError as exc:
        return [f"{path.name}: {exc.strerror}"]
    if size != manifest["size"]:
        return [f"{path.name}: {size} bytes, {manifest['size']} recorded"]
    if not full:
        return []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        problem = verify_blob_whole(fd, size)
    finally:
        os.close(fd)
    if problem:
        return [f"{path.name}: {problem}"]
    if zip_digest(str(path), size) != manifest["digest"]:
        return [f"{path.name}: checksums differ from the recorded ones"]
    return []


def verify_blob_whole(fd: int, size: int) -> str | None:
    try:
        with zipfile.ZipFile(FileSlice(fd, 0, size)) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        return f"damaged ({exc})"
    return f"member {bad} does not match its checksum" if bad else None


def verify(path: Path, full: bool = True) -> None:
    """Raise CheckpointError unless checkpoint PATH is complete and matches its manifest.

    FULL re-reads all data and compares checksums; otherwise only presence and sizes are checked.
    """
    manifest = read(path)
    if manifest is None:
        raise CheckpointError(f"{path} is not a complete checkpoint (no readable manifest)")
    if manifest.get("kind") == "dcp":
        problems = _verify_dcp(path, manifest, full)
    else:
        problems = _verify_file(path, manifest, full)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems[:3]))
