"""nvrx.monitors.auto_timeout: settle, warm-up, the bound, widening only, and enforcement by mode."""

from __future__ import annotations

from nvrx.monitors.auto_timeout import AutoTimeout, AutoTimeoutSettings, percentile
from nvrx.monitors.heartbeat import GAP_BUCKETS, gap_bucket, gap_bucket_upper

SETTINGS = AutoTimeoutSettings(mode="set", multiple=4.0, floor=0.1, percentile=100.0, warmup_beats=10, warmup_s=5.0,
                               settle_s=2.0)


def hist(**gaps: int) -> tuple[int, ...]:
    """A slot histogram: gaps given as g<milliseconds>=count."""
    out = [0] * GAP_BUCKETS
    for key, n in gaps.items():
        out[gap_bucket(int(key[1:]) / 1000)] += n
    return tuple(out)


def plus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b))


def test_settling_gaps_are_not_counted_and_warm_up_needs_beats_and_seconds() -> None:
    auto = AutoTimeout(SETTINGS, configured=30.0)
    assert auto.observe(hist(), beaten=False, now=0.0) is None       # no beat yet: nothing starts
    start = hist(g3000=1)                                            # a 3 s restore gap while settling
    assert auto.observe(start, beaten=True, now=1.0) is None
    assert auto.observe(start, beaten=True, now=3.0) is None         # settled at 3.0: baseline taken
    steady = plus(start, hist(g50=20))
    assert auto.observe(steady, beaten=True, now=6.0) is None        # 20 gaps but 3 s < 5 s observed
    change = auto.observe(steady, beaten=True, now=8.5)
    assert change is not None and change.reason == "warm-up done" and change.gaps == 20
    assert change.longest_gap == round(gap_bucket_upper(gap_bucket(0.05)), 6)  # not the 3 s settling gap
    assert change.timeout == round(4 * change.longest_gap, 6)
    assert auto.enforced(8.5) == change.timeout


def test_widens_on_a_longer_gap_never_narrows_and_respects_floor_and_configured() -> None:
    auto = AutoTimeout(SETTINGS, configured=1.0)
    auto.observe(hist(), beaten=True, now=0.0)
    auto.observe(hist(), beaten=True, now=2.0)
    first = auto.observe(hist(g5=50), beaten=True, now=8.0)
    assert first is not None and first.timeout == 0.1                # 4 x 5 ms is below the floor
    wider = auto.observe(hist(g5=50, g120=1), beaten=True, now=9.0)
    assert wider is not None and wider.reason == "longer gap observed" and wider.previous == 0.1
    assert wider.timeout == round(4 * round(gap_bucket_upper(gap_bucket(0.12)), 6), 6)
    assert auto.observe(hist(g5=500, g120=1), beaten=True, now=10.0) is None  # more short gaps: no narrowing
    capped = auto.observe(hist(g5=500, g120=1, g400=1), beaten=True, now=11.0)
    assert capped is not None and capped.capped and capped.timeout == 1.0
    assert auto.enforced(11.0) is None                               # the configured timeout is as tight


def test_observations_carry_over_restarts_which_only_settle_again() -> None:
    auto = AutoTimeout(SETTINGS, configured=30.0)
    auto.observe(hist(), beaten=True, now=0.0)
    auto.observe(hist(), beaten=True, now=2.0)
    assert auto.observe(hist(g50=20), beaten=True, now=8.0) is not None
    auto.end_run()
    auto.start_run()
    assert auto.enforced(9.0) is None                                # not settled in the new run
    auto.observe(hist(), beaten=True, now=9.0)
    restore = hist(g3000=1, g50=5)                                   # the restore phase: a 3 s wait
    auto.observe(restore, beaten=True, now=12.0)
    assert auto.enforced(12.0) is None                               # settle time over, but not back in rhythm
    auto.observe(plus(restore, hist(g50=10)), beaten=True, now=12.5)
    assert auto.enforced(12.5) is None                               # 10 steady gaps in a row: not yet
    auto.observe(plus(restore, hist(g50=20)), beaten=True, now=13.0)
    assert auto.enforced(13.0) is not None                           # 20 in a row: settled, no second warm-up


def test_a_percentile_leaves_rare_long_gaps_to_the_look_before_acting() -> None:
    auto = AutoTimeout(AutoTimeoutSettings(mode="set", multiple=4.0, floor=0.1, percentile=99.0, warmup_beats=10,
                                           warmup_s=0.0, settle_s=0.0), configured=30.0)
    auto.observe(hist(), beaten=True, now=0.0)
    change = auto.observe(hist(g50=995, g400=5), beaten=True, now=1.0)   # 0.5 % of the gaps are long
    assert change is not None and change.basis == round(gap_bucket_upper(gap_bucket(0.05)), 6)
    assert change.longest_gap == round(gap_bucket_upper(gap_bucket(0.4)), 6)
    assert change.timeout == round(4 * change.basis, 6) < change.longest_gap
    slower = auto.observe(hist(g50=995, g400=50), beaten=True, now=2.0)  # a slower phase: 5 % -> follows it
    assert slower is not None and slower.basis == change.longest_gap and slower.timeout > change.timeout


def test_modes() -> None:
    for mode, enforced in (("suggest", False), ("off", False)):
        auto = AutoTimeout(AutoTimeoutSettings(mode=mode, warmup_beats=1, warmup_s=0.0, settle_s=0.0), 30.0)
        auto.observe(hist(), beaten=True, now=0.0)
        change = auto.observe(hist(g50=5), beaten=True, now=1.0)
        assert (change is not None) == (mode == "suggest")
        assert auto.enforced(1.0) is None


def test_percentile_is_a_bucket_upper_edge() -> None:
    h = list(hist(g10=98, g200=2))
    assert percentile(h, 0.5) == gap_bucket_upper(gap_bucket(0.01))
    assert percentile(h, 0.99) == gap_bucket_upper(gap_bucket(0.2))
    assert percentile([0] * GAP_BUCKETS, 0.5) is None
