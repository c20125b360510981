"""Find Lightning's ``Callback`` base class: ``lightning`` first, then the older ``pytorch_lightning``.

Lightning's Trainer calls callback hooks by name, so a callback built on one package's base class also
runs under the other package's Trainer; the base class only has to exist. ``NVRX_LIGHTNING_PACKAGE``
(``lightning`` or ``pytorch_lightning``) picks one when both are installed and the import order matters
to the user (e.g. ``isinstance`` checks in their own code).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

INSTALL_HINT = "the Lightning callbacks need Lightning: pip install 'nvrx[lightning]'"
PACKAGES = ("lightning", "pytorch_lightning")
ENV_PACKAGE = "NVRX_LIGHTNING_PACKAGE"


def _callback_base() -> tuple[Any, str]:
    wanted = os.environ.get(ENV_PACKAGE, "").strip()
    if wanted and wanted not in PACKAGES:
        raise ImportError(f"{ENV_PACKAGE}={wanted!r}: expected one of {', '.join(PACKAGES)}")
    for name in ((wanted,) if wanted else PACKAGES):
        module = f"{name}.pytorch.callbacks" if name == "lightning" else f"{name}.callbacks"
        try:
            return importlib.import_module(module).Callback, name
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != name:
                raise  # Lightning is installed but broken: show the real cause
    raise ImportError(INSTALL_HINT) from None


Callback, flavor = _callback_base()
