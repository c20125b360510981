"""The agent's restart policy (nvrx/launcher/agent/restart_policy.py): what each stop costs the job-wide budget."""

from __future__ import annotations

import pytest

from nvrx.events import StopDetail
from nvrx.launcher.agent.rdzv_records import StopKind
from nvrx.launcher.agent.restart_policy import RestartPolicy, Verdict


@pytest.mark.parametrize("kind", [StopKind.FAILED, StopKind.NODE_LEFT])
def test_a_fault_spends_one_restart_until_the_budget_is_gone(kind: StopKind) -> None:
    policy = RestartPolicy(max_restarts=2)
    assert policy.decide(kind, StopDetail(rank=0), 0) == Verdict(1, False)
    assert policy.decide(kind, StopDetail(rank=0), 1) == Verdict(2, False)
    assert policy.decide(kind, StopDetail(rank=0), 2) == Verdict(3, True)


@pytest.mark.parametrize("kind", [StopKind.SUCCEEDED, StopKind.SCALE_UP, StopKind.INTERRUPTED])
def test_other_stops_cost_nothing(kind: StopKind) -> None:
    assert RestartPolicy(0).decide(kind, StopDetail(no_restart=True), 5) == Verdict(5, False)


def test_a_node_leaving_for_a_standby_is_free_and_no_restart_gives_up_at_once() -> None:
    policy = RestartPolicy(max_restarts=0)
    assert policy.decide(StopKind.FAILED, StopDetail(leaves=["n1"], steer=16), 0) == Verdict(0, False)
    assert policy.decide(StopKind.FAILED, StopDetail(steer=93, no_restart=True), 0) == Verdict(1, True)
    assert RestartPolicy(9).decide(StopKind.FAILED, StopDetail(monitor_failed=True, no_restart=True), 0).give_up
