"""The re-run state machine's vocabulary: modes, states, diagnoses, and its two errors.

The names are Megatron-Core's (``megatron.core.rerun_state_machine``), so a Megatron user reads them as
they know them; the values are the strings that appear in the event logs, the checkpoint and the
resume state.
"""

from __future__ import annotations

from enum import Enum

from nvrx.common.errors import NvrxError


class RerunMode(str, Enum):
    """What the machine does with each step.

    DISABLED: validate_result only checks (a rejected fatal result raises, as without the machine).
    VALIDATE_RESULTS: a rejected result is re-run in place, then from a checkpoint on other hardware.
    REPORT_DETERMINISM_STATS: every step runs twice; the differences between the two are reported.
    """

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(str, Enum):
    """Where the machine is in a step (spec 003, section 5).

    NOT_RUNNING_YET: between steps.
    INITIAL_RUN: the step's first forward/backward.
    RERUNNING_IN_PLACE: the same step again on the same hardware, from the same RNG and data.
    WILL_RERUN_FROM_CHECKPOINT: the in-place re-run reproduced the result: checkpoint, exit 16, and
        re-run the step in the next job (also the state a resumed job loads from that checkpoint).
    RERUNNING_FROM_CHECKPOINT: the step re-run from the checkpoint, on other hardware.
    """

    NOT_RUNNING_YET = "not_running_yet"
    INITIAL_RUN = "initial_run"
    RERUNNING_IN_PLACE = "rerunning_in_place"
    WILL_RERUN_FROM_CHECKPOINT = "will_rerun_from_checkpoint"
    RERUNNING_FROM_CHECKPOINT = "rerunning_from_checkpoint"


class RerunDiagnostic(str, Enum):
    """The verdict on a rejected result.

    CORRECT_RESULT: reproduced in place and on other hardware: the result is what the inputs give
        (a diverging model, a data problem), not a hardware fault.
    TRANSIENT_ERROR: not reproduced by the in-place re-run: a one-off glitch; training goes on.
    PERSISTENT_ERROR: reproduced in place but not on other hardware: the first node is faulty.
    """

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunError(NvrxError, ValueError):
    """The machine was used wrongly (unknown mode, non-scalar result, a rejection_func that raised, a call
    outside the loop, a data iterator that did not resume at the step): one line that says what to fix."""


class ResultRejected(NvrxError, RuntimeError):
    """Mode ``disabled``: a fatal validation rejected a result (what the check does without the machine)."""


def parse_mode(mode: "RerunMode | str") -> RerunMode:
    """MODE as a RerunMode; RerunError naming the valid modes for anything else."""
    if isinstance(mode, RerunMode):
        return mode
    try:
        return RerunMode(mode)
    except ValueError:
        valid = ", ".join(m.value for m in RerunMode)
        raise RerunError(f"unknown re-run mode {mode!r}: use one of {valid}") from None
