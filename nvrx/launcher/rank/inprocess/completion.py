"""``Completion``: runs on a rank whose wrapped call succeeded, before the call returns (``Wrapper(completion=)``).

Its exceptions are logged and do not change the call's result (the work is done).
"""

from __future__ import annotations

import abc

from nvrx.launcher.rank.inprocess.state import FrozenState


class Completion(abc.ABC):
    """Base class: ``__call__(state) -> state``; receives a ``FrozenState``."""

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:  # type: ignore[valid-type]
        raise NotImplementedError
