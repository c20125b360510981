"""``Compose``: chain components of one kind (rank assignments, initializers, health checks, ...)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

_classes: dict[type, type] = {}


def _takes_arguments(fn: Callable[..., Any]) -> bool:
    try:
        return bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return True


def _common_base(instances: tuple[Any, ...]) -> type:
    """The most specific class every instance is an instance of (ignoring Compose itself), e.g. RankAssignment."""
    for cls in type(instances[0]).__mro__:
        if cls is object or issubclass(cls, Compose):
            continue
        if all(isinstance(i, cls) for i in instances):
            return cls
    return object


def _composed_class(base: type) -> type:
    """``DynamicCompose(Compose, BASE)``, made once per base: so ``Compose(a, b)`` passes isinstance checks for
    BASE (the Wrapper's, the user's) exactly as NVRx's does."""
    if base is object:
        return Compose
    if base not in _classes:
        try:
            _classes[base] = type(base)("DynamicCompose", (Compose, base), {"__module__": __name__})
        except TypeError:  # plain functions, builtins: no class to share
            _classes[base] = Compose
    return _classes[base]


class Compose:
    """``Compose(f, g)(x) == f(g(x))``: the last component runs first, as in function composition.

    So ``Compose(ShiftRanks(), FilterCountGroupedByKey(...))`` first drops incomplete groups, then closes
    the gaps. The result is an instance of the components' common base class (``Compose(ActivateAllRanks(),
    ShiftRanks())`` is a ``RankAssignment``). A component returning a tuple passes it on as the next one's
    arguments; a component that returns ``None`` leaves its input unchanged (convenient for aborts,
    finalizers and health checks, which act rather than compute; NVRx passes the ``None`` on, with a warning).
    """

    instances: tuple[Callable[..., Any], ...] = ()

    def __new__(cls, *instances: Callable[..., Any]) -> "Compose":
        _check(instances)
        return object.__new__(_composed_class(_common_base(instances)) if cls is Compose else cls)

    def __init__(self, *instances: Callable[..., Any]) -> None:
        self.instances = tuple(instances)

    @property
    def components(self) -> tuple[Callable[..., Any], ...]:
        """The composed instances (our earlier name for ``instances``)."""
        return self.instances

    def __call__(self, *args: Any) -> Any:
        result: Any = args[0] if len(args) == 1 else (args or None)
        for index in range(len(self.instances) - 1, -1, -1):
            ret = self.instances[index](*args)
            if ret is None and any(a is not None for a in args):
                continue  # acted, computed nothing: the input goes on unchanged
            result = ret
            following = self.instances[index - 1] if index else None
            if isinstance(ret, tuple):
                args = ret
            elif following is None or _takes_arguments(following):
                args = (ret,)
            else:
                args = ()
        return result

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.instances))})"


def _check(instances: tuple[Any, ...]) -> None:
    if not instances:
        raise ValueError("Compose() needs at least one component, e.g. Compose(ShiftRanks())")
    for component in instances:
        if inspect.isclass(component):  # a class is callable too, but calling it builds, it does not run
            raise ValueError(f"Compose: {component.__name__} is a class; pass an instance: {component.__name__}()")
        if not callable(component):
            raise ValueError(f"Compose: {component!r} is not callable; pass instances such as ShiftRanks(), "
                             "not the class or its result")
