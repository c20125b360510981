"""The re-run state machine in one process: bitwise re-runs (RNG + data), the state across a job boundary,
determinism statistics, and bad input (one clear error each). Multi-rank behaviour under `nvrx launch`:
test_launch_rerun.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from nvrx.launcher.rank.rerun import (RerunDataIterator, RerunError, RerunState, RerunStateMachine, ResultRejected,
                                 SpikeDetector, is_nan_or_inf)


def random_batches():
    """A loader that draws from the global generators itself (as random augmentation does)."""
    while True:
        yield torch.randn(4, 3) + random.random()


def one_step(rsm, data, reject, seen):
    """One step under the machine: every pass records its batch and random draws in SEEN."""
    while rsm.should_run_forward_backward(data):
        x = next(data)
        drawn = (random.random(), float(np.random.rand()), torch.nn.functional.dropout(x, 0.5))
        loss = drawn[2].sum() + drawn[0] + drawn[1]
        seen.append((x, drawn, loss.item()))
        rsm.validate_result(loss, reject, "loss check", comparison_func=compare, tolerance=0.0)


compared = []


def compare(a, b):
    compared.append((a, b))
    return 0.0 if a == b else 1.0


def test_a_rerun_repeats_the_step_bitwise_in_place_and_from_the_checkpoint(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "nodeA")
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    rsm = RerunStateMachine(mode="validate_results")
    data = RerunDataIterator(random_batches())
    flag = {"on": False}
    reject = lambda loss: flag["on"]  # noqa: E731  rejects while the test says so
    seen: list = []
    one_step(rsm, data, reject, seen)                # step 0: healthy, one pass
    assert len(seen) == 1 and rsm.state is RerunState.NOT_RUNNING_YET
    flag["on"] = True
    seen.clear()
    one_step(rsm, data, reject, seen)                # step 1: rejected, re-run in place, reproduced
    (x0, d0, l0), (x1, d1, l1) = seen
    assert x0 is x1 and d0[:2] == d1[:2] and torch.equal(d0[2], d1[2]) and l0 == l1
    assert compared[-1] == (l0, l1)
    assert rsm.should_checkpoint_and_exit() == (True, True, 16)
    saved = rsm.state_dict()
    assert json.loads(saved["json"])["state"] == "will_rerun_from_checkpoint"

    # the next job, on another node: other RNG history; its loader starts at the step
    monkeypatch.setenv("SLURMD_NODENAME", "nodeB")
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    again = RerunStateMachine(mode="validate_results")
    again.load_state_dict(json.loads(json.dumps(saved)))
    assert again.state is RerunState.WILL_RERUN_FROM_CHECKPOINT and again.current_iteration == 1
    data2 = RerunDataIterator(random_batches())   # a fresh loader: it draws under the step's restored RNG
    seen2: list = []
    one_step(again, data2, reject, seen2)
    ((x2, d2, l2),) = seen2
    assert torch.equal(x2, x0) and d2[:2] == d0[:2] and torch.equal(d2[2], d0[2]) and l2 == l0  # bitwise
    assert again.verdicts[-1]["diagnosis"] == "correct_result"
    assert again.verdicts[-1]["suspects"][0]["node"] == "nodeA"
    assert again.verdicts[-1]["suspects"][0]["rerun_node"] == "nodeB"
    assert again.should_checkpoint_and_exit() == (False, True, 17)


def test_the_checkpoint_rerun_refuses_other_data_and_stops_on_the_same_node(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "nodeA")
    rsm = RerunStateMachine(mode="validate_results")
    data = RerunDataIterator(random_batches())
    seen: list = []
    one_step(rsm, data, lambda v: True, seen)
    saved = rsm.state_dict()
    same = RerunStateMachine(mode="validate_results")      # resumed on the suspected node again
    same.load_state_dict(saved)
    one_step(same, RerunDataIterator([seen[0][0]]), lambda v: True, [])
    assert same.should_checkpoint_and_exit() == (False, True, 16)
    assert same.state is RerunState.WILL_RERUN_FROM_CHECKPOINT and same.verdicts == []
    monkeypatch.setenv("SLURMD_NODENAME", "nodeB")
    other = RerunStateMachine(mode="validate_results")     # elsewhere, but the loader is at another step
    other.load_state_dict(saved)
    with pytest.raises(RerunError, match="got other batches than the suspected run"):
        one_step(other, RerunDataIterator([torch.ones(4, 3)]), lambda v: True, [])


def test_determinism_stats_run_every_step_twice():
    rsm = RerunStateMachine(mode="report_determinism_stats", stats_interval=4)
    passes = []
    for step in range(4):
        while rsm.should_run_forward_backward(None):
            passes.append(step)
            noise = 1e-10 * len(passes) if step == 2 else 0.0  # step 2 differs between its two runs
            rsm.validate_result(torch.tensor(1.0 + noise, dtype=torch.float64), is_nan_or_inf, "loss")
    assert passes == [0, 0, 1, 1, 2, 2, 3, 3]
    stats = rsm.determinism_stats["loss"]
    assert (stats["count"], stats["nonzero"]) == (4, 1) and 0 < stats["max_diff"] < 1e-8
    assert stats["buckets"] == {"0": 3, "<1e-9": 1} and stats["steps"] == [0, 3]


def test_disabled_mode_only_checks():
    rsm = RerunStateMachine()
    runs = 0
    while rsm.should_run_forward_backward(None):
        runs += 1
        rsm.validate_result(1.0, is_nan_or_inf, "fine")
        with pytest.raises(ResultRejected, match="unexpected result nan"):
            rsm.validate_result(float("nan"), is_nan_or_inf, "loss is NaN")
    assert runs == 1


def test_spike_detector_rejects_above_factor_times_the_recent_max():
    spike = SpikeDetector(factor=5, window=3, min_samples=2)
    assert [spike(v) for v in (1.0, 2.0, 9.0, 11.0, float("nan"), 100.0)] == [False, False, False, False, False,
                                                                             True]
    with pytest.raises(ValueError, match="factor"):
        SpikeDetector(factor=1)


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text
    return text


def test_bad_input_is_one_clear_error():
    with pytest.raises(RerunError) as info:
        RerunStateMachine(mode="validate")
    assert "unknown re-run mode 'validate': use one of disabled, validate_results, report_determinism_stats" == \
        _one_line(info.value)
    rsm = RerunStateMachine(mode="validate_results")
    assert rsm.should_run_forward_backward(None)
    with pytest.raises(RerunError) as info:
        rsm.validate_result(torch.ones(2, 3), is_nan_or_inf, "loss")
    assert "needs a scalar result" in _one_line(info.value) and "shape [2, 3]" in str(info.value)

    def broken(_):
        raise ValueError("no such\nkey")

    with pytest.raises(RerunError) as info:
        rsm.validate_result(1.0, broken, "loss")
    assert _one_line(info.value).startswith("rejection_func broken raised ValueError: no such key")
    with pytest.raises(RerunError, match="tolerance must be a finite number"):
        rsm.validate_result(1.0, is_nan_or_inf, "loss", tolerance=-1)
    with pytest.raises(RerunError, match="wrap it in launcher.rank.rerun.RerunDataIterator"):
        RerunStateMachine(mode="validate_results").should_run_forward_backward(iter([1]))
    with pytest.raises(RerunError, match="outside the step's loop"):
        RerunStateMachine(mode="validate_results").validate_result(1.0, is_nan_or_inf, "loss")
    with pytest.raises(RerunError, match="re-run state in the checkpoint is unreadable"):
        RerunStateMachine(mode="validate_results").load_state_dict({"json": "{"})


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA on this machine: the CUDA generators' capture/restore (rng.cuda_states) needs a GPU")
def test_cuda_generators_are_restored_too():
    from nvrx.launcher.rank.rerun import rng

    state = rng.capture()
    first = torch.rand(8, device="cuda")
    rng.restore(rng.from_json(json.loads(json.dumps(rng.to_json(state)))))
    assert torch.equal(torch.rand(8, device="cuda"), first)
