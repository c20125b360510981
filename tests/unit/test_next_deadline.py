"""nvrx.monitors.rank_monitor.next_deadline: which check of a rank's slot fails first, on hand-built snapshots.

The monitor sleeps until the deadline this returns, so a wrong pick means a hung rank goes
unnoticed (or a healthy one is killed): each case pins one rule of the decision.
"""

from __future__ import annotations

import dataclasses

import pytest

from nvrx.monitors.heartbeat import MAX_SECTIONS, SlotSnapshot
from nvrx.monitors.rank_monitor import Deadline, next_deadline
from nvrx.monitors.sections import SectionRegistry
from nvrx.monitors.timeouts import Timeouts

RUN_START = 100.0
SECTIONS = SectionRegistry(["step", "ckpt", "eval"])  # ids 0, 1, 2


def snapshot(**kw: object) -> SlotSnapshot:
    """A slot right after the rank started (nothing beaten, no section), with KW changed."""
    zeros = (0.0,) * MAX_SECTIONS
    base = SlotSnapshot(hb_count=0, last_hb=0.0, first_hb=0.0, first_delay=0.0, max_interval=0.0, open_mask=0,
                        open_count=0, close_count=0, last_section_end=RUN_START, max_out_of_section=0.0,
                        run_start=RUN_START, generation=1, auto_hb=0.0, section_start=zeros, section_max=zeros,
                        section_last=zeros, section_closes=(0,) * MAX_SECTIONS)
    return dataclasses.replace(base, **kw)


def opened(**starts: float) -> dict[str, object]:
    """Snapshot fields for the named sections being open since the given times."""
    start = [0.0] * MAX_SECTIONS
    mask = 0
    for name, t in starts.items():
        sid = SECTIONS.id_of(name)
        assert sid is not None
        start[sid] = t
        mask |= 1 << sid
    return {"open_mask": mask, "section_start": tuple(start), "open_count": len(starts)}


def deadline(snap: SlotSnapshot, timeouts: Timeouts) -> Deadline | None:
    return next_deadline(snap, timeouts, SECTIONS.name_of)


def test_nothing_configured_means_no_deadline() -> None:
    assert deadline(snapshot(), Timeouts()) is None
    assert deadline(snapshot(hb_count=3, last_hb=120.0), Timeouts()) is None


def test_first_heartbeat_counts_from_the_run_start() -> None:
    d = deadline(snapshot(), Timeouts(initial_heartbeat=60.0, heartbeat=5.0))
    assert d == Deadline(160.0, "no_first_heartbeat", 60.0, RUN_START)


def test_first_heartbeat_counts_from_the_last_section_end_when_later() -> None:
    d = deadline(snapshot(last_section_end=130.0), Timeouts(initial_heartbeat=60.0))
    assert d == Deadline(190.0, "no_first_heartbeat", 60.0, 130.0)


def test_no_first_heartbeat_timeout_means_none_until_the_first_beat() -> None:
    assert deadline(snapshot(), Timeouts(heartbeat=5.0)) is None


def test_after_a_beat_the_heartbeat_timeout_applies_from_the_last_beat() -> None:
    d = deadline(snapshot(hb_count=4, last_hb=150.0), Timeouts(initial_heartbeat=60.0, heartbeat=5.0))
    assert d == Deadline(155.0, "heartbeat_timeout", 5.0, 150.0)


def test_a_beaten_rank_without_heartbeat_timeout_has_no_heartbeat_deadline() -> None:
    # the first-heartbeat timeout no longer applies once the rank has beaten
    assert deadline(snapshot(hb_count=1, last_hb=101.0), Timeouts(initial_heartbeat=60.0)) is None


@pytest.mark.parametrize("last_hb, auto_hb, section_end, since", [
    (150.0, 0.0, RUN_START, 150.0),  # explicit beats only
    (150.0, 170.0, RUN_START, 170.0),  # the automatic heartbeat is newer
    (150.0, 0.0, 180.0, 180.0),  # a section ended after the last beat: progress too
])
def test_heartbeat_counts_from_the_newest_sign_of_progress(last_hb: float, auto_hb: float, section_end: float,
                                                           since: float) -> None:
    d = deadline(snapshot(hb_count=2, last_hb=last_hb, auto_hb=auto_hb, last_section_end=section_end),
                 Timeouts(heartbeat=5.0))
    assert d == Deadline(since + 5.0, "heartbeat_timeout", 5.0, since)


def test_an_automatic_heartbeat_alone_counts_as_beaten() -> None:
    d = deadline(snapshot(auto_hb=140.0), Timeouts(initial_heartbeat=60.0, heartbeat=5.0))
    assert d == Deadline(145.0, "heartbeat_timeout", 5.0, 140.0)


def test_an_open_timed_section_pauses_heartbeat_checks() -> None:
    snap = snapshot(hb_count=2, last_hb=150.0, **opened(ckpt=151.0))
    d = deadline(snap, Timeouts(heartbeat=5.0, sections={"ckpt": 300.0}))
    assert d == Deadline(451.0, "section_timeout", 300.0, 151.0, "ckpt")  # not 155: the long save is allowed


def test_an_open_untimed_section_keeps_heartbeat_checks() -> None:
    snap = snapshot(hb_count=2, last_hb=150.0, **opened(eval=151.0))
    d = deadline(snap, Timeouts(heartbeat=5.0, sections={"ckpt": 300.0}, out_of_section=1.0))
    assert d == Deadline(155.0, "heartbeat_timeout", 5.0, 150.0)  # and no out-of-section check: one is open


def test_the_earliest_of_several_open_sections_wins() -> None:
    snap = snapshot(**opened(step=200.0, ckpt=150.0))
    d = deadline(snap, Timeouts(sections={"step": 10.0, "ckpt": 100.0}))
    assert d == Deadline(210.0, "section_timeout", 10.0, 200.0, "step")


def test_out_of_section_counts_from_the_last_section_end() -> None:
    d = deadline(snapshot(last_section_end=120.0), Timeouts(out_of_section=30.0))
    assert d == Deadline(150.0, "out_of_section_timeout", 30.0, 120.0)


def test_out_of_section_wins_when_earlier_than_the_heartbeat() -> None:
    snap = snapshot(hb_count=1, last_hb=125.0, last_section_end=120.0)
    assert deadline(snap, Timeouts(heartbeat=20.0, out_of_section=10.0)).reason == "out_of_section_timeout"
    assert deadline(snap, Timeouts(heartbeat=4.0, out_of_section=10.0)).reason == "heartbeat_timeout"


def test_an_open_section_without_its_own_timeout_has_no_deadline_from_out_of_section() -> None:
    assert deadline(snapshot(**opened(eval=130.0)), Timeouts(out_of_section=30.0)) is None


def test_a_section_unknown_to_the_registry_is_looked_up_by_its_placeholder_name() -> None:
    snap = snapshot(open_mask=1 << 7, section_start=(0.0,) * 7 + (140.0,) + (0.0,) * (MAX_SECTIONS - 8))
    assert deadline(snap, Timeouts(sections={"step": 1.0}, out_of_section=1.0)) is None
