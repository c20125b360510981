"""every_steps="auto": Daly's optimum from measured costs, never below the writer's drain time, re-tuned at saves."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nvrx import ckpt
from nvrx.ckpt import interval


def test_daly_is_young_to_first_order_and_maximises_expected_goodput():
    cost, mtbf = 2.0, 3600.0
    young = math.sqrt(2 * cost * mtbf)
    best = interval.daly_seconds(cost, mtbf)
    assert abs(best - young) / young < 0.02  # C << M: Young's formula
    good = interval.expected_goodput(best, cost, mtbf, restart=30)
    for other in (best / 2, best * 0.8, best * 1.25, best * 2):
        assert interval.expected_goodput(other, cost, mtbf, restart=30) < good
    assert interval.daly_seconds(10.0, 4.0) == 4.0  # C >= 2M: save once per MTBF


def test_the_choice_in_steps_respects_the_drain_time():
    c = interval.choose(step_s=0.05, save_cost_s=0.01, drain_s=0.2, mtbf_s=600.0)
    assert c.every_steps == round(interval.daly_seconds(0.01, 600.0) / 0.05) and "Daly" in c.why
    slow = interval.choose(step_s=0.05, save_cost_s=0.01, drain_s=40.0, mtbf_s=600.0)
    assert slow.every_steps == 800 and "drain" in slow.why  # 40 s / 50 ms: never two saves in flight
    unknown = interval.choose(step_s=0.05, save_cost_s=0.01, drain_s=0.2, mtbf_s=None)
    assert unknown.every_steps == interval.MAX_EVERY_STEPS and unknown.expected_goodput is None


def test_an_unmeasured_part_of_the_save_cost_is_not_taken_as_free():
    step = 0.05
    # before any save: one step stands for the blocking part, and no drain is known yet
    assert interval.save_cost(step, None, 0.0, None, 0).total == pytest.approx(step)
    # a drain of 0.12 s, its slowdown timed on 3 steps only: all of it counts
    assert interval.save_cost(step, 0.002, 0.12, 0.06, 3).total == pytest.approx(0.122)
    # timed on enough steps (each 10 ms slower while it drains): the slowdown over the drain's steps
    enough = interval.MIN_DRAIN_STEPS
    assert interval.save_cost(step, 0.002, 0.12, 0.06, enough).total == pytest.approx(0.002 + 0.01 * 0.12 / 0.06)
    assert interval.save_cost(step, 0.002, 0.12, 0.04, enough).total == pytest.approx(0.002)  # faster: no slowdown
    # what this changes for the first choice (a job 3 s in, no failure yet): not one step, as a zero cost gave
    first = interval.choose(step, interval.save_cost(step, None, 0.0, None, 0).total, 0.0, 3.0)
    assert interval.choose(step, 0.0, 0.0, 3.0).every_steps == 1 and first.every_steps >= 8


def test_one_slow_step_does_not_move_the_step_time_estimate():
    window = interval.WindowMedian(size=8)
    for _ in range(7):
        window.add(0.050)
    window.add(5.0)
    assert window.median() == pytest.approx(0.050)  # a GC pause: the median stays, a moving average would not
    for _ in range(8):
        window.add(0.060)
    assert window.median() == pytest.approx(0.060) and len(window) == 8  # a lasting change is followed within the window


def _train_auto(root, steps: int, **saver_kw) -> ckpt.PeriodicCheckpointer:
    """STEPS Adam steps of a small model from a fresh start, saving with every_steps="auto"; closed after."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    saver = ckpt.PeriodicCheckpointer(root, model=model, optimizer=opt, every_steps="auto", **saver_kw)
    assert saver.resume() == 0
    for step in range(steps):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        saver.step(step)
    saver.close()
    return saver


def test_auto_interval_is_chosen_at_the_first_save_and_recorded(tmp_path):
    saver = _train_auto(tmp_path, 120, mtbf_s=30.0)
    choice = saver.interval
    assert choice is not None and saver.every_steps == choice.every_steps != 50
    assert choice.mtbf_s == 30.0 and choice.step_s > 0 and choice.save_cost_s > 0
    expected = interval.choose(choice.step_s, choice.save_cost_s, choice.drain_s, 30.0).every_steps
    assert choice.every_steps == expected
    recorded = json.loads((tmp_path / "nvrx_interval.json").read_text())
    assert recorded["every_steps"] == choice.every_steps and recorded["choice"]["why"] == choice.why
    assert recorded["failures"] == 0


def test_bad_every_steps_is_refused(tmp_path):
    with pytest.raises(ValueError, match='"auto"'):
        ckpt.PeriodicCheckpointer(tmp_path, model=torch.nn.Linear(2, 2), every_steps="often")


def test_with_no_failure_and_no_mtbf_the_time_run_bounds_the_interval(tmp_path):
    saver = _train_auto(tmp_path, 60)
    choice = saver.interval
    recorded = json.loads((tmp_path / "nvrx_interval.json").read_text())
    ran = recorded["first_start"]
    # not "save rarely" (interval.MAX_EVERY_STEPS): the first fault would lose everything since step 50
    assert choice is not None and choice.every_steps < interval.MAX_EVERY_STEPS
    assert choice.mtbf_s is not None and 1.0 <= choice.mtbf_s < 600 and ran > 0
    assert choice.every_steps == interval.choose(choice.step_s, choice.save_cost_s, choice.drain_s,
                                                 choice.mtbf_s).every_steps


def test_a_restarted_round_starts_from_the_measurements_and_interval_of_the_last(tmp_path):
    def run(steps: int) -> ckpt.PeriodicCheckpointer:
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.Adam(model.parameters())
        saver = ckpt.PeriodicCheckpointer(tmp_path, model=model, optimizer=opt, every_steps="auto", mtbf_s=30.0)
        start = saver.resume()
        for step in range(start, start + steps):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            saver.step(step)
        return saver

    first = run(120)
    first.close()
    chosen = json.loads((tmp_path / "nvrx_interval.json").read_text())
    again = run(0)  # resumed, no step yet: what the last round measured and chose is in force
    assert again.every_steps == chosen["every_steps"] != 50
    assert again._measured["step_s"] == pytest.approx(chosen["measured"]["step_s"])
    # (the first interval is chosen before a save was measured: what is recorded then may still be None)
    assert again._measured["save_s"] == chosen["measured"]["save_s"]
    again.close()
