"""Small durable-file helpers: a reader that sees a JSON file either whole-old or whole-new."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping


def fsync_path(path: str | Path) -> None:
    """fsync a file or directory by name (a directory: makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_json_atomic(path: Path, data: Mapping[str, Any], mode: int = 0o600) -> None:
    """Write DATA as JSON to PATH atomically: temp file in the same dir, fsync, rename, fsync dir.

    The file is created with MODE (private by default: these files steer our processes).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_path(path.parent)


def load_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at PATH, or None if the file does not exist. ValueError if it is not an object."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
