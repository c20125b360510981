"""The in-rank straggler API (nvrx.launcher.rank.straggler): arguments, and a real 2-rank gloo job under nvrx launch."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from nvrx.launcher.rank.straggler import Detector, Statistic

RANKS = str(Path(__file__).with_name("detector_ranks.py"))


@pytest.fixture(autouse=True)
def _fresh_detector():
    Detector.shutdown()
    yield
    Detector.shutdown()


def test_arguments_are_checked_and_use_before_initialize_is_refused():
    with pytest.raises(RuntimeError, match="initialize"):
        with Detector.detection_section("x"):
            pass
    with pytest.raises(RuntimeError, match="initialize"):
        Detector.generate_report()
    for bad in ({"scores_to_compute": ["speed"]}, {"scores_to_compute": "some"}, {"profiling_interval": 0},
                {"report_time_interval": 0}):
        with pytest.raises(ValueError):
            Detector.initialize(**bad)
    with pytest.raises(TypeError, match="class methods"):
        Detector()
    Detector.initialize()
    with pytest.raises(RuntimeError, match="already initialized"):
        Detector.initialize()


def test_one_process_report_summarises_sections_and_profiles_every_nth_entry():
    Detector.initialize(profiling_interval=2, report_time_interval=3600, node_name="here")
    for _ in range(6):
        with Detector.detection_section("work"):
            time.sleep(0.002)
        with Detector.detection_section():  # named after this line
            pass
    assert not Detector.is_interval_elapsed() and Detector.generate_report_if_interval_elapsed() is None
    report = Detector.generate_report()
    assert report.local_section_summaries["work"][Statistic.NUM] == 3  # entries 1, 3, 5
    assert report.local_section_summaries["work"][Statistic.MIN] >= 0.002
    assert any(name.endswith("test_detector.py:" + name.rsplit(":", 1)[1]) for name in report.local_section_summaries
               if name != "work")
    assert report.section_relative_perf_scores["work"] == {0: 1.0} and report.rank_to_node == {0: "here"}
    assert report.gpu_relative_perf_scores == {} and report.identify_stragglers()["straggler_sections_relative"]["work"] == set()
    assert Detector.generate_report().local_section_summaries == {}  # a report starts the next interval


def test_profile_cuda_that_cannot_act_is_said_once(caplog):
    Detector.initialize(report_time_interval=3600)
    with caplog.at_level(logging.WARNING, logger="nvrx.straggler"):
        with Detector.detection_section("quiet", profile_cuda=False):
            pass
        assert caplog.records == []
        for name in ("a", "b", "a"):
            with Detector.detection_section(name):  # profile_cuda=True, the default
                pass
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "profile_cuda=True has no effect" in lines[0] and "'a'" in lines[0]
    assert "no CUDA device" in lines[0] or "does not profile CUDA kernels" in lines[0]


def test_interval_checks_are_spread_out_not_one_collective_per_call():
    Detector.initialize(report_time_interval=0.2)
    reports, t_end = 0, time.monotonic() + 0.5
    while time.monotonic() < t_end:
        with Detector.detection_section("s"):
            pass
        reports += Detector.generate_report_if_interval_elapsed() is not None
    assert Detector._check_every > 10  # thousands of calls per second: about 20 checks per interval
    assert 1 <= reports <= 3


@pytest.mark.parametrize("gather", ["1", "0"])
def test_two_gloo_ranks_the_slow_one_is_identified_with_its_node(launcher, tmp_path, gather):
    out = tmp_path / "out"
    out.mkdir()
    res = launcher.run("--standalone", "--nproc-per-node", "2", RANKS, str(out), env={"GATHER": gather}, timeout=90)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("profile_cuda=True has no effect") == 2, res.stderr  # once per rank, for "fwd"
    r0, r1 = (json.loads((out / f"report{r}.json").read_text()) for r in (0, 1))
    assert len(r0) == len(r1) >= 1  # the ranks agreed on when to report
    last0, last1 = r0[-1], r1[-1]
    if gather == "1":
        assert last0["stragglers"] == [[1, "node-1"]] and last0["nodes"] == {"0": "node-0", "1": "node-1"}
        assert 0.35 < last0["rel"]["fwd"]["1"] < 0.65 and last0["rel"]["fwd"]["0"] == 1.0
        assert last1["rel"] == {"fwd": {}, "data": {}} and last1["nodes"] == {}  # only rank 0 holds results
    else:
        assert set(last0["rel"]["fwd"]) == {"0"} and set(last1["rel"]["fwd"]) == {"1"}
        assert last1["stragglers"] == [[1, "node-1"]] and last0["stragglers"] == []
    assert launcher.leftovers() == []


LIGHTNING = str(Path(__file__).with_name("lightning_straggler.py"))


def test_lightning_callback_finds_the_slow_rank_and_stops_the_fit(launcher, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    res = launcher.run("--standalone", "--nproc-per-node", "2", LIGHTNING, str(out), timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["step"] == r1["step"] < 2000  # stopped together, early
    assert r0["reports"] == r1["reports"] >= 1
    assert 0.35 < r0["relative"][-1]["1"] < 0.7 and r1["relative"][-1] == {}
    assert "straggler: rank 1 on node" in res.stdout + res.stderr
    assert launcher.leftovers() == []
