"""Megatron-Core call compatibility of the re-run state machine, in one process: the error injector drives each
diagnosis (correct_result / transient_error / persistent_error) deterministically across a job boundary, the
result tracker file (Megatron's line format) and the steps it says to skip, comparison functions written for
Megatron (they get tensors), validate_state_dict, and the injector's bad input."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from nvrx.launcher.rank.rerun import (COMPARISON_MATCH, RerunDataIterator, RerunDiagnostic, RerunError,
                                 RerunErrorInjector, RerunMode, RerunStateMachine, RerunValidationStatus,
                                 destroy_rerun_state_machine, get_rerun_state_machine, initialize_rerun_state_machine,
                                 is_nan_or_inf)


def batches():
    k = 0
    while True:
        yield torch.full((2, 2), float(k))
        k += 1


def step(rsm, data, seen, compare=None, reject=torch.isnan):
    """One training step in Megatron's loop shape; SEEN gets every pass's loss."""
    while rsm.should_run_forward_backward(data):
        loss = next(data).sum() + 1.0
        seen.append(loss.item())
        rsm.validate_result(result=loss, rejection_func=reject, message="loss is NaN", comparison_func=compare,
                            tolerance=0.0, fatal=True)
    return rsm.should_checkpoint_and_exit()


def resumed(saved, node, monkeypatch, **kw):
    """The next job on NODE: a fresh machine loading SAVED, its loader positioned at the saved step."""
    monkeypatch.setenv("SLURMD_NODENAME", node)
    rsm = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS, **kw)
    rsm.load_state_dict(json.loads(json.dumps(saved)))
    it = batches()
    for _ in range(rsm.current_iteration):
        next(it)
    return rsm, RerunDataIterator(it)


@pytest.mark.parametrize("kind, in_place, verdict, last_exit", [
    ("transient_error", (False, False, 0), "transient_error", None),
    ("persistent_error", (True, True, 16), "persistent_error", (False, False, 0)),
    ("correct_result", (True, True, 16), "correct_result", (False, True, 17)),
])
def test_the_injector_rehearses_each_diagnosis(monkeypatch, tmp_path, kind, in_place, verdict, last_exit):
    monkeypatch.setenv("SLURMD_NODENAME", "nodeA")
    tracker = tmp_path / "tracker.txt"
    rsm = RerunStateMachine(None, None, RerunMode.VALIDATE_RESULTS, RerunErrorInjector(3, RerunDiagnostic(kind)),
                            str(tracker))
    data, seen = RerunDataIterator(batches()), []
    assert step(rsm, data, seen) == (False, False, 0) and step(rsm, data, seen) == (False, False, 0)
    assert seen == [1.0, 5.0]                                # nothing injected at the first two validations
    assert step(rsm, data, seen) == in_place                 # the third: injected, re-run in place
    assert seen[2:] == [9.0, 9.0]                            # a healthy result, re-run bitwise
    lines = tracker.read_text().splitlines()
    assert "iteration=2 status=initial_run result=9.0 message='loss is NaN'" in lines[0]
    if kind == "transient_error":
        assert rsm.verdicts[-1]["diagnosis"] == verdict and "first_rerun_not_reproducible" in lines[1]
        return
    assert "status=first_rerun_reproducible" in lines[1]
    again, data2 = resumed(rsm.state_dict(), "nodeB", monkeypatch, result_rejected_tracker_filename=str(tracker))
    seen2: list = []
    assert step(again, data2, seen2) == last_exit            # the injection came along in the checkpoint
    assert seen2 == [9.0] and again.verdicts[-1]["diagnosis"] == verdict
    second = {"persistent_error": "second_rerun_not_reproducible", "correct_result": "second_rerun_reproducible"}
    assert f"node=nodeB device=None jobID=N/A rank=0 iteration=2 status={second[kind]}" in \
        tracker.read_text().splitlines()[2]


def test_tracker_says_which_steps_to_skip(tmp_path):
    f = tmp_path / "t.txt"
    line = "ts=x node=n device=0 jobID={j} rank={r} iteration={i} status={s} result=nan message='m'\n"
    f.write_text(line.format(j=1, r=0, i=7, s="RerunValidationStatus.RERUN_DISABLED")   # Megatron's spelling
                 + line.format(j=2, r=0, i=7, s="rerun_disabled")                        # the same rank again
                 + line.format(j=1, r=0, i=9, s="first_rerun_reproducible")
                 + line.format(j=1, r=1, i=9, s="first_rerun_reproducible")              # two ranks: not the data
                 + line.format(j=1, r=0, i=9, s="first_rerun_reproducible")
                 + line.format(j=1, r=0, i=3, s="initial_run") * 2 + "garbage\n")
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(str(f)) == [7]
    assert RerunValidationStatus("second_rerun_reproducible") is RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE


def test_megatron_comparison_functions_get_tensors_and_the_module_helpers(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "nodeA")
    got = []

    def compare_floats(a, b):  # written for Megatron: it calls .item() on both
        got.append((type(a), type(b)))
        return COMPARISON_MATCH if a.item() == b.item() else 1.0

    destroy_rerun_state_machine()
    initialize_rerun_state_machine(mode="validate_results")
    rsm = get_rerun_state_machine()
    assert step(rsm, RerunDataIterator(batches()), [], compare_floats, lambda loss: True) == (True, True, 16)
    assert got == [(torch.Tensor, torch.Tensor)]
    assert rsm.validate_state_dict(rsm.state_dict()) is True
    assert RerunStateMachine(mode="validate_results").validate_state_dict(RerunStateMachine().state_dict()) is False
    assert rsm.validate_state_dict(None) is False
    large = functools.partial(rsm.is_unexpectedly_large, threshold=10, context="loss", num_samples=2)
    assert [large(torch.tensor(v)) for v in (1.0, 2.0, 3.0, 50.0)] == [False, False, False, True]
    destroy_rerun_state_machine()


def test_injector_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(RerunError, match="unknown error_injection_type 'flaky': use one of correct_result, "
                                         "transient_error, persistent_error"):
        RerunErrorInjector(1, "flaky")
    with pytest.raises(RerunError, match="error_injection_rate must be an integer >= 0"):
        RerunErrorInjector(-1)
    with pytest.raises(RerunError, match="error_injector must be a RerunErrorInjector"):
        RerunStateMachine(mode="validate_results", error_injector=5)
    with pytest.raises(RerunError, match="cannot be appended to"):
        RerunStateMachine(mode="validate_results", result_rejected_tracker_filename=str(tmp_path / "no" / "t.txt"))
