"""Where the suite's time goes, per tier (a pytest plugin, registered by tests/conftest.py).

At the end of every run that ran tests, a table: for each tier the tests run, their summed and mean time
(setup + call + teardown), and the run's slowest tests with their tier. ``--tier-durations FILE`` also writes
it as JSON with every test's tier and time, so two runs (before/after a change, quiet/loaded) can be compared.
Works under pytest-xdist: tests/tiers.py puts the tier and the slow marker in each report's user_properties.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from tests.tiers import TIERS

SLOWEST = 20
SLOW_SECONDS = 20.0  # the `slow` marker's promise (pyproject.toml): the test takes longer than this


class TierClock:
    """Sums each test's phases and knows its tier from its reports."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tier: dict[str, str] = {}
        self.marked_slow: set[str] = set()

    def add(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        props = dict(report.user_properties)  # set by tests/tiers.py for every phase
        if props.get("tier") in TIERS:
            self.tier[report.nodeid] = props["tier"]
        if props.get("slow"):
            self.marked_slow.add(report.nodeid)

    def slow_audit(self) -> dict[str, list[str]]:
        """Where the `slow` marker and the clock disagree (a module's shared fixture counts for its first test)."""
        return {"marked_slow_under": sorted(n for n in self.marked_slow if self.seconds[n] <= SLOW_SECONDS),
                "unmarked_over": sorted(n for n, s in self.seconds.items()
                                        if s > SLOW_SECONDS and n not in self.marked_slow)}

    def summary(self) -> dict:
        per_tier: dict[str, dict] = {}
        for tier in (*TIERS, "none"):
            times = [s for n, s in self.seconds.items() if self.tier.get(n, "none") == tier]
            if times:
                per_tier[tier] = {"tests": len(times), "seconds": round(sum(times), 2),
                                  "mean": round(sum(times) / len(times), 3), "max": round(max(times), 2)}
        slowest = sorted(self.seconds.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST]
        return {"tiers": per_tier,
                "slowest": [{"nodeid": n, "tier": self.tier.get(n, "none"), "seconds": round(s, 2)}
                            for n, s in slowest],
                "slow_audit": self.slow_audit(),
                "tests": {n: [self.tier.get(n, "none"), round(s, 3)] for n, s in sorted(self.seconds.items())}}


_CLOCK = pytest.StashKey[TierClock]()
_ACTIVE: list[TierClock] = []  # the clock of the running session (logreport gets no config)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("nvrx").addoption("--tier-durations", default=None, metavar="FILE",
                                      help="write the per-tier time table and the slowest tests to FILE (JSON)")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_CLOCK] = TierClock()
    _ACTIVE[:] = [config.stash[_CLOCK]]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _ACTIVE:
        _ACTIVE[0].add(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    clock = config.stash.get(_CLOCK, None)
    if clock is None or not clock.seconds:
        return
    summary = clock.summary()
    tr = terminalreporter
    tr.section("time per tier (setup + call + teardown)")
    tr.write_line(f"{'tier':<12}{'tests':>7}{'seconds':>10}{'mean':>8}{'max':>8}")
    for tier, row in summary["tiers"].items():
        tr.write_line(f"{tier:<12}{row['tests']:>7}{row['seconds']:>10.1f}{row['mean']:>8.2f}{row['max']:>8.1f}")
    tr.write_line(f"slowest {len(summary['slowest'])}:")
    for row in summary["slowest"]:
        tr.write_line(f"{row['seconds']:>8.1f} s  {row['tier']:<11} {row['nodeid']}")
    audit = summary["slow_audit"]
    tr.write_line(f"slow marker (> {SLOW_SECONDS:g} s): {len(audit['marked_slow_under'])} marked tests took less, "
                  f"{len(audit['unmarked_over'])} unmarked took more"
                  + (" (listed in --tier-durations FILE)" if any(audit.values()) else ""))
    target = config.getoption("tier_durations")
    if target:
        Path(target).write_text(json.dumps(summary, indent=1) + "\n")
