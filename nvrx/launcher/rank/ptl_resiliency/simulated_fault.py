"""Simulated rank faults, so users can check that their setup detects and recovers from them.

A fault is injected into the rank's own process after a delay: ``rank_killed`` sends it SIGKILL (the
launcher sees a dead rank), ``rank_hung`` sends it SIGSTOP (it stops heartbeating; its rank monitor must
detect the hang and terminate it). A timer thread fires the fault, so it lands wherever the training
loop happens to be, as a real fault would.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import threading
from dataclasses import dataclass, fields
from typing import Any, Optional

from nvrx.common.errors import ConfigError

FAULT_SIGNALS = {"rank_killed": signal.SIGKILL, "rank_hung": signal.SIGSTOP}
FAULT_TYPES = (*FAULT_SIGNALS, "random")


@dataclass
class SimulatedFaultParams:
    """A fault to inject (NVRx's fields and defaults).

    fault_type: ``rank_killed``, ``rank_hung`` or ``random`` (one of the two, picked when it fires).
    base_delay: seconds after the callback's setup; the delay is ``base_delay + U[0, 1) * rand_delay``.
    rank_to_fail: the global rank to fail; None picks one at random (the same on every rank).
    """

    fault_type: str
    base_delay: float
    rand_delay: float = 0.0
    rank_to_fail: Optional[int] = None

    def __post_init__(self) -> None:
        if self.fault_type not in FAULT_TYPES:
            raise ConfigError(f"SimulatedFaultParams.fault_type={self.fault_type!r}: expected one of "
                              f"{', '.join(FAULT_TYPES)}")
        for name in ("base_delay", "rand_delay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ConfigError(f"SimulatedFaultParams.{name}={value!r}: expected seconds >= 0")
        rank = self.rank_to_fail
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ConfigError(f"SimulatedFaultParams.rank_to_fail={rank!r}: expected a rank >= 0 or None")

    def draw_delay(self, rng: random.Random) -> float:
        """The delay of one injection: base_delay plus a random share of rand_delay."""
        return self.base_delay + rng.random() * self.rand_delay


def parse_simulated_fault_params(value: Any) -> SimulatedFaultParams | None:
    """SimulatedFaultParams from None, an instance, or a mapping (dict, OmegaConf DictConfig, ...).

    Bad input raises ConfigError (a ValueError) naming what is wrong.
    """
    if value is None or isinstance(value, SimulatedFaultParams):
        return value
    try:
        keys = list(value.keys())
    except (AttributeError, TypeError):
        raise ConfigError(f"simulated_fault_params={value!r}: expected SimulatedFaultParams, a mapping or None") \
            from None
    known = {f.name for f in fields(SimulatedFaultParams)}
    unknown = sorted(str(k) for k in keys if k not in known)
    if unknown:
        raise ConfigError(f"simulated_fault_params: unknown field(s) {', '.join(unknown)}; "
                          f"expected {', '.join(sorted(known))}")
    try:
        return SimulatedFaultParams(**{str(k): value[k] for k in keys})
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"simulated_fault_params: {exc}") from None


class FaultInjector:
    """Fires one simulated fault on this process after a delay, unless cancelled first.

    Cancelling matters: once training has ended, a kill would only confuse the user's test (the job
    would look failed after it had succeeded), so the callback cancels a fault that has not fired yet.
    """

    def __init__(self, fault_type: str, delay: float, log: logging.Logger) -> None:
        if fault_type not in FAULT_SIGNALS:
            raise ConfigError(f"fault_type={fault_type!r}: expected one of {', '.join(FAULT_SIGNALS)}")
        self.fault_type = fault_type
        self.delay = delay
        self._log = log
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvrx-simulated-fault", daemon=True)

    def start(self) -> "FaultInjector":
        self._log.info("simulated fault %s will hit this rank (pid %d) in %.2f s",
                       self.fault_type, os.getpid(), self.delay)
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Do not fire (no effect once fired). The thread ends at once."""
        if not self._cancel.is_set() and self._thread.is_alive():
            self._log.info("simulated fault %s not injected: training ended first", self.fault_type)
        self._cancel.set()

    def _run(self) -> None:
        if self._cancel.wait(self.delay):
            return
        sig = FAULT_SIGNALS[self.fault_type]
        self._log.warning("simulated fault: sending %s to this rank (pid %d)", sig.name, os.getpid())
        for handler in logging.getLogger().handlers + self._log.handlers:
            handler.flush()
        os.kill(os.getpid(), sig)


def choose_fault(params: SimulatedFaultParams, world_size: int, rng: random.Random) -> tuple[int, str, float]:
    """(rank to fail, concrete fault type, delay) for PARAMS.

    RNG must be seeded alike on every rank (the callback broadcasts rank 0's seed), so that every rank
    picks the same victim when rank_to_fail is None. A rank_to_fail outside the job is a ConfigError.
    """
    victim = params.rank_to_fail if params.rank_to_fail is not None else rng.randrange(world_size)
    if victim >= world_size:
        raise ConfigError(f"SimulatedFaultParams.rank_to_fail={victim}: the job has only {world_size} rank(s)")
    fault_type = params.fault_type
    if fault_type == "random":
        fault_type = rng.choice(sorted(FAULT_SIGNALS))
    return victim, fault_type, params.draw_delay(rng)
