"""Lazy package exports: a package names its public objects without importing the modules behind them.

Importing ``nvrx.ckpt`` (or ``nvrx.ckpt.local``) must stay cheap for a rank that only sends heartbeats; the heavy
modules (torch.distributed.checkpoint, the writer) load on first use of a name.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for PACKAGE: EXPORTS maps a name to the module that defines it; the value is
    imported on first access and cached in NAMESPACE (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
