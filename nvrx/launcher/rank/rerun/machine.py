"""``RerunStateMachine``: tell a transient fault from bad hardware from a real divergence (spec 003, 5-6).

The training loop runs each step inside ``while rsm.should_run_forward_backward(data_iterator):`` and
checks its results with ``rsm.validate_result(result, rejection_func, message, tolerance, fatal)``. The
machine decides whether the body runs again:

1. initial run: a result is rejected on some rank(s) (NaN, spike...) -> every rank re-runs the step in
   place, from the same RNG states and the same batches;
2. in place, not reproduced -> ``transient_error``: logged, counted, training goes on with the re-run;
   reproduced -> ``rsm.should_checkpoint_and_exit()`` says checkpoint and exit 16 (resume on other
   hardware; ``nvrx resume`` excludes the node);
3. the next job loads the machine from that checkpoint and re-runs the step from it: reproduced on the
   other hardware -> ``correct_result`` (exit 17 when the validation was fatal, else a warning);
   not reproduced -> ``persistent_error`` of the first node; landed on the suspected node again -> exit
   16 again without a verdict.

Every rank takes the same path: per-rank flags are combined by one all-reduce per step (the only cost of
a healthy step besides the RNG capture). Decisions are logged, written as ``rerun_*`` events for
`nvrx inspect`, and kept in ``<resume state dir>/rerun.json`` for `nvrx resume`. The machine's state
crosses the job boundary in the checkpoint (``state_dict``/``load_state_dict``; JSON, identical on every
rank, so a DCP checkpoint's de-duplication of replicated values keeps it whole).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NoReturn

import torch

from nvrx.launcher.rank.rerun import rng
from nvrx.launcher.rank.rerun.collective import all_gather_json, rank_and_world, reduce_max
from nvrx.launcher.rank.rerun.data import RerunDataIterator, fingerprint
from nvrx.launcher.rank.rerun.injector import RerunErrorInjector
from nvrx.launcher.rank.rerun.modes import (RerunDiagnostic, RerunError, RerunMode, RerunState, ResultRejected,
                                       parse_mode)
from nvrx.launcher.rank.rerun.report import Reporter, node_name, suspect_records
from nvrx.launcher.rank.rerun.tracker import RerunValidationStatus, Tracker, skipped_iterations
from nvrx.launcher.rank.rerun.validators import SpikeDetector, as_float, relative_difference, shown
from nvrx.events import RerunAttempt, RerunStats, RerunSuspected, RerunVerdict
from nvrx.common import exit_codes, rerun_exit

log = logging.getLogger("nvrx.launcher.rank.rerun")

EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = exit_codes.RESUME_ELSEWHERE     # Megatron's names for 16 and 17
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = exit_codes.VALIDATION_FAILED
STATE_VERSION = 1

DataIteratorArg = "RerunDataIterator | list[RerunDataIterator | None] | None"
RejectionFunc = Callable[[Any], Any]
ComparisonFunc = Callable[[float, float], float]


@dataclass
class _Call:
    """This rank's first rejected validation of the step: the call it must compare again in the re-runs."""

    message: str
    seq: int
    value: float
    fatal: bool


# The distribution of relative differences (report_determinism_stats): bucket name -> its upper bound.
BUCKETS: tuple[tuple[str, float], ...] = (("0", 0.0), ("<1e-12", 1e-12), ("<1e-9", 1e-9), ("<1e-6", 1e-6),
                                         ("<1e-3", 1e-3), (">=1e-3", math.inf))


@dataclass
class _Stat:
    """Determinism statistics of one validate_result message (mode report_determinism_stats)."""

    count: int = 0
    nonzero: int = 0
    max_diff: float = 0.0
    total: float = 0.0
    buckets: dict[str, int] | None = None

    def add(self, diff: float) -> None:
        self.count += 1
        self.nonzero += diff != 0.0
        self.max_diff = max(self.max_diff, diff if math.isfinite(diff) else 1e308)
        self.total += diff if math.isfinite(diff) else 0.0
        name = next((b for b, bound in BUCKETS if (diff <= bound if bound == 0.0 else diff < bound)), ">=1e-3")
        self.buckets = self.buckets or {}
        self.buckets[name] = self.buckets.get(name, 0) + 1

    def merge(self, other: dict[str, Any]) -> None:
        """Add another rank's statistics (as to_json() gave them)."""
        self.count += int(other["count"])
        self.nonzero += int(other["nonzero"])
        self.max_diff = max(self.max_diff, float(other["max_diff"]))
        self.total += float(other["total"])
        self.buckets = self.buckets or {}
        for name, n in other["buckets"].items():
            self.buckets[name] = self.buckets.get(name, 0) + int(n)

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "nonzero": self.nonzero, "max_diff": self.max_diff, "total": self.total,
                "buckets": self.buckets or {}}


class RerunStateMachine:
    """Validate step results and re-run suspicious steps to find out why (see the module docstring).

    Args:
        state_save_func: optional; returns extra state that a step changes before the optimizer step and
            that a re-run needs back (RNG states and RerunDataIterator positions are handled already).
        state_restore_func: optional; puts back what state_save_func returned.
        mode: ``"disabled"`` (default), ``"validate_results"`` or ``"report_determinism_stats"``.
        error_injector: a ``RerunErrorInjector`` to rehearse the diagnoses (default: none injected).
        result_rejected_tracker_filename: optional text file every rank appends its rejected results and
            re-run outcomes to (Megatron's format; ``get_skipped_iterations_from_tracker_file`` reads it).
        event_dir: where rank 0 writes ``rerun-<node>-<rank>.jsonl`` (default: ``NVRX_RUN_LOG_DIR``, set by
            `nvrx launch`; none outside it).
        resume_state_dir: where rank 0 writes ``rerun.json`` for `nvrx resume` (default:
            ``NVRX_RESUME_STATE_DIR``, set by `nvrx resume`).
        process_group: the group whose ranks decide together (default: the world).
        stats_interval: report_determinism_stats: report every this many steps.
    """

    def __init__(self, state_save_func: Callable[[], Any] | None = None,
                 state_restore_func: Callable[[Any], None] | None = None,
                 mode: RerunMode | str = RerunMode.DISABLED, error_injector: RerunErrorInjector | None = None,
                 result_rejected_tracker_filename: str | None = None, *, event_dir: Any = None,
                 resume_state_dir: Any = None, process_group: Any = None, stats_interval: int = 100) -> None:
        self.mode = parse_mode(mode)
        if error_injector is not None and not isinstance(error_injector, RerunErrorInjector):
            raise RerunError(f"error_injector must be a RerunErrorInjector or None, not {type(error_injector).__name__}")
        self.error_injector = error_injector or RerunErrorInjector()
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        self._tracker = Tracker(result_rejected_tracker_filename) if result_rejected_tracker_filename else None
        for name, fn in (("state_save_func", state_save_func), ("state_restore_func", state_restore_func)):
            if fn is not None and not callable(fn):
                raise RerunError(f"{name} must be a function or None, not {type(fn).__name__}")
        if not isinstance(stats_interval, int) or isinstance(stats_interval, bool) or stats_interval < 1:
            raise RerunError(f"stats_interval must be an integer >= 1, not {stats_interval!r}")
        self.state_save_func, self.state_restore_func = state_save_func, state_restore_func
        self.group, self.stats_interval = process_group, stats_interval
        self._event_dir, self._resume_dir = event_dir, resume_state_dir
        self._reporter: Reporter | None = None
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1                  # the step being run (0, 1, ...)
        self.transient_errors = 0
        self.verdicts: list[dict[str, Any]] = []     # every diagnosis so far (step, diagnosis, suspects)
        self._calls: dict[str, int] = {}             # validate_result calls per message in this pass
        self._failed: _Call | None = None
        self._rerun_value: float | None = None       # the failed call's value in the latest re-run
        self._reproduced = False
        self._suspects: list[dict[str, Any]] = []    # every rank's suspicion (identical on all ranks)
        self._fingerprints: list[int] | None = None  # each rank's CRC of the suspected step's batches
        self._rng: rng.RngState | None = None        # the generators at the start of the step
        self._other: Any = None
        self._ckpt_rng: list[dict[str, Any]] | None = None  # every rank's generators, for the checkpoint
        self._exit: tuple[bool, bool, int] = (False, False, 0)
        self._detectors: dict[str, SpikeDetector] = {}
        self._values: dict[tuple[str, int], float] = {}
        self._stats: dict[str, _Stat] = {}
        self.determinism_stats: dict[str, dict[str, Any]] = {}  # the last report (all ranks combined)
        log.info("RerunStateMachine in mode %s", self.mode.value)

    # ------------------------------------------------------------------ Megatron-style accessors

    def set_mode(self, mode: RerunMode | str) -> None:
        """Change the mode (between steps)."""
        self.mode = parse_mode(mode)

    def get_mode(self) -> RerunMode:
        return self.mode

    # ------------------------------------------------------------------ the loop

    def should_run_forward_backward(self, data_iterator: Any) -> bool:
        """Whether to run the step's forward/backward (again): the condition of the step's while loop.

        DATA_ITERATOR: the RerunDataIterator the step draws from (a list of them, or None).
        """
        if self.mode is RerunMode.DISABLED:
            if self.state is RerunState.INITIAL_RUN:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            return True
        iters = self._iterators(data_iterator)
        step = {RerunState.NOT_RUNNING_YET: self._start_step,
                RerunState.INITIAL_RUN: self._after_initial_run,
                RerunState.RERUNNING_IN_PLACE: self._after_rerun_in_place,
                RerunState.WILL_RERUN_FROM_CHECKPOINT: self._start_checkpoint_rerun,
                RerunState.RERUNNING_FROM_CHECKPOINT: self._after_checkpoint_rerun}[self.state]
        return step(iters)

    # Megatron's older name of the same method
    should_rerun_forward_and_backward = should_run_forward_backward

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """After the step's loop: (save a checkpoint now?, exit now?, the exit code).

        (True, True, 16): reproduced in place -> checkpoint, then exit to re-run on other hardware;
        (False, True, 16): the re-run from the checkpoint landed on the suspected hardware -> exit again;
        (False, True, 17): a fatal result is correct (reproduced on other hardware) -> stop for good.
        """
        return self._exit

    def maybe_checkpoint_and_exit(self, state_dict: dict[str, Any], path: Any, checkpointer: Any = None) -> None:
        """Act on should_checkpoint_and_exit(): save STATE_DICT to PATH with the ``nvrx.ckpt`` package (collective,
        waited for until durable) and/or exit with the code. Does nothing on a healthy step.

        Put the machine itself into STATE_DICT (``state["rerun"] = rsm``) so the next job loads it back.
        """
        save, leave, code = self._exit
        if save:
            import nvrx.ckpt as ckpt
            cp = checkpointer or ckpt.checkpointer()
            cp.async_save(state_dict, path)
            cp.finalize_before_exit()
            self._say(logging.WARNING, "saved the checkpoint %s to re-run step %d on other hardware", path,
                      self.current_iteration)
        if leave:
            self.exit(code)

    def exit(self, code: int) -> NoReturn:
        """Close the event file and exit the rank with CODE (16 or 17)."""
        if self._reporter is not None:
            self._reporter.close()
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(code)

    # ------------------------------------------------------------------ validation

    def validate_result(self, result: Any, rejection_func: RejectionFunc, message: str = "unexpected result",
                        comparison_func: ComparisonFunc | None = None, tolerance: float = 0.0,
                        fatal: bool = True) -> None:
        """Check RESULT (a number or a one-element tensor) inside the step's loop.

        REJECTION_FUNC(result) -> true when the result is wrong (``is_nan_or_inf``, a ``SpikeDetector``,
        ``torch.isnan``...). MESSAGE names the check in logs and events. In a re-run, the result of the same
        call is compared with the rejected one: COMPARISON_FUNC(a, b) -> a difference (default: relative),
        at most TOLERANCE counts as reproduced. FATAL: stop the job (exit 17) when the result turns out to
        be correct, i.e. deterministic; else continue with a warning.
        """
        self._check_call(result, rejection_func, message, comparison_func, tolerance, fatal)
        if self.mode is RerunMode.DISABLED:
            self._validate_disabled(result, rejection_func, message, fatal)
            return
        if self.state not in (RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE,
                              RerunState.RERUNNING_FROM_CHECKPOINT):
            raise RerunError("validate_result is called outside the step's loop: call it inside "
                             "`while rsm.should_run_forward_backward(data_iterator): ...`")
        seq = self._calls[message] = self._calls.get(message, 0) + 1
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._record_for_stats(message, seq, result, comparison_func)
            return
        if self.state is RerunState.INITIAL_RUN:
            if self._failed is None and (self._injected() or self._rejects(rejection_func, result, message)):
                self._failed = _Call(message, seq, as_float(result), bool(fatal))
                log.error("step %d: rank %d on %s: unexpected result %s (%s, call %d); re-running the step",
                          self.current_iteration, self._rank(), node_name(), shown(self._failed.value), message, seq)
                self._track(RerunValidationStatus.INITIAL_RUN, self._failed.value, message)
            return
        failed = self._failed
        if failed is not None and (failed.message, failed.seq) == (message, seq):
            self._rerun_value = as_float(result)
            diff = self.error_injector.maybe_miscompare(
                lambda a, b: self._compare(comparison_func, a, b, message), _like(failed.value, result), result,
                self.state)
            self._reproduced = diff <= tolerance
            self._track_rerun(message)

    def _injected(self) -> bool:
        self.error_injector.rank = self._rank()
        return self.error_injector.maybe_inject()

    def _track(self, status: RerunValidationStatus, value: float | None, message: str) -> None:
        if self._tracker is not None:
            self._tracker.record(status, node=node_name(), device=_device(), rank=self._rank(),
                                 iteration=self.current_iteration, result=shown(value), message=message)

    def _track_rerun(self, message: str) -> None:
        """The tracker line of a re-run's outcome at the rejected call (none when it landed on the same node)."""
        if self._tracker is None:
            return
        S = RerunValidationStatus
        if self.state is RerunState.RERUNNING_IN_PLACE:
            status = S.FIRST_RERUN_REPRODUCIBLE if self._reproduced else S.FIRST_RERUN_NOT_REPRODUCIBLE
        else:
            mine = next((s for s in self._suspects if s["rank"] == self._rank()), None)
            if mine is not None and (node_name(), _device()) == (mine["node"], mine.get("device")):
                return
            status = S.SECOND_RERUN_REPRODUCIBLE if self._reproduced else S.SECOND_RERUN_NOT_REPRODUCIBLE
        self._track(status, self._rerun_value, message)

    @classmethod
    def get_skipped_iterations_from_tracker_file(cls, tracker_file_name: str) -> list[int]:
        """The steps to skip according to a tracker file (nvrx.launcher.rank.rerun.tracker.skipped_iterations)."""
        return skipped_iterations(tracker_file_name)

    def is_unexpectedly_large(self, result: Any, threshold: float, context: str, num_samples: int = 100,
                              resample: bool = False) -> bool:
        """A rejection function: RESULT above THRESHOLD x the running max of the last NUM_SAMPLES accepted
        values of CONTEXT (after NUM_SAMPLES values). Its memory is kept in the machine's checkpoint.

        ``functools.partial(rsm.is_unexpectedly_large, threshold=10, context="loss")`` as rejection_func.
        """
        det = self._detectors.get(context)
        if det is None or resample:
            det = self._detectors[context] = SpikeDetector(factor=threshold, window=num_samples,
                                                           min_samples=num_samples)
        return det(result)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self, data_iterator: Any = None, ckpt_format: str = "torch_dist",
                   force: bool = False) -> dict[str, str]:
        """The machine as one JSON string (``{"json": ...}``), the same on every rank; a DCP Stateful.

        DATA_ITERATOR, CKPT_FORMAT and FORCE are accepted for Megatron's signature; the data position is the
        user's own (its loader resumes at the step), checked by the batches' fingerprint.
        """
        snap = {"version": STATE_VERSION, "mode": self.mode.value, "state": self.state.value,
                "current_iteration": self.current_iteration, "transient_errors": self.transient_errors,
                "suspects": self._suspects, "fingerprints": self._fingerprints, "rng": self._ckpt_rng,
                "world_size": rank_and_world(self.group)[1], "verdicts": self.verdicts[-20:],
                "detectors": {k: d.state_dict() for k, d in self._detectors.items()},
                "injector": self.error_injector.state_dict()}
        return {"json": json.dumps(snap, separators=(",", ":"))}

    def validate_state_dict(self, state_dict: Any) -> bool:
        """Whether STATE_DICT (what state_dict() gave) holds a step to re-run (Megatron's check before loading)."""
        try:
            return json.loads(state_dict["json"])["state"] != RerunState.NOT_RUNNING_YET.value
        except (KeyError, TypeError, ValueError):
            return False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the machine back from a checkpoint (what state_dict() gave); mode ``disabled`` ignores it."""
        if self.mode is RerunMode.DISABLED:
            self._say(logging.WARNING, "RerunStateMachine is disabled: ignoring the re-run state in the checkpoint")
            return
        try:
            snap = json.loads(state_dict["json"])
            if snap.get("version") != STATE_VERSION:
                raise ValueError(f"unknown version {snap.get('version')!r}")
            state = RerunState(snap["state"])
            detectors = {}
            for k, d in snap.get("detectors", {}).items():
                det = detectors[k] = SpikeDetector()
                det.load_state_dict(d)
            rng_states = snap.get("rng")
            injector = RerunErrorInjector()
            if snap.get("injector"):
                injector.load_state_dict(snap["injector"])
            if state is RerunState.WILL_RERUN_FROM_CHECKPOINT and not rng_states:
                raise ValueError("no RNG states for the step to re-run")
        except (KeyError, TypeError, ValueError) as exc:
            raise RerunError(f"the re-run state in the checkpoint is unreadable ({exc})") from None
        self.current_iteration = int(snap["current_iteration"])
        self.transient_errors = int(snap.get("transient_errors", 0))
        self.verdicts = list(snap.get("verdicts", []))
        self._detectors = detectors
        if injector.should_inject_errors or not self.error_injector.should_inject_errors:
            self.error_injector = injector  # an injection under diagnosis comes back with the machine
        self.state = state if state is RerunState.WILL_RERUN_FROM_CHECKPOINT else RerunState.NOT_RUNNING_YET
        if self.state is RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self._suspects, self._fingerprints, self._ckpt_rng = snap["suspects"], snap.get("fingerprints"), rng_states
            self._rng = None
            if snap.get("world_size") != rank_and_world(self.group)[1]:
                self._say(logging.WARNING, "the checkpoint's re-run state is from %s ranks, this job has %d: the "
                          "data fingerprints are not checked", snap.get("world_size"), rank_and_world(self.group)[1])
                self._fingerprints = None
            self._say(logging.WARNING, "loaded the re-run state: step %d will be re-run (suspected: %s)",
                      self.current_iteration, _who(self._suspects))

    # ------------------------------------------------------------------ steps of the state machine

    def _start_step(self, iters: list[RerunDataIterator]) -> bool:
        """A new step: capture what a re-run needs (RNG, extra state, batch boundary)."""
        self.current_iteration += 1
        self._begin_pass()
        self._failed, self._exit = None, (False, False, 0)
        self._rng = rng.capture()
        self._other = self.state_save_func() if self.state_save_func else None
        for it in iters:
            it.advance()
        self.state = RerunState.INITIAL_RUN
        return True

    def _after_initial_run(self, iters: list[RerunDataIterator]) -> bool:
        """Every rank re-runs if any rank rejected a result (stats mode: always)."""
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self._rewind(iters)
            self.state = RerunState.RERUNNING_IN_PLACE
            return True
        (rejected,) = reduce_max([int(self._failed is not None)], self.group)
        if not rejected:
            self.state = RerunState.NOT_RUNNING_YET
            return False
        mine = self._suspect() if self._failed is not None else None
        shared = all_gather_json({"suspect": mine, "crc": fingerprint(_batches(iters))}, self.group)
        self._suspects = [x["suspect"] for x in shared if x["suspect"] is not None]
        self._fingerprints = [int(x["crc"]) for x in shared]
        self._say(logging.WARNING, "step %d: unexpected result on %s: re-running the step in place",
                  self.current_iteration, _who(self._suspects))
        self._events().emit(RerunSuspected(step=self.current_iteration, suspects=suspect_records(self._suspects)))
        self._rewind(iters)
        self.state = RerunState.RERUNNING_IN_PLACE
        return True

    def _after_rerun_in_place(self, iters: list[RerunDataIterator]) -> bool:
        """Not reproduced -> transient; reproduced -> back to the step's start, checkpoint and exit 16."""
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            self.state = RerunState.NOT_RUNNING_YET
            self._maybe_report_stats()
            return False
        reproduced, missed = reduce_max([int(self._failed is not None and self._reproduced),
                                         int(self._failed is not None and self._rerun_value is None)], self.group)
        self._check_reached(missed)
        self._share_rerun_results()
        if not reproduced:
            self._events().emit(RerunAttempt(step=self.current_iteration, where="in_place", reproduced=False,
                                             next="verdict", suspects=suspect_records(self._suspects)))
            self.transient_errors += 1
            self._verdict(RerunDiagnostic.TRANSIENT_ERROR, None)
            self.state = RerunState.NOT_RUNNING_YET
            return False
        self._rewind(iters)  # the checkpoint holds the step's start: RNG and data as before the step
        self._ckpt_rng = [x for x in all_gather_json(rng.to_json(self._rng), self.group)] if self._rng else None
        self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        self._exit = (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        self._say(logging.ERROR, "step %d: the unexpected result reproduced in place on %s: saving a checkpoint and "
                  "exiting with %d to re-run the step on other hardware", self.current_iteration, _who(self._suspects),
                  EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        self._events().emit(RerunAttempt(step=self.current_iteration, where="in_place", reproduced=True,
                                next="checkpoint_and_exit", suspects=suspect_records(self._suspects)))
        self._resume_record(None, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        self._note_exit()
        return False

    def _start_checkpoint_rerun(self, iters: list[RerunDataIterator]) -> bool:
        """The job resumed from the re-run checkpoint: run the suspected step (current_iteration) again, from
        its RNG states."""
        self._begin_pass()
        rank = self._rank()
        if self._ckpt_rng is not None and rank < len(self._ckpt_rng):
            self._rng = rng.from_json(self._ckpt_rng[rank])
        if self._rng is not None:
            rng.restore(self._rng)
        mine = next((s for s in self._suspects if s["rank"] == rank), None)
        self._failed = (_Call(mine["message"], int(mine["call"]), float(mine["result"]), bool(mine["fatal"]))
                        if mine is not None else None)
        self._exit = (False, False, 0)
        for it in iters:
            it.advance()
        self.state = RerunState.RERUNNING_FROM_CHECKPOINT
        return True

    def _after_checkpoint_rerun(self, iters: list[RerunDataIterator]) -> bool:
        """Reproduced on other hardware -> correct result; not reproduced -> persistent error of the first node."""
        rank = self._rank()
        mine = next((s for s in self._suspects if s["rank"] == rank), None)
        same_hw = mine is not None and (node_name(), _device()) == (mine["node"], mine.get("device"))
        crc = self._fingerprints[rank] if self._fingerprints and rank < len(self._fingerprints) else None
        other_data = crc is not None and fingerprint(_batches(iters)) != crc
        reproduced, missed, same, bad_data = reduce_max(
            [int(self._failed is not None and self._reproduced), int(self._failed is not None and not same_hw
                                                                     and self._rerun_value is None),
             int(same_hw), int(other_data)], self.group)
        if bad_data:
            raise RerunError(f"step {self.current_iteration} re-run from the checkpoint got other batches than the "
                             "suspected run: resume the data iterator at that step (its position is the "
                             "checkpoint's step) and wrap it in RerunDataIterator")
        if same:
            return self._landed_on_same_hardware(iters)
        self._check_reached(missed)
        self._share_rerun_results()
        self._events().emit(RerunAttempt(step=self.current_iteration, where="from_checkpoint",
                                         reproduced=bool(reproduced), same_hardware=False, next="verdict",
                                         suspects=suspect_records(self._suspects)))
        fatal = any(s.get("fatal") for s in self._suspects)
        if reproduced:
            code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION if fatal else None
            self._verdict(RerunDiagnostic.CORRECT_RESULT, code)
            self._exit = (False, True, code) if code is not None else (False, False, 0)
        else:
            self._verdict(RerunDiagnostic.PERSISTENT_ERROR, None)
        self._suspects, self._fingerprints, self._ckpt_rng, self._failed = [], None, None, None
        self.state = RerunState.NOT_RUNNING_YET
        return False

    def _landed_on_same_hardware(self, iters: list[RerunDataIterator]) -> bool:
        """The re-run from the checkpoint ran on a suspected node: no verdict possible; exit 16 again."""
        self._say(logging.ERROR, "step %d: re-running from the checkpoint on the suspected hardware again (%s): "
                  "exiting with %d to be resumed elsewhere", self.current_iteration, _who(self._suspects),
                  EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        self._events().emit(RerunAttempt(step=self.current_iteration, where="from_checkpoint", reproduced=False,
                                same_hardware=True, next="exit_again", suspects=suspect_records(self._suspects)))
        self._rewind(iters)
        self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        self._exit = (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        self._resume_record(None, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        self._note_exit()
        return False

    # ------------------------------------------------------------------ helpers

    def _note_exit(self) -> None:
        """Tell this rank's agent which node(s) the coming exit 16 is about (every rank exits 16; only the
        suspected nodes should leave the job: nvrx.common.rerun_exit)."""
        rerun_exit.write_note(self.current_iteration, [s["node"] for s in self._suspects])

    def _begin_pass(self) -> None:
        self._calls = {}
        self._rerun_value, self._reproduced = None, False

    def _rewind(self, iters: list[RerunDataIterator]) -> None:
        """Back to the step's start: generators, extra state, batches."""
        if self._rng is not None:
            rng.restore(self._rng)
        if self._other is not None and self.state_restore_func is not None:
            self.state_restore_func(self._other)
        for it in iters:
            it.rewind()
        self._begin_pass()

    def _check_reached(self, missed: int) -> None:
        if missed:
            raise RerunError(f"step {self.current_iteration}: the re-run did not reach the rejected validate_result "
                             "call again: the step's control flow must not depend on anything but its RNG and data")

    def _suspect(self) -> dict[str, Any]:
        f = self._failed
        assert f is not None
        return {"rank": self._rank(), "node": node_name(), "device": _device(), "message": f.message, "call": f.seq,
                "result": shown(f.value), "fatal": f.fatal}

    def _share_rerun_results(self) -> None:
        """Add each suspect's re-run result and node to the shared suspects list."""
        mine = {"rank": self._rank(), "value": shown(self._rerun_value), "node": node_name()}
        got = {x["rank"]: x for x in all_gather_json(mine, self.group)}
        for s in self._suspects:
            r = got.get(s["rank"])
            if r is not None:
                s["rerun_result"], s["rerun_node"] = r["value"], r["node"]

    def _verdict(self, diagnosis: RerunDiagnostic, exit_code: int | None) -> None:
        fatal = any(s.get("fatal") for s in self._suspects)
        action = "exit" if exit_code is not None else "continue"
        entry = {"step": self.current_iteration, "diagnosis": diagnosis.value, "exit_code": exit_code,
                 "suspects": [dict(s) for s in self._suspects]}
        self.verdicts.append(entry)
        text = {RerunDiagnostic.TRANSIENT_ERROR: "possible transient error (not reproduced in place); continuing",
                RerunDiagnostic.PERSISTENT_ERROR: "possible persistent error of the first hardware (not reproduced "
                                                  "on other hardware)",
                RerunDiagnostic.CORRECT_RESULT: "the result is correct (reproduced on other hardware): a problem of "
                                                "the model or the data, not of the hardware"}[diagnosis]
        level = logging.ERROR if diagnosis is not RerunDiagnostic.TRANSIENT_ERROR else logging.WARNING
        self._say(level, "step %d: %s: %s%s", self.current_iteration, _who(self._suspects), text,
                f"; exiting with {exit_code}" if exit_code is not None else "")
        self._events().emit(RerunVerdict(step=self.current_iteration, diagnosis=diagnosis.value, action=action,
                                exit_code=exit_code, fatal=fatal, suspects=suspect_records(self._suspects)))
        if diagnosis is not RerunDiagnostic.TRANSIENT_ERROR:
            self._resume_record(diagnosis, exit_code)

    def _resume_record(self, diagnosis: RerunDiagnostic | None, exit_code: int | None) -> None:
        self._report().resume_record({
            "step": self.current_iteration, "state": self.state.value,
            "diagnosis": diagnosis.value if diagnosis else None, "exit_code": exit_code,
            "suspects": [{k: s.get(k) for k in ("rank", "node", "device", "message", "result", "rerun_result",
                                                "rerun_node")} for s in self._suspects]})

    def _say(self, level: int, msg: str, *args: Any) -> None:
        """Log a job-wide decision once (rank 0): every rank takes it, so every rank would say it."""
        if self._rank() == 0:
            log.log(level, msg, *args)

    def _events(self) -> Any:
        """Where this rank writes its events (rank 0: the run's rerun file; others: nowhere)."""
        return self._report().events()

    def _report(self) -> Reporter:
        if self._reporter is None:
            self._reporter = Reporter(self._rank(), self._event_dir, self._resume_dir)
        return self._reporter

    def _rank(self) -> int:
        return rank_and_world(self.group)[0]

    def _iterators(self, data_iterator: Any) -> list[RerunDataIterator]:
        items = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        iters = [d for d in items if d is not None]
        for d in iters:
            if not isinstance(d, RerunDataIterator):
                raise RerunError(f"the data iterator is a {type(d).__name__}: wrap it in "
                                 "launcher.rank.rerun.RerunDataIterator so a re-run sees the same batches")
        return iters

    def _check_call(self, result: Any, rejection_func: Any, message: Any, comparison_func: Any, tolerance: Any,
                    fatal: Any) -> None:
        """validate_result's arguments, checked on every call (cheap): one clear error for each misuse."""
        if not callable(rejection_func):
            raise RerunError(f"rejection_func must be a function, not {type(rejection_func).__name__}")
        if comparison_func is not None and not callable(comparison_func):
            raise RerunError(f"comparison_func must be a function or None, not {type(comparison_func).__name__}")
        if not isinstance(message, str):
            raise RerunError(f"message must be a string, not {type(message).__name__}")
        if (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance)
                or tolerance < 0):
            raise RerunError(f"tolerance must be a finite number >= 0, not {tolerance!r}")
        if isinstance(result, torch.Tensor):
            if result.numel() == 1:
                return
            what = f"a tensor of shape {list(result.shape)}"
        elif isinstance(result, (int, float)) and not isinstance(result, bool):
            return
        else:
            what = f"a {type(result).__name__}"
        raise RerunError(f"validate_result needs a scalar result (a number or a one-element tensor), got {what} "
                         f"({message!r}): reduce it first, e.g. loss.mean()")

    def _rejects(self, rejection_func: RejectionFunc, result: Any, message: str) -> bool:
        """REJECTION_FUNC's verdict as a bool; RerunError if it raises or answers something else."""
        try:
            return bool(rejection_func(result))
        except Exception as exc:
            name = getattr(rejection_func, "__name__", type(rejection_func).__name__)
            text = " ".join(str(exc).split()) or "(no message)"
            raise RerunError(f"rejection_func {name} raised {type(exc).__name__}: {text} "
                             f"(validate_result {message!r}, step {self.current_iteration})") from None

    def _compare(self, comparison_func: ComparisonFunc | None, first: Any, again: Any, message: str) -> float:
        """COMPARISON_FUNC(first, again) as a float (default: the relative difference); RerunError if it fails.
        Both are of the result's type (a tensor result: tensors, as Megatron's comparison functions expect)."""
        if comparison_func is None:
            return relative_difference(as_float(first), as_float(again))
        try:
            return float(comparison_func(first, again))
        except Exception as exc:
            name = getattr(comparison_func, "__name__", type(comparison_func).__name__)
            text = " ".join(str(exc).split()) or "(no message)"
            raise RerunError(f"comparison_func {name} raised {type(exc).__name__}: {text} "
                             f"(validate_result {message!r}, step {self.current_iteration})") from None

    def _validate_disabled(self, result: Any, rejection_func: RejectionFunc, message: str, fatal: bool) -> None:
        if not self._rejects(rejection_func, result, message):
            return
        text = (f"rank {self._rank()}, node {node_name()}, step {self.current_iteration}: unexpected result "
                f"{shown(as_float(result))} ({message})")
        self._track(RerunValidationStatus.RERUN_DISABLED, as_float(result), message)
        if fatal:
            raise ResultRejected(text)
        log.warning("%s", text)

    def _record_for_stats(self, message: str, seq: int, result: Any, comparison_func: ComparisonFunc | None) -> None:
        value = as_float(result)
        if self.state is RerunState.INITIAL_RUN:
            self._values[(message, seq)] = value
            return
        first = self._values.pop((message, seq), None)
        if first is None:
            raise RerunError(f"step {self.current_iteration}: the re-run made a validate_result call ({message!r} "
                             f"#{seq}) the first run did not: the step's control flow must be deterministic")
        self._stats.setdefault(message, _Stat()).add(self._compare(comparison_func, _like(first, result), result,
                                                                   message))

    def _maybe_report_stats(self) -> None:
        """Every stats_interval steps: combine every rank's statistics (JSON), log and emit them on rank 0."""
        self._values.clear()
        if (self.current_iteration + 1) % self.stats_interval:
            return
        combined: dict[str, _Stat] = {}
        for ranks in all_gather_json({k: st.to_json() for k, st in self._stats.items()}, self.group):
            for k, st in ranks.items():
                combined.setdefault(k, _Stat()).merge(st)
        self._stats = {}
        first = self.current_iteration + 1 - self.stats_interval
        for k, c in sorted(combined.items()):
            mean = c.total / c.count if c.count else 0.0
            buckets = {b: c.buckets[b] for b, _ in BUCKETS if c.buckets and b in c.buckets}
            self.determinism_stats[k] = {"steps": [first, self.current_iteration], "count": c.count,
                                         "nonzero": c.nonzero, "max_diff": c.max_diff, "mean_diff": mean,
                                         "buckets": buckets}
            self._say(logging.INFO, "determinism of %r over steps %d-%d: %d comparisons, %d differed, max %.3g, "
                      "mean %.3g, relative differences %s", k, first, self.current_iteration, c.count, c.nonzero,
                      c.max_diff, mean, buckets)
            self._events().emit(RerunStats(step=self.current_iteration, message=k, count=c.count,
                                           nonzero=c.nonzero, max_diff=c.max_diff, mean_diff=mean,
                                           buckets=buckets))


def _batches(iters: Iterable[RerunDataIterator]) -> list[Any]:
    return [b for it in iters for b in it.step_batches()]


def _like(value: float, result: Any) -> Any:
    """VALUE as RESULT's type: a tensor of its dtype, shape and device, or a float."""
    if isinstance(result, torch.Tensor):
        return torch.tensor(value, dtype=result.dtype, device=result.device).reshape(result.shape)
    return value


def _device() -> int | None:
    """This rank's CUDA device, or None on a CPU-only rank (the seam: CPU is the path tested here)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _who(suspects: list[dict[str, Any]]) -> str:
    return ", ".join(f"rank {s['rank']} on {s['node']} ({s['message']}: {s['result']})" for s in suspects) or "?"


# ---------------------------------------------------------------------- Megatron's module-level helpers

_MACHINE: RerunStateMachine | None = None


def initialize_rerun_state_machine(**kwargs: Any) -> RerunStateMachine:
    """Create the process's machine (arguments of RerunStateMachine)."""
    global _MACHINE
    _MACHINE = RerunStateMachine(**kwargs)
    return _MACHINE


def get_rerun_state_machine() -> RerunStateMachine:
    """The process's machine (a disabled one if none was initialized)."""
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = RerunStateMachine()
    return _MACHINE


def destroy_rerun_state_machine() -> None:
    global _MACHINE
    if _MACHINE is not None and _MACHINE._reporter is not None:
        _MACHINE._reporter.close()
    _MACHINE = None
