"""``Terminate``: runs on a rank the Wrapper ends with an exception (retries exhausted, rank removed, ...),
before that exception leaves the call (``Wrapper(terminate=)``).

An exception it raises replaces the original one, which becomes its ``__cause__``.
"""

from __future__ import annotations

import abc

from nvrx.launcher.rank.inprocess.state import FrozenState


class Terminate(abc.ABC):
    """Base class: ``__call__(state) -> state``; receives a ``FrozenState``."""

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:  # type: ignore[valid-type]
        raise NotImplementedError
