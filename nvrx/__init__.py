"""nvrx: launch and supervise PyTorch training jobs through crashes, hangs, preemptions and bad hardware.

The public surface, importable without loading torch until a name is used::

    from nvrx import inprocess            # in-process restart (NVRx's nvidia_resiliency_ext.inprocess)
    from nvrx import ckpt                 # checkpoints: PeriodicCheckpointer, async_save, ckpt.local, ...
    from nvrx import fault_tolerance      # RankMonitorClient, FaultToleranceConfig, ... (also nvrx.monitors)
    from nvrx import straggler, rerun, ptl_resiliency

Everything nvrx installs lives under this one package; the command-line tool is ``nvrx`` (``python -m nvrx``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# short public name -> the module that implements it (imported on first use)
_PUBLIC = {
    "inprocess": "nvrx.launcher.rank.inprocess",
    "straggler": "nvrx.launcher.rank.straggler",
    "rerun": "nvrx.launcher.rank.rerun",
    "ptl_resiliency": "nvrx.launcher.rank.ptl_resiliency",
    "fault_tolerance": "nvrx.monitors",
    "job_control": "nvrx.launcher.rank.job_control",
}

__all__ = ["__version__", "ckpt", "monitors", *_PUBLIC]


def __getattr__(name: str) -> Any:
    target = _PUBLIC.get(name)
    if target is None:
        raise AttributeError(f"module 'nvrx' has no attribute {name!r}")
    module = importlib.import_module(target)
    globals()[name] = module
    return module
