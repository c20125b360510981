"""``Compose``: chain components of one kind (rank assignments, filters, initializers, ...)."""

from __future__ import annotations

import inspect
from typing import Any, Callable


class Compose:
    """``Compose(f, g)(x) == f(g(x))``: the last component runs first, as in function composition.

    So ``Compose(ShiftRanks(), FilterGroupedByKey(...))`` first drops incomplete groups, then closes
    the gaps. A component that returns ``None`` leaves the value unchanged (convenient for aborts,
    finalizers and health checks, which act rather than compute).
    """

    def __init__(self, *components: Callable[[Any], Any]) -> None:
        if not components:
            raise ValueError("Compose() needs at least one component, e.g. Compose(ShiftRanks())")
        for component in components:
            if inspect.isclass(component):  # a class is callable too, but calling it builds, it does not run
                raise ValueError(f"Compose: {component.__name__} is a class; pass an instance: "
                                 f"{component.__name__}()")
            if not callable(component):
                raise ValueError(f"Compose: {component!r} is not callable; pass instances such as ShiftRanks(), "
                                 "not the class or its result")
        self.components = tuple(components)

    def __call__(self, value: Any) -> Any:
        for component in reversed(self.components):
            result = component(value)
            if result is not None:
                value = result
        return value

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.components))})"
