"""``RerunErrorInjector``: make the machine see a rejected result on purpose, and steer what its re-runs find.

Megatron-Core's class of the same name and arguments (``error_injection_rate``, ``error_injection_type``),
so a job can rehearse each diagnosis end to end (checkpoint, exit 16, resume elsewhere, verdict) without a
faulty GPU:

* ``transient_error``: the in-place re-run "differs" -> transient, training goes on;
* ``persistent_error``: the in-place re-run matches, the re-run on other hardware differs -> persistent;
* ``correct_result``: both re-runs match -> correct result (exit 17 when the validation is fatal).

Unlike Megatron's (the global ``random`` module, which would move the job's own random stream), the choice
is deterministic and draws no random numbers: rank R injects at its K-th checked validation when
``(K + R) % rate == 0``, so rate 1 injects at the first validation of every rank and rate N once every N
validations, spread over the ranks. One injection at a time: the next waits until its diagnosis is made.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from nvrx.launcher.rank.rerun.modes import RerunDiagnostic, RerunError, RerunState

log = logging.getLogger("nvrx.launcher.rank.rerun")

COMPARISON_MATCH: float = 0.0          # what a comparison returns for "reproduced"
COMPARISON_MISMATCH: float = math.inf  # ... and for "not reproduced"


class RerunErrorInjector:
    """Inject rejected results at ERROR_INJECTION_RATE (0: never) of type ERROR_INJECTION_TYPE."""

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic | str = RerunDiagnostic.TRANSIENT_ERROR) -> None:
        if isinstance(error_injection_rate, bool) or not isinstance(error_injection_rate, int) \
                or error_injection_rate < 0:
            raise RerunError(f"error_injection_rate must be an integer >= 0 (0: no injection), not "
                             f"{error_injection_rate!r}")
        try:
            kind = RerunDiagnostic(error_injection_type)
        except ValueError:
            valid = ", ".join(d.value for d in RerunDiagnostic)
            raise RerunError(f"unknown error_injection_type {error_injection_type!r}: use one of {valid}") from None
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = kind
        self.should_inject_errors = error_injection_rate > 0
        self.injected_error_type: RerunDiagnostic | None = None  # set while an injected result is being diagnosed
        self.checked = 0                                          # validations seen in initial runs
        self.rank = 0                                             # set by the machine

    def maybe_inject(self) -> bool:
        """At a validation of an initial run: inject now? (then the result counts as rejected)."""
        if not self.should_inject_errors or self.injected_error_type is not None:
            return False
        self.checked += 1
        if (self.checked + self.rank) % self.error_injection_rate:
            return False
        self.injected_error_type = self.error_injection_type
        log.warning("rank %d: injecting a rejected result (%s)", self.rank, self.error_injection_type.value)
        return True

    def maybe_miscompare(self, comparison_func: Callable[[Any, Any], float], initial_result: Any, result: Any,
                         state: RerunState) -> float:
        """The comparison of a re-run's result with the rejected one: COMPARISON_FUNC's, unless an injected
        result is being diagnosed; then what the injected type needs at this re-run (STATE)."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state is RerunState.RERUNNING_IN_PLACE:
            if injected is RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        if state is RerunState.RERUNNING_FROM_CHECKPOINT:
            self.injected_error_type = None
            return COMPARISON_MISMATCH if injected is RerunDiagnostic.PERSISTENT_ERROR else COMPARISON_MATCH
        raise RerunError(f"maybe_miscompare is for re-runs, not for state {state.value}")

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: an injection being diagnosed crosses the job boundary with the machine."""
        return {"error_injection_rate": self.error_injection_rate,
                "error_injection_type": self.error_injection_type.value,
                "injected_error_type": self.injected_error_type.value if self.injected_error_type else None,
                "checked": self.checked}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.error_injection_rate = int(state["error_injection_rate"])
        self.error_injection_type = RerunDiagnostic(state["error_injection_type"])
        self.should_inject_errors = self.error_injection_rate > 0
        injected = state.get("injected_error_type")
        self.injected_error_type = RerunDiagnostic(injected) if injected else None
        self.checked = int(state.get("checked", 0))
