"""Say in one line why an import failed: a package that is missing, or a user's file that shadows it.

Only the standard library here: it runs when nvrx's own dependencies may be what failed to import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig

# What to install for each third-party package nvrx needs (torch: the build must be chosen by the user).
_INSTALL_HINT = {
    "torch": "pip install torch (pick the build for your machine first, e.g. torch==2.13.0 for the CPU)",
    "yaml": "pip install pyyaml",
}


def _installed_roots() -> list[str]:
    paths = sysconfig.get_paths()
    return [os.path.realpath(p) for p in {paths.get("purelib"), paths.get("platlib")} if p]


def _origin(top: str) -> str | None:
    """Where TOP would be imported from now, or None when it is not importable at all."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return spec.origin
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else None


def describe_import_error(err: ImportError) -> str:
    """One line naming the package that could not be imported and what to do about it."""
    name = (err.name or "").split(".")[0] or str(err)
    origin = _origin(name)
    if origin is None:
        hint = _INSTALL_HINT.get(name, f"pip install {name}")
        return (f"the Python package '{name}' is not installed for {sys.executable} "
                f"(nvrx needs it): {hint}, or run nvrx with the Python that has it")
    real = os.path.realpath(origin)
    if not any(real.startswith(root + os.sep) for root in _installed_roots()):
        return (f"'{origin}' shadows the Python package '{name}' that nvrx needs: rename it, or take its "
                f"directory out of PYTHONPATH / the current directory")
    return f"importing '{name}' failed ({err}); reinstall it: pip install --force-reinstall {name}"
