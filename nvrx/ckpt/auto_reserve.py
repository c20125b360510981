"""Reserve staging memory after the first optimizer step, so that a first save nobody announced is warm.

Users of the plain API (``nvrx.ckpt.async_save`` / ``AsyncCheckpointer.async_save``, Megatron style) never call
``prepare``: their first save had to get new shared memory from the kernel while training waited (2-3x a
warm save, bench/README.md). After an optimizer's first step its parameters and state tensors exist at their
final sizes, and a checkpoint of the model and the optimizer holds about that much. A global optimizer
step post-hook (torch's ``register_optimizer_step_post_hook``) adds each optimizer's size at its first step and
reserves that total (``StagingPool.reserve``: the pages are faulted in on a thread); a second step of an
optimizer already counted means every optimizer of the loop has stepped: the hook is done.

Armed only where asynchronous checkpointing is in use: by ``AsyncCheckpointer`` (``reserve_after_first_step``)
and by the rank bootstrap for ``nvrx launch --async-ckpt``. This module does not import torch: when
``torch.optim`` is not loaded yet, the hook is registered right after it is (an import watch that removes
itself and leaves no trace on the module).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
import weakref
from typing import Any

from nvrx.ckpt.async_ckpt.staging import align, default_pool

log = logging.getLogger("nvrx.ckpt.auto_reserve")

_OPTIM_MODULE = "torch.optim.optimizer"
# Slack over the optimizer's tensors: what else a model + optimizer checkpoint holds. Non-tensor items
# (param_groups, RNG states, counters, a saved argument namespace) serialise to KBs up to ~1 MiB for 100k
# parameters (a parameter index pickles to a few bytes); model buffers (BatchNorm statistics; transformers
# have none) are below 1% of the parameters (ResNet-50: 0.2%), and with Adam below 0.3% of the counted
# bytes (parameters + two moments). So 4 MiB + 1/64 (1.6%) of the counted bytes; a save that needs more
# still works, it just takes a new buffer as it did before.
SLACK_BYTES = 4 << 20
SLACK_FRACTION = 64


def slack(nbytes: int) -> int:
    return SLACK_BYTES + nbytes // SLACK_FRACTION


def tensor_bytes(t: Any) -> int:
    """Staging bytes of one tensor as a save stages it: this rank's part (DTensor / ShardedTensor local shards)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if hasattr(local, "local_shards"):
        return sum(align(s.tensor.numel() * s.tensor.element_size()) for s in local.local_shards())
    return align(local.numel() * local.element_size())


def optimizer_bytes(optimizer: Any) -> int:
    """Staging bytes of OPTIMIZER's parameters and state tensors (any device: all are staged in host memory)."""
    import torch

    total, seen = 0, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                total += tensor_bytes(p)
    for per_param in optimizer.state.values():
        for value in (per_param.values() if isinstance(per_param, dict) else ()):
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                total += tensor_bytes(value)
    return total


class _Reserver:
    """The post-step hook. After an optimizer's first step it costs one weak-set lookup, after ``done`` a flag test.

    (torch iterates its hook dict while calling the hooks, so a hook cannot remove itself: ``settle`` removes it
    later, from the thread that steps, outside a step.)
    """

    def __init__(self) -> None:
        self.seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self.counted = 0  # the optimizers' tensors, bytes
        self.reserved = 0  # bytes asked of the pool (counted + slack)
        self.done = False
        self.handle: Any = None
        self.thread: int | None = None  # the thread that steps (the one that may remove the hook)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.done:
            return
        if optimizer in self.seen:  # a second step: every optimizer of the loop has stepped once
            self.done = True
            return
        self.thread = threading.get_ident()
        try:
            if not self.reserved and default_pool().buffers:  # prepare / resume / a save came first: it knows better
                self.done = True
                log.debug("staging memory already reserved or used: no reservation after the first step")
                return
            self.seen.add(optimizer)
            nbytes = optimizer_bytes(optimizer)
            self.counted += nbytes
            self.reserved = self.counted + slack(self.counted)
            created = default_pool().reserve(self.reserved)
        except Exception as exc:  # noqa: BLE001 - a speed-up only: never break the training step
            self.done = True
            log.warning("cannot reserve staging memory after the first optimizer step (%s); the first save "
                        "allocates it instead", exc)
            return
        if created:
            log.info("reserved %.1f MiB of checkpoint staging memory after the first step of %s (parameters + state "
                     "%.1f MiB, slack %.1f MiB), faulted in on a background thread: the first save will be warm",
                     self.reserved / 2**20, type(optimizer).__name__, self.counted / 2**20,
                     (self.reserved - self.counted) / 2**20)
        else:
            log.debug("staging memory of %d bytes was already reserved", self.reserved)


_lock = threading.Lock()
_reserver: _Reserver | None = None  # armed in this process (once)
_watch: _OptimizerImportWatch | None = None


def arm() -> None:
    """Arm the reservation once per process: now if ``torch.optim`` is loaded, else right after it is imported."""
    global _reserver, _watch
    with _lock:
        if _reserver is not None:
            return
        _reserver = _Reserver()
        module = sys.modules.get(_OPTIM_MODULE)
        if module is not None and hasattr(module, "register_optimizer_step_post_hook"):
            _register(module)
        elif _watch is None:
            _watch = _OptimizerImportWatch()
            sys.meta_path.insert(0, _watch)


def disarm() -> None:
    """No reservation after the first step in this process: a caller that reserves staging itself says so (e.g.
    ``PeriodicCheckpointer``, at its first ``step``), also when the bootstrap armed it for ``--async-ckpt``."""
    global _reserver, _watch
    with _lock:
        if _reserver is None:
            _reserver = _Reserver()  # (a later arm() is then a no-op)
        _reserver.done = True
        if _watch is not None and _watch in sys.meta_path:
            sys.meta_path.remove(_watch)
        _watch = None
    settle()


def _register(module: Any) -> None:
    if _reserver is not None and _reserver.handle is None:
        _reserver.handle = module.register_optimizer_step_post_hook(_reserver)


def settle() -> None:
    """A save is starting: the hook has no more use (the pool holds what the first save takes). Remove it when that
    is safe: called from the thread that steps, which is not inside a step now."""
    reserver = _reserver
    if reserver is None or reserver.handle is None:
        return
    reserver.done = True
    if reserver.thread in (None, threading.get_ident()):
        if reserver.thread is None and threading.active_count() > 1:
            return  # no step seen yet, and another thread might be stepping right now: leave the (inert) hook
        reserver.handle.remove()
        reserver.handle = None
        log.debug("first-step staging reservation hook removed")


def status() -> dict[str, Any]:
    """What this process armed and reserved (for tests and logs)."""
    r = _reserver
    return {"armed": r is not None, "registered": r is not None and r.handle is not None,
            "done": bool(r and r.done), "counted": r.counted if r else 0, "reserved": r.reserved if r else 0,
            "watching_import": _watch is not None and _watch in sys.meta_path}


class _OptimizerImportWatch(importlib.abc.MetaPathFinder):
    """Registers the hook right after ``torch.optim.optimizer`` is executed, then steps out of the import system."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        global _watch
        if name != _OPTIM_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _watch = None
        spec = None
        for finder in list(sys.meta_path):  # (the import system's own loop skips one finder after the removal)
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterExec(spec.loader)
        return spec


class _RegisterAfterExec(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module (nothing of ours stays visible), registers the hook."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec) if hasattr(self.loader, "create_module") else None

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        try:
            _register(module)
        except Exception as exc:  # noqa: BLE001 - a speed-up only
            log.debug("cannot register the first-step staging reservation: %s", exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
