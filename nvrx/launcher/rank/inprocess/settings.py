"""The checked settings of an in-process restart ``Wrapper``: what one ``RestartSession`` runs with.

A module of its own so that the restart loop (``session.py``) reads its settings without importing
the decorator that creates it (``wrapper.py``): wrapper -> session -> settings, never back.
The checks of the user's arguments stay in ``wrapper.py`` (they are the Wrapper's contract);
a ``RestartSettings`` only ever holds values that passed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from nvrx.launcher.rank.inprocess.store import StoreMixin


@dataclass(frozen=True, eq=False)
class RestartSettings:
    """The Wrapper's arguments after checking: components as callables (or None), durations as seconds."""

    store_factory: Callable[..., StoreMixin]
    store_kwargs: dict[str, Any]
    initialize: Callable[..., Any] | None
    abort: Callable[..., Any] | None
    finalize: Callable[..., Any] | None
    health_check: Callable[..., Any] | None
    rank_assignment: Callable[..., Any]
    rank_filter: Callable[..., Any] | None
    monitor_thread_interval: float
    monitor_process_interval: float
    heartbeat_interval: float
    progress_watchdog_interval: float
    monitor_process_logfile: str | None
    monitor_process_pidfile: str | None
    last_call_wait: float
    soft_timeout: float
    hard_timeout: float
    heartbeat_timeout: float
    barrier_timeout: float
    completion_timeout: float
    termination_grace_time: float
    completion: Callable[..., Any] | None = None
    terminate: Callable[..., Any] | None = None
