"""Say in one line why nvrx could not run: a dependency that is missing, or a user's file that shadows it.

Only the standard library here: it runs when nvrx's own dependencies may be what failed to import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# import name -> distribution name, for the third-party packages nvrx imports
DEPENDENCIES = {"torch": "torch", "click": "click", "yaml": "PyYAML", "psutil": "psutil", "rich": "rich",
                "numpy": "numpy"}
_INSTALL_HINT = {
    "torch": "pip install torch (pick the build for your machine first, e.g. torch==2.13.0 for the CPU)",
    "yaml": "pip install pyyaml",
}


def _origin(top: str) -> str | None:
    """Where TOP is (or would be) imported from, or None when it is not importable at all."""
    module = sys.modules.get(top)
    spec = getattr(module, "__spec__", None) if module is not None else None
    if spec is None:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("built-in", "frozen", "namespace"):
        return spec.origin
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else None


def _installed_at(origin: str, top: str) -> bool:
    """Whether ORIGIN (the file TOP imports from) belongs to an installed distribution: the sys.path entry
    holding it also holds that distribution's metadata (``<dist>-<version>.dist-info`` or an egg-info)."""
    entry = _entry_of(origin)
    dist = DEPENDENCIES.get(top, top).lower().replace("-", "_")
    try:
        names = os.listdir(entry)
    except OSError:
        return False
    return any(n.endswith((".dist-info", ".egg-info")) and n.split("-")[0].lower().replace(".", "_") == dist
               for n in names)


def _user_entries() -> set[str]:
    """The sys.path entries a user put there by hand: PYTHONPATH and the working directory (unless -P)."""
    entries = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if not sys.flags.safe_path:
        entries.add(os.getcwd())
    return {os.path.realpath(p) for p in entries}


def _entry_of(origin: str) -> str:
    path = Path(origin)
    return os.path.realpath(path.parent.parent if path.name.startswith("__init__.") else path.parent)


def shadowed_dependency() -> str | None:
    """One line naming a dependency that a stray file (a ``yaml.py`` in a PYTHONPATH directory) replaces.

    Only PYTHONPATH and the working directory are suspects, and only files no installed distribution owns
    there: an install (regular, editable, --user, a site directory of one's own) is never one."""
    suspects = _user_entries()
    for top in DEPENDENCIES:
        origin = _origin(top)
        if origin is not None and _entry_of(origin) in suspects and not _installed_at(origin, top):
            return (f"'{origin}' shadows the Python package '{top}' that nvrx needs: rename it, or take its "
                    f"directory out of PYTHONPATH")
    return None


def describe_import_error(err: ImportError) -> str:
    """One line naming the package that could not be imported and what to do about it."""
    name = (err.name or "").split(".")[0]
    shadow = shadowed_dependency()
    if shadow is not None:
        return shadow
    if name and _origin(name) is None:
        hint = _INSTALL_HINT.get(name, f"pip install {DEPENDENCIES.get(name, name)}")
        return (f"the Python package '{name}' is not installed for {sys.executable} (nvrx needs it): {hint}, "
                f"or run nvrx with the Python that has it")
    return f"importing '{name or err}' failed ({err}); reinstall it: pip install --force-reinstall {name or 'nvrx'}"
