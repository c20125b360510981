"""Every exception class nvrx defines derives from ``nvrx.common.errors.NvrxError``.

One root lets a caller tell "nvrx refused or failed on purpose" from a bug or an OS error. The walk
imports every module of our packages and collects each exception class defined there, so a new
class that forgets the root fails here. The few that must not be caught by ``except Exception``
(and so cannot be an ``NvrxError``) are listed below with the reason.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from pathlib import Path

from nvrx.common.errors import NvrxError

from tests.conftest import package_modules

NOT_NVRX_ERRORS = {
    # raised inside the user's wrapped function to stop it: must pass through the user's `except Exception`
    "nvrx.launcher.rank.inprocess.exceptions.RestartInterrupt",
    # RetryController's "stop restarting": the restart loop retries on Exception, this must end the Wrapper
    "nvrx.launcher.rank.inprocess.exceptions.RetriesExhausted",
    # the entry point cannot run at all: an in-process Wrapper around the script must end on it, not retry
    "nvrx.launcher.rank.bootstrap._NotRunnable",
}


def module_names() -> list[str]:
    # nvrx.__main__ runs the CLI when imported: it is the program, not a module
    return [name for name, _ in package_modules() if name != "nvrx.__main__"]


def _classes_in(owner: object, module: str) -> list[type]:
    """Classes defined in MODULE found in OWNER's namespace, nested class bodies included."""
    found = []
    for obj in vars(owner).values():
        if inspect.isclass(obj) and obj.__module__ == module and obj is not owner:
            found.append(obj)
            found += _classes_in(obj, module)
    return found


def exception_classes() -> dict[str, type]:
    out: dict[str, type] = {}
    for name in module_names():
        module = importlib.import_module(name)
        for cls in _classes_in(module, name):
            if issubclass(cls, BaseException):
                out[f"{name}.{cls.__qualname__}"] = cls
    return out


def test_every_exception_class_derives_from_nvrx_error():
    found = exception_classes()
    rootless = sorted(name for name, cls in found.items()
                      if not issubclass(cls, NvrxError) and name not in NOT_NVRX_ERRORS)
    assert rootless == [], "derive these from nvrx.common.errors.NvrxError (or list them, with the reason)"


def test_the_allow_list_is_current():
    found = exception_classes()
    stale = sorted(name for name in NOT_NVRX_ERRORS if name not in found or issubclass(found[name], NvrxError))
    assert stale == [], "no longer defined, or now an NvrxError: drop from NOT_NVRX_ERRORS"


def test_the_walk_finds_the_classes_of_every_package():
    found = exception_classes()
    for name in ("nvrx.ckpt.errors.CheckpointCleanupError", "nvrx.launcher.agent.rdzv_errors.PortInUse",
                 "nvrx.launcher.rank.inprocess.exceptions.ConfigurationError", "nvrx.monitors.control.MonitorProtocolError",
                 "nvrx.slurm.submit.SubmitError", "nvrx.nvrx_cli.resume_cmd.ResumeFailure", "nvrx.common.errors.ConfigError"):
        assert name in found
    assert len(found) >= 30


def test_existing_except_clauses_still_catch_them():
    """The root was added beside the old bases, never instead of them."""
    from nvrx.ckpt.errors import CheckpointError
    from nvrx.launcher.agent.rdzv_errors import RendezvousError
    from nvrx.launcher.rank.inprocess.exceptions import ConfigurationError, RestartInterrupt
    from nvrx.launcher.resume.state import CorruptState
    from nvrx.monitors.heartbeat import SlotError
    from nvrx.slurm.environment import SlurmEnvError

    assert issubclass(CheckpointError, RuntimeError) and issubclass(RendezvousError, RuntimeError)
    assert issubclass(SlotError, RuntimeError)
    assert all(issubclass(c, ValueError) for c in (ConfigurationError, CorruptState, SlurmEnvError))
    assert not issubclass(RestartInterrupt, Exception)


def test_no_exception_class_hides_inside_a_function():
    """The import walk sees module- and class-level classes only; one defined in a function would escape it."""
    exception_names = {name for name, obj in vars(builtins).items()
                       if inspect.isclass(obj) and issubclass(obj, BaseException)}
    exception_names |= {name.rsplit(".", 1)[-1] for name in exception_classes()}
    hidden = []
    for name, path in package_modules():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ClassDef) and any(
                        ast.unparse(b).rsplit(".", 1)[-1] in exception_names for b in node.bases):
                    hidden.append(f"{name}:{node.lineno} {node.name}")
    assert hidden == []
