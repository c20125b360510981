"""Store barriers whose outcome is decided once, by the first rank able to decide, and followed by all.

Members arrive (with a small JSON payload). The first rank that sees every expected member arrived, or
whose deadline passed, writes the decision with compare-and-set; every rank, including late ones,
returns that one decision. Expected members are the given members minus the ranks recorded as
terminated while we wait, so a rank killed by its monitor does not hold the others up until the
timeout. Absent members of a timed-out barrier are recorded as terminated by the rank whose decision
won, so they cannot rejoin later.

A non-leading member (a spare rank in the completion barrier) starts its deadline only when the
first leading member arrives: spares wait as long as the active ranks work.
"""

from __future__ import annotations

import json
import time
from typing import Any

from nvrx.launcher.rank.inprocess.store import StoreMixin

POLL_FIRST = 0.0005
POLL_MAX = 0.01
TERMINATED_EVERY = 8  # polls between re-reads of the terminated set


def empty_decision(**extra: Any) -> dict[str, Any]:
    return {"members": [], "absent": [], "timed_out": False, "fault_base": 0, "payloads": [], **extra}


class StoreBarrier:
    """One barrier: ``wait(payload)`` returns the decision dict shared by every rank."""

    def __init__(self, store: StoreMixin, name: str, rank: int, members: frozenset[int], timeout: float,
                 leading: bool = True, mark_absent: bool = True) -> None:
        self.store = store
        self.name = name
        self.rank = rank
        self.members = frozenset(members)
        self.timeout = timeout
        self.leading = leading
        self.mark_absent = mark_absent

    def wait(self, payload: Any = None) -> dict[str, Any]:
        store = self.store
        store.arrive(self.name, self.rank, payload, self.leading)
        deadline = time.monotonic() + self.timeout if self.leading else None
        expected = self.members - store.terminated()
        delay = POLL_FIRST
        polls = 0
        while True:
            decision = store.decision(self.name)
            if decision is not None:
                return decision
            now = time.monotonic()
            if deadline is None and store.leading_arrivals(self.name) > 0:
                deadline = now + self.timeout
            if polls % TERMINATED_EVERY == TERMINATED_EVERY - 1:
                expected = self.members - store.terminated()
            timed_out = deadline is not None and now >= deadline
            if timed_out or store.arrival_count(self.name) >= len(expected):
                arrivals = store.arrivals(self.name)
                expected = self.members - store.terminated()
                if timed_out or expected <= arrivals.keys():
                    return self._close(arrivals, expected, timed_out)
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX)
            polls += 1

    def _close(self, arrivals: dict[int, Any], expected: frozenset[int], timed_out: bool) -> dict[str, Any]:
        members = sorted(expected & arrivals.keys())
        absent = sorted(expected - arrivals.keys())
        mine = {"members": members, "absent": absent, "timed_out": bool(timed_out and absent),
                "fault_base": self.store.fault_count(),
                "payloads": [[r, arrivals[r]] for r in members]}
        held = self.store.decide(self.name, mine)
        if self.mark_absent and absent and _same(held, mine):
            self.store.mark_terminated(absent, f"did not reach barrier {self.name} within {self.timeout:g} s")
        return held


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
