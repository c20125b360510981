"""``Wrapper``: restart a function inside the live process when any rank of the job fails.

    @inprocess.Wrapper(soft_timeout=30, hard_timeout=60)
    def train(call_wrapper: inprocess.CallWrapper = None):
        torch.distributed.init_process_group("gloo")
        ...

Every argument is checked when the Wrapper is built: a bad value raises ``ValueError`` before any
thread or process is started. Durations are seconds (int or float) or ``datetime.timedelta``; timeouts
may be at most a week, the three ``*_interval`` periods between 1 ms and an hour, ``last_call_wait``
at most an hour. Defaults (seconds):

=========================== ======= ================================================================
monitor_thread_interval       0.1   how often the monitor thread reads the store for faults
monitor_process_interval      0.5   how often the monitor process watches the other ranks
heartbeat_interval            =     how often the monitor process beats (default: monitor_process_interval)
progress_watchdog_interval    0.5   how often the automatic heartbeat is requested
last_call_wait                0.1   after the first fault, wait this long for concurrent ones
soft_timeout                 60     no progress this long: restart (a rank stuck again right after is left
                                    to the hard timeout)
hard_timeout                 90     no progress this long: the monitor process terminates the rank
heartbeat_timeout            30     a rank whose monitor process is silent this long is terminated
barrier_timeout             120     initial/iteration/termination barriers
completion_timeout          120     after the first rank finished, how long the others may take
termination_grace_time        5     between SIGTERM and SIGKILL on a hard timeout
=========================== ======= ================================================================

Components are instances (``ShiftRanks()``, not ``ShiftRanks``; ``None`` disables one; a tuple or list
of components means their ``Compose``):
``initialize`` (none), ``abort`` (``AbortTorchDistributed()``),
``finalize`` (none), ``health_check`` (``CudaHealthCheck()``, skipped without CUDA),
``rank_assignment`` (``Compose(ActivateAllRanks(), ShiftRanks())``), ``rank_filter`` (deprecated; none),
``completion`` (none), ``terminate`` (none). The monitoring intervals are shorter than NVRx's 1 s (faster
detection at a negligible cost); every other default is NVRx's.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import logging
import math
import os
import threading
from typing import Any, Callable, Union

import warnings

from nvrx.launcher.rank.inprocess.abort import AbortTorchDistributed
from nvrx.launcher.rank.inprocess.call_wrapper import wants_call_wrapper
from nvrx.launcher.rank.inprocess.compose import Compose
from nvrx.launcher.rank.inprocess.health_check import CudaHealthCheck
from nvrx.launcher.rank.inprocess.log_setup import setup_rank_logging
from nvrx.launcher.rank.inprocess.exceptions import ArgumentTypeError
from nvrx.launcher.rank.inprocess.rank_assignment import ActivateAllRanks, ShiftRanks
from nvrx.launcher.rank.inprocess.session import RestartSession, active_session
from nvrx.launcher.rank.inprocess.settings import RestartSettings
from nvrx.launcher.rank.inprocess.store import StoreMixin, TCPStore, encode_kwargs, unreachable_class

log = logging.getLogger(__name__)

_DEFAULT = object()
Seconds = Union[float, datetime.timedelta]  # every duration parameter takes either


MIN_INTERVAL = 0.001  # monitoring intervals: anything shorter is a busy loop hammering the store
MAX_INTERVAL = 3600.0  # ... and anything longer leaves faults unnoticed for over an hour
MAX_TIMEOUT = 7 * 24 * 3600.0  # timeouts: a week; beyond that a value is a unit mistake (ms for s, ...)


def _seconds(value: Any, name: str, allow_zero: bool = False, upper: float = MAX_TIMEOUT) -> float:
    """VALUE as seconds: a number or a ``datetime.timedelta`` (the spec's examples use both), finite,
    positive (or zero when ALLOW_ZERO) and at most UPPER, else a ValueError naming NAME."""
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"Wrapper: {name} must be a number of seconds or a datetime.timedelta, not {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"Wrapper: {name} must be a number of seconds or a datetime.timedelta, not {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"Wrapper: {name} must be {'>= 0' if allow_zero else '> 0'} seconds, not {value!r}")
    if value > upper:
        raise ValueError(f"Wrapper: {name} must be at most {upper:g} seconds, not {value!r}")
    return float(value)


def _interval(value: Any, name: str) -> float:
    """A monitoring loop's period: between MIN_INTERVAL and MAX_INTERVAL seconds."""
    seconds = _seconds(value, name, upper=MAX_INTERVAL)
    if seconds < MIN_INTERVAL:
        raise ValueError(f"Wrapper: {name} must be at least {MIN_INTERVAL:g} seconds (a shorter period is a busy "
                         f"loop), not {value!r}")
    return seconds


def _component(value: Any, name: str) -> Any:
    if isinstance(value, (tuple, list)):  # a sequence of components means their composition
        try:
            value = Compose(*value)
        except ValueError as exc:
            raise ValueError(f"Wrapper: {name}: {exc}") from None
    if inspect.isclass(value):  # calling a class would build a component per call, not run one
        raise ValueError(f"Wrapper: {name} must be a component instance, not the class {value.__name__}; "
                         f"pass an instance: {value.__name__}()")
    if value is not None and not callable(value):
        raise ArgumentTypeError(f"Wrapper: {name} must be callable (an instance such as {name}=Compose(...)) or None, "
                         f"not {value!r}")
    return value


def _store_factory(factory: Any) -> Callable[..., StoreMixin]:
    if not callable(factory):
        raise ValueError(f"Wrapper: store_factory must be a store class (subclassing StoreMixin), not {factory!r}")
    if inspect.isclass(factory) and not issubclass(factory, StoreMixin):
        raise ValueError(f"Wrapper: store_factory {factory.__name__} does not subclass "
                         "launcher.rank.inprocess.store.StoreMixin; custom stores must")
    if inspect.isclass(factory) and unreachable_class(factory):
        raise ValueError(f"Wrapper: store_factory: {unreachable_class(factory)}")
    return factory


def _store_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ArgumentTypeError(f"Wrapper: store_kwargs must be a dict of keyword arguments, not {kwargs!r}")
    try:
        json.dumps(encode_kwargs(kwargs))
    except (TypeError, ValueError):
        raise ValueError("Wrapper: store_kwargs must be JSON-serialisable or timedeltas (the monitor process opens its own "
                         f"connection from them), got {kwargs!r}") from None
    return dict(kwargs)


def _logfile(template: Any, name: str = "monitor_process_logfile") -> str | None:
    if template is None:
        return None
    if not isinstance(template, str) or not template:
        raise ArgumentTypeError(f"Wrapper: {name} must be a path string (may contain {{rank}}), not {template!r}")
    if name == "monitor_process_pidfile" and not os.path.isabs(template):
        raise ValueError(f"Wrapper: {name} must be an absolute path, not {template!r}")
    try:
        template.format(rank=0)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"Wrapper: {name} {template!r}: only the {{rank}} placeholder is allowed "
                         f"({exc})") from None
    return template


class Wrapper:
    """Decorator that runs a function under in-process restart (see the module docstring)."""

    def __init__(
        self,
        *,
        store_factory: Callable[..., StoreMixin] = TCPStore,
        store_kwargs: dict[str, Any] | None = None,
        initialize: Callable[..., Any] | None = None,
        abort: Callable[..., Any] | None = _DEFAULT,  # type: ignore[assignment]
        finalize: Callable[..., Any] | None = None,
        health_check: Callable[..., Any] | None = _DEFAULT,  # type: ignore[assignment]
        rank_assignment: Callable[..., Any] = _DEFAULT,  # type: ignore[assignment]
        rank_filter: Callable[..., Any] | None = None,
        monitor_thread_interval: Seconds = 0.1,
        monitor_process_interval: Seconds = 0.5,
        heartbeat_interval: Seconds | None = None,
        progress_watchdog_interval: Seconds = 0.5,
        soft_timeout: Seconds = 60.0,
        hard_timeout: Seconds = 90.0,
        heartbeat_timeout: Seconds = 30.0,
        barrier_timeout: Seconds = 120.0,
        completion_timeout: Seconds = 120.0,
        last_call_wait: Seconds = 0.1,
        termination_grace_time: Seconds = 5.0,
        monitor_process_logfile: str | None = None,
        monitor_process_pidfile: str | None = None,
        enabled: bool = True,
        completion: Callable[..., Any] | None = None,
        terminate: Callable[..., Any] | None = None,
    ) -> None:
        """NVRx's arguments, keyword-only, in NVRx's order (see the module docstring for the defaults).

        ``heartbeat_interval`` (default: ``monitor_process_interval``) is how often the monitor process
        beats in the store; ``monitor_process_pidfile`` (absolute, may contain ``{rank}``) receives the
        monitor process's pid while it runs; ``completion`` runs on a rank whose call succeeded (its
        exceptions are logged), ``terminate`` on a rank the Wrapper ends with an exception.
        """
        if rank_assignment is None:
            raise ValueError("Wrapper: rank_assignment cannot be None; the default is "
                             "Compose(ActivateAllRanks(), ShiftRanks())")
        if rank_filter is not None:
            warnings.warn("Wrapper(rank_filter=...) is deprecated (as in NVRx): use rank_assignment, e.g. "
                          "Compose(MaxActiveWorldSize(n), ShiftRanks())", DeprecationWarning, stacklevel=2)
        self.settings = RestartSettings(
            store_factory=_store_factory(store_factory),
            store_kwargs=_store_kwargs(store_kwargs),
            initialize=_component(initialize, "initialize"),
            abort=_component(AbortTorchDistributed() if abort is _DEFAULT else abort, "abort"),
            finalize=_component(finalize, "finalize"),
            health_check=_component(CudaHealthCheck() if health_check is _DEFAULT else health_check, "health_check"),
            rank_assignment=_component(Compose(ActivateAllRanks(), ShiftRanks()) if rank_assignment is _DEFAULT
                                       else rank_assignment, "rank_assignment"),
            rank_filter=_component(rank_filter, "rank_filter"),
            monitor_thread_interval=_interval(monitor_thread_interval, "monitor_thread_interval"),
            monitor_process_interval=_interval(monitor_process_interval, "monitor_process_interval"),
            heartbeat_interval=_interval(monitor_process_interval if heartbeat_interval is None
                                         else heartbeat_interval, "heartbeat_interval"),
            progress_watchdog_interval=_interval(progress_watchdog_interval, "progress_watchdog_interval"),
            monitor_process_logfile=_logfile(monitor_process_logfile),
            monitor_process_pidfile=_logfile(monitor_process_pidfile, "monitor_process_pidfile"),
            last_call_wait=_seconds(last_call_wait, "last_call_wait", allow_zero=True, upper=MAX_INTERVAL),
            soft_timeout=_seconds(soft_timeout, "soft_timeout"),
            hard_timeout=_seconds(hard_timeout, "hard_timeout"),
            heartbeat_timeout=_seconds(heartbeat_timeout, "heartbeat_timeout"),
            barrier_timeout=_seconds(barrier_timeout, "barrier_timeout"),
            completion_timeout=_seconds(completion_timeout, "completion_timeout"),
            termination_grace_time=_seconds(termination_grace_time, "termination_grace_time", allow_zero=True),
            completion=_component(completion, "completion"),
            terminate=_component(terminate, "terminate"),
        )
        if not isinstance(enabled, bool):
            raise ArgumentTypeError(f"Wrapper: enabled must be True or False, not {enabled!r}")
        self.enabled = enabled
        # Set by nvrx launch --inprocess on the Wrapper it runs the script in: a Wrapper the script applies
        # itself then runs its own session inside this one (RestartSession.defer) instead of only calling its
        # function.
        self._yields_to_script_wrapper = False
        _check_relations(self.settings)

    def __getattr__(self, name: str) -> Any:
        """``wrapper.soft_timeout`` and the like: the checked value of each argument (read-only)."""
        settings = self.__dict__.get("settings")
        if settings is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(settings, name)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise ValueError(f"Wrapper: can only wrap a function, not {fn!r}")
        kind = _unsupported_kind(fn)
        if kind:
            raise ValueError(f"Wrapper: cannot wrap {getattr(fn, '__qualname__', fn)!r}, it is {kind}; the Wrapper "
                             "restarts a plain function, so wrap a function that runs the loop to completion")
        if not self.enabled:
            return fn  # as NVRx: a disabled Wrapper is no decorator at all
        param = wants_call_wrapper(fn)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            outer = active_session()
            if outer is not None:
                if outer.yields_to_script_wrapper:
                    # nvrx launch --inprocess runs the script; the script's own Wrapper is the user's intent
                    return outer.defer(RestartSession(self.settings, fn, param, args, kwargs, parent=outer).run)
                _warn_nested(fn)
                if param is not None and param not in kwargs:
                    kwargs = {**kwargs, param: outer.call_wrapper}
                return fn(*args, **kwargs)
            setup_rank_logging()
            return RestartSession(self.settings, fn, param, args, kwargs,
                                  yields_to_script_wrapper=self._yields_to_script_wrapper).run()

        return wrapped


def _check_relations(s: RestartSettings) -> None:
    """Settings that are each valid but contradict each other."""
    if s.hard_timeout < s.soft_timeout:
        raise ValueError(f"Wrapper: hard_timeout ({s.hard_timeout:g} s) must not be shorter than soft_timeout "
                         f"({s.soft_timeout:g} s): the hard timeout is the last resort after a soft one")
    if s.soft_timeout <= s.progress_watchdog_interval:
        raise ValueError(f"Wrapper: soft_timeout ({s.soft_timeout:g} s) must be longer than "
                         f"progress_watchdog_interval ({s.progress_watchdog_interval:g} s), or every rank times out")
    if s.heartbeat_timeout <= s.heartbeat_interval:
        raise ValueError(f"Wrapper: heartbeat_timeout ({s.heartbeat_timeout:g} s) must be longer than "
                         f"heartbeat_interval ({s.heartbeat_interval:g} s)")
    if s.heartbeat_timeout <= s.monitor_process_interval:
        raise ValueError(f"Wrapper: heartbeat_timeout ({s.heartbeat_timeout:g} s) must be longer than "
                         f"monitor_process_interval ({s.monitor_process_interval:g} s)")


def _unsupported_kind(fn: Callable[..., Any]) -> str | None:
    target = inspect.unwrap(fn) if hasattr(fn, "__wrapped__") else fn
    if inspect.isasyncgenfunction(target):
        return "an async generator function"
    if inspect.iscoroutinefunction(target):
        return "an async function"
    if inspect.isgeneratorfunction(target):
        return "a generator function"
    return None


_nested_warned = threading.Event()


def _warn_nested(fn: Callable[..., Any]) -> None:
    if not _nested_warned.is_set():
        _nested_warned.set()
        log.warning("%s is wrapped again inside a running Wrapper; the outer Wrapper restarts it and this one only "
                    "calls it (its settings are not used)", getattr(fn, "__qualname__", fn))
