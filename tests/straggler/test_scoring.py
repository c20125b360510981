"""Straggler scoring and sampling (nvrx.monitors.straggler): the statistics, without processes."""

from __future__ import annotations

import random
import statistics

from nvrx.monitors.straggler import (HEARTBEAT, MetricSummary, StragglerScorer, TimingSampler, summary_from_json,
                                summary_to_json)


def _report(medians: dict[int, float], samples: int = 10, metric: str = "compute") -> dict:
    return {rank: (f"node{rank // 2}", {metric: MetricSummary(m, samples)}) for rank, m in medians.items()}


def test_a_steady_noisy_job_flags_nobody():
    rng = random.Random(7)
    scorer = StragglerScorer(threshold=1.2, sustain=2)
    for i in range(500):  # 8 ranks, each median jittering by up to +-8 %, 500 reports
        _, changes = scorer.update(_report({r: 0.05 * rng.uniform(0.92, 1.08) for r in range(8)}), float(i))
        assert changes == []


def test_a_rank_that_becomes_slower_is_flagged_after_the_sustain_count_and_recovers():
    scorer = StragglerScorer(threshold=1.2, sustain=2)
    for i in range(5):
        assert scorer.update(_report({0: 0.05, 1: 0.05, 2: 0.05, 3: 0.05}), float(i))[1] == []
    slow = {0: 0.05, 1: 0.05, 2: 0.075, 3: 0.05}
    assert scorer.update(_report(slow), 5.0)[1] == []  # one slow report is not enough
    (st,) = scorer.update(_report(slow), 6.0)[1]
    assert (st.rank, st.node, st.metric, st.state, st.reports, st.since) == (2, "node1", "compute", "straggler", 2, 5.0)
    assert round(st.relative, 3) == 1.5 and round(st.individual, 3) == 1.5 and st.peers == 0.05
    (st,) = scorer.update(_report(slow), 7.0)[1]
    assert st.reports == 3 and st.since == 5.0
    (st,) = scorer.update(_report({0: 0.05, 1: 0.05, 2: 0.05, 3: 0.05}), 8.0)[1]
    assert (st.rank, st.state) == (2, "recovered")
    assert scorer.update(_report({0: 0.05, 1: 0.05, 2: 0.05, 3: 0.05}), 9.0)[1] == []


def test_a_single_slow_report_between_normal_ones_never_flags():
    scorer = StragglerScorer(threshold=1.2, sustain=2)
    for i in range(50):
        medians = {0: 0.05, 1: 0.05, 2: 0.05}
        if i % 2:
            medians[i % 3] = 0.5  # a 10x spike, never twice in a row for the same rank
        assert scorer.update(_report(medians), float(i))[1] == []


def test_a_job_wide_slowdown_is_not_a_straggler_but_one_rank_alone_is_judged_by_its_history():
    scorer = StragglerScorer(threshold=1.2, sustain=2)
    for i in range(4):
        scorer.update(_report({0: 0.05, 1: 0.05}), float(i))
    for i in range(4, 8):  # every rank 2x slower: peers agree, nobody stands out
        assert scorer.update(_report({0: 0.1, 1: 0.1}), float(i))[1] == []
    alone = StragglerScorer(threshold=1.2, sustain=2)
    for i in range(4):
        alone.update(_report({0: 0.05}), float(i))
    alone.update(_report({0: 0.08}), 4.0)
    (st,) = alone.update(_report({0: 0.08}), 5.0)[1]
    assert st.relative is None and round(st.individual, 2) == 1.6


def test_too_few_samples_do_not_count():
    scorer = StragglerScorer(threshold=1.2, sustain=1, min_samples=3)
    assert scorer.update(_report({0: 0.05, 1: 0.5}, samples=2), 0.0) == ([], [])
    assert [s.rank for s in scorer.update(_report({0: 0.05, 1: 0.5}, samples=3), 1.0)[1]] == [1]


def test_ranks_without_fresh_data_are_peers_only():
    scorer = StragglerScorer(threshold=1.2, sustain=2)
    report = _report({0: 0.05, 1: 0.05, 2: 0.1})
    assert scorer.update(report, 0.0, fresh={0, 1})[1] == []  # rank 2's summary is old: not counted for it
    assert scorer.update(report, 1.0, fresh={2})[1] == []  # its first slow report
    assert [s.rank for s in scorer.update(report, 2.0, fresh={2})[1]] == [2]


def test_the_sampler_takes_each_new_close_and_the_mean_heartbeat_interval():
    sampler = TimingSampler()
    names = {0: "compute", 1: "io"}
    sampler.observe(0, 0.0, [0, 0], [0.0, 0.0], names)
    sampler.observe(1, 10.0, [1, 0], [0.05, 0.0], names)
    sampler.observe(3, 10.2, [3, 0], [0.06, 0.0], names)   # two beats in 0.2 s: one 0.1 s sample
    sampler.observe(3, 10.2, [3, 1], [0.06, 0.3], names)   # no beat, no compute close: nothing new for them
    sampler.observe(5, 10.6, [4, 1], [0.07, 0.3], names)
    summary = sampler.take()
    assert summary["compute"] == MetricSummary(0.06, 3)
    assert summary["io"] == MetricSummary(0.3, 1)
    assert summary[HEARTBEAT].samples == 2 and abs(summary[HEARTBEAT].median - 0.15) < 1e-9
    assert sampler.take() == {}  # a new window
    sampler.reset()  # a new rank run: the counters start over, the first look only sets the base
    sampler.observe(1, 1.0, [1, 0], [0.05, 0.0], names)
    assert sampler.take() == {}


def test_summaries_cross_boundaries_as_json_and_garbage_is_dropped():
    summary = {"compute": MetricSummary(0.05, 7), HEARTBEAT: MetricSummary(0.1, 3)}
    assert summary_from_json(summary_to_json(summary)) == summary
    assert summary_from_json({"a": [0, 1], "b": [0.1, 0], "c": ["x", 1], "d": [True, 1], "e": [0.1, 2]}) == {
        "e": MetricSummary(0.1, 2)}
    assert summary_from_json([1, 2]) == {}


def test_the_median_of_the_other_ranks_is_exact():
    from nvrx.monitors.straggler import median_without

    rng = random.Random(3)
    for n in range(1, 12):
        values = sorted(rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(n))
        for i in range(n):
            rest = values[:i] + values[i + 1:]
            expected = statistics.median(rest) if rest else None
            assert median_without(values, i) == expected, (values, i)


def test_agents_and_the_in_rank_detector_score_with_the_one_method():
    """One unusually fast rank (3) must not make its peers look slow, in either consumer of the method."""
    from nvrx.launcher.rank.straggler.detector import _relative_scores
    from nvrx.monitors.straggler import perf_score, slowdowns

    medians = {0: 1.0, 1: 1.0, 2: 2.0, 3: 0.25}
    method = slowdowns(medians)
    assert {r: v[1] for r, v in method.items()} == {0: 1.0, 1: 1.0, 2: 2.0, 3: 0.25}  # vs the others' median 1.0
    detector = _relative_scores([{"step": m} for _, m in sorted(medians.items())])["step"]
    assert detector == {r: perf_score(method[r][1]) for r in medians} == {0: 1.0, 1: 1.0, 2: 0.5, 3: 1.0}
    agents = StragglerScorer(threshold=1.2, sustain=1).scores(_report(medians))
    assert {s.rank: s.relative for s in agents} == {r: v[1] for r, v in method.items()}
    assert {s.rank for s in agents if s.slow} == {2} == {r for r, s in detector.items() if s < 0.75}
