"""The agent's restart policy: which stops spend the job's restart budget, and when the job gives up.

The rendezvous (rendezvous.py) keeps membership and the signed records; it asks this policy, when it writes a
round's stop record, for the restart count and give-up flag that record carries. The rule lives here, with the
agent, because it is the agent's decision what a fault costs: a node leaving for a standby costs nothing, a rank
asking for no restart (a steering exit code, a monitor that keeps dying) ends the job at once.

Torch-free, like rdzv_records.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from nvrx.events import StopDetail
from nvrx.launcher.agent.rdzv_records import StopKind

FAULT_KINDS = (StopKind.FAILED, StopKind.NODE_LEFT)  # only these spend the restart budget


class Verdict(NamedTuple):
    """What a stop record says about the budget: the job-wide restart count after it, and whether the job ends."""

    restart_count: int
    give_up: bool


@dataclass(frozen=True)
class RestartPolicy:
    """--max-restarts, job-wide: each fault stop spends one restart, except a node leaving for a standby."""

    max_restarts: int

    def decide(self, kind: StopKind, reason: StopDetail, restarts: int) -> Verdict:
        """The verdict for a stop of KIND with REASON in a round that started with RESTARTS restarts spent."""
        if kind not in FAULT_KINDS:
            return Verdict(restarts, False)
        spends = not reason.leaves  # the leaving node(s) are replaced: the others go on in place for free
        count = restarts + (1 if spends else 0)
        return Verdict(count, (spends and count > self.max_restarts) or bool(reason.no_restart))
