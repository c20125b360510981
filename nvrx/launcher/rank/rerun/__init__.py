"""The re-run state machine (spec 003, sections 5-6): tell a transient fault from bad hardware from a
real divergence by re-running a step whose result was rejected, in place and then from a checkpoint on
other hardware. Names and signatures follow Megatron-Core's ``megatron.core.rerun_state_machine``
(differences: docs/porting.md).

    from nvrx.launcher.rank.rerun import RerunStateMachine, RerunDataIterator, is_nan_or_inf
    rsm = RerunStateMachine(mode="validate_results")
    state = {"model": model, "optim": optim, "rerun": rsm}
    data = RerunDataIterator(loader)
    while rsm.should_run_forward_backward(data):
        optim.zero_grad()
        loss = loss_fn(model(next(data)))
        rsm.validate_result(loss, is_nan_or_inf, "loss is NaN or Inf", fatal=True)
        loss.backward()
    rsm.maybe_checkpoint_and_exit(state, f"ckpts/step_{step:07d}")   # exits 16 / 17 when needed
    optim.step()
"""

from nvrx.launcher.rank.rerun.data import RerunDataIterator
from nvrx.launcher.rank.rerun.injector import COMPARISON_MATCH, COMPARISON_MISMATCH, RerunErrorInjector
from nvrx.launcher.rank.rerun.machine import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                                         RerunStateMachine, destroy_rerun_state_machine, get_rerun_state_machine,
                                         initialize_rerun_state_machine)
from nvrx.launcher.rank.rerun.modes import RerunDiagnostic, RerunError, RerunMode, RerunState, ResultRejected
from nvrx.launcher.rank.rerun.tracker import RerunValidationStatus
from nvrx.launcher.rank.rerun.validators import SpikeDetector, is_nan_or_inf, relative_difference

__all__ = [
    "COMPARISON_MATCH", "COMPARISON_MISMATCH", "RerunErrorInjector", "RerunValidationStatus",
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION", "EXIT_CODE_RESUME_TO_DISAMBIGUATE", "RerunDataIterator",
    "RerunDiagnostic", "RerunError", "RerunMode", "RerunState", "RerunStateMachine", "ResultRejected",
    "SpikeDetector", "destroy_rerun_state_machine", "get_rerun_state_machine", "initialize_rerun_state_machine",
    "is_nan_or_inf", "relative_difference",
]
