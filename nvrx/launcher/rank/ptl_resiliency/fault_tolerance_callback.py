"""``FaultToleranceCallback``: connects a Lightning ``Trainer.fit`` to the rank monitors of ``nvrx launch``.

What it does for a fit run (spec 001, "FT Integration Guide for PyTorch Lightning"):

- connects the rank to its monitor in ``setup`` and disconnects in ``teardown`` (or on an exception);
- heartbeats from the training loop: train start/batch end/end, validation start/batch end/end, after a
  checkpoint save (two saves in a row must not look like one long step) and on an exception;
- ``calculate_timeouts=True``: at the end of a job, learns heartbeat timeouts from what the monitor
  observed and keeps them across the job chain in ``<exp_dir>/_ft_state.json`` (``exp_dir`` defaults to
  ``trainer.log_dir/ft_state``); the next job loads them at setup. Timeouts are learned only once the
  observed intervals include a checkpoint load and a save (they lengthen the interval), so a chain that
  starts from scratch learns them at the end of its second job;
- ``autoresume=True``: writes the finished flag (``FAULT_TOL_FINISHED_FLAG_FILE``, see
  ``nvrx.launcher.rank.job_control.mark_finished``) when, and only when, training is complete, which ends an
  ``nvrx resume`` chain or an sbatch auto-resume loop;
- ``simulated_fault_params``: kills or stops one rank after a delay, to test the whole setup.

Under ``nvrx launch`` the rank has torchrun's environment (``TORCHELASTIC_RUN_ID`` and the rank
variables), so Lightning picks its ``TorchElasticEnvironment`` by itself: no extra Trainer flag.
"""

from __future__ import annotations

import logging
import os
import pathlib
import random
from typing import Any, Optional, Union

from nvrx.launcher.rank import job_control
from nvrx.launcher.rank.ptl_resiliency._lightning import Callback
from nvrx.launcher.rank.ptl_resiliency.simulated_fault import (FaultInjector, SimulatedFaultParams, choose_fault,
                                                          parse_simulated_fault_params)
from nvrx.monitors.client import RankMonitorClient
from nvrx.common.errors import ConfigError
from nvrx.common.files import load_json, save_json_atomic


class TrainingProgress:
    """What the callback has seen of one fit run; decides "training complete" and "may learn timeouts".

    The hooks record events; the two questions are answered from them, so the rules live in one place.
    """

    MIN_ITERS_FOR_TIMEOUT_UPDATE = 2

    def __init__(self) -> None:
        self.train_iters = 0
        self.heartbeats = 0
        self.heartbeats_at_last_save: int | None = None
        self.saw_checkpoint_save = False  # a save with heartbeats before and after it
        self.loaded_checkpoint = False
        self.failed = False  # an exception other than a clean SystemExit ended the run
        self.ended = False
        self.timeouts_updated = False

    def on_heartbeat(self) -> None:
        self.heartbeats += 1
        before = self.heartbeats_at_last_save
        if before is not None and before > 0 and self.heartbeats > before:
            self.saw_checkpoint_save = True

    def on_save(self) -> None:
        self.heartbeats_at_last_save = self.heartbeats

    def on_exception(self, exc: BaseException | None) -> None:
        # sys.exit(0) / SystemExit(None) is how e.g. a preemption callback stops training cleanly
        clean_stop = isinstance(exc, SystemExit) and not exc.code
        self.failed = self.failed or not clean_stop

    def is_training_completed(self, trainer: Any = None) -> bool:
        """True when the trainer reached its step or epoch limit, or a run with no failure found
        nothing left to do (at most one iteration: e.g. resumed from the final checkpoint, or a
        ``max_time`` budget already spent by the previous jobs)."""
        if self.ended and self.train_iters <= 1 and not self.failed:
            return True
        if trainer is None:
            return False
        max_steps, max_epochs = getattr(trainer, "max_steps", -1), getattr(trainer, "max_epochs", None)
        if isinstance(max_steps, int) and max_steps > 0 and trainer.global_step >= max_steps:
            return True
        return isinstance(max_epochs, int) and max_epochs > 0 and trainer.current_epoch >= max_epochs

    @property
    def can_update_timeouts(self) -> bool:
        """Once per run, after >= 2 iterations, a checkpoint load and a save followed by a heartbeat,
        and no failure: otherwise the observed intervals miss the slow moments of a real job."""
        return (not self.timeouts_updated and not self.failed
                and self.train_iters >= self.MIN_ITERS_FOR_TIMEOUT_UPDATE
                and self.loaded_checkpoint and self.saw_checkpoint_save)


class FaultToleranceCallback(Callback):
    """Lightning callback for fault tolerance under ``nvrx launch`` (active only in the ``fit`` stage).

    Same constructor as NVRx's; see the module docstring for what each option does.
    """

    TIMEOUTS_FILENAME = "_ft_state.json"
    FT_DIR_NAME = "ft_state"

    def __init__(self, autoresume: bool, calculate_timeouts: bool,
                 simulated_fault_params: Union[SimulatedFaultParams, dict, Any, None] = None,
                 exp_dir: Union[str, pathlib.Path, None] = None,
                 logger_name: Optional[str] = "nemo_logger.FaultToleranceCallback") -> None:
        """Light: checks the arguments only; the monitor connection is made in ``setup``.

        autoresume: write the finished flag when training is complete (needs FAULT_TOL_FINISHED_FLAG_FILE).
        calculate_timeouts: learn heartbeat timeouts and keep them across jobs in exp_dir.
        simulated_fault_params: a SimulatedFaultParams or a mapping of its fields; for testing only.
        exp_dir: where the state is kept across jobs (must exist and be shared by all jobs);
            default ``trainer.log_dir/ft_state``. Lightning may move files inside its log dir.
        logger_name: the logging.Logger to report to.
        """
        super().__init__()
        for name, value in (("autoresume", autoresume), ("calculate_timeouts", calculate_timeouts)):
            if not isinstance(value, bool):
                raise ConfigError(f"FaultToleranceCallback({name}={value!r}): expected True or False")
        self.logger = logging.getLogger(logger_name)
        self.autoresume = autoresume
        self.calculate_timeouts = calculate_timeouts
        self.simulated_fault_params = parse_simulated_fault_params(simulated_fault_params)
        self.provided_exp_dir = exp_dir
        self.timeouts_file_path: pathlib.Path | None = None
        self.fault_tol_client: RankMonitorClient | None = None
        self.progress: TrainingProgress | None = None
        self._fault: FaultInjector | None = None

    @property
    def is_initialized(self) -> bool:
        """True between a successful setup and the shutdown of the monitor connection."""
        return self.fault_tol_client is not None

    # ---------------------------------------------------------------- Lightning hooks

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.autoresume and not os.environ.get(job_control.FINISHED_FLAG_ENV):
            raise RuntimeError(f"FaultToleranceCallback(autoresume=True) needs {job_control.FINISHED_FLAG_ENV}: "
                               "run under `nvrx resume` or export it in the sbatch script")
        if self.is_initialized:
            raise RuntimeError("FaultToleranceCallback is already set up: one fit at a time per callback")
        self.progress = TrainingProgress()
        self._setup_fault_tolerance(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # after an exception on_exception has already disconnected
        if stage != "fit" or not self.is_initialized:
            return
        self.progress.ended = True
        self._cancel_fault()
        if trainer.is_global_zero and self.autoresume and self.progress.is_training_completed(trainer):
            path = job_control.mark_finished()
            self.logger.info("training complete: finished flag written to %s", path)
        self._heartbeat()
        self._maybe_update_timeouts(trainer)
        self._shutdown()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._heartbeat()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if self.is_initialized:
            self.progress.train_iters += 1
            self._heartbeat()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._heartbeat()

    # validation and checkpoint hooks also run outside fit (trainer.validate): only act when connected
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._heartbeat()

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._heartbeat()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._heartbeat()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if self.is_initialized:
            self.progress.loaded_checkpoint = True

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if self.is_initialized:
            self.progress.on_save()
            self._heartbeat()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not self.is_initialized:
            return
        self.progress.on_exception(exception)
        self._cancel_fault()
        self._heartbeat()
        self._maybe_update_timeouts(trainer)
        self._shutdown()

    # ---------------------------------------------------------------- setup / shutdown

    def _setup_fault_tolerance(self, trainer: Any) -> None:
        ft_dir = self._ft_dir(trainer)
        self.timeouts_file_path = ft_dir / self.TIMEOUTS_FILENAME
        client = RankMonitorClient()
        client.init_workload_monitoring()
        self.fault_tol_client = client
        try:
            self._maybe_load_timeouts(trainer)
            timeouts = client.hb_timeouts
            if not timeouts.are_valid and not self.calculate_timeouts:
                raise RuntimeError("FaultToleranceCallback: the heartbeat timeouts are not set and "
                                   "calculate_timeouts=False: set them (--ft-param-rank-heartbeat-timeout, "
                                   "--ft-param-initial-rank-heartbeat-timeout) or pass calculate_timeouts=True")
            self._info(trainer, "fault tolerance ready: dir %s, heartbeat timeouts %s", ft_dir,
                       timeouts if timeouts.are_valid else "not calculated yet")
            if self.simulated_fault_params is not None:
                self._setup_simulated_fault(trainer)
        except BaseException:
            self._shutdown()
            raise

    def _ft_dir(self, trainer: Any) -> pathlib.Path:
        if self.provided_exp_dir:
            ft_dir = pathlib.Path(self.provided_exp_dir)
        else:
            if trainer.log_dir is None:
                raise ConfigError("FaultToleranceCallback: the trainer has no log_dir; pass exp_dir=")
            ft_dir = pathlib.Path(trainer.log_dir) / self.FT_DIR_NAME
            if trainer.is_global_zero:
                ft_dir.mkdir(parents=True, exist_ok=True)
            trainer.strategy.barrier("nvrx_ft_dir")
        if not ft_dir.is_dir():
            raise ConfigError(f"FaultToleranceCallback: the fault tolerance directory {ft_dir} does not exist "
                              "(exp_dir must exist and be shared by every node and job)")
        return ft_dir

    def _shutdown(self) -> None:
        client, self.fault_tol_client = self.fault_tol_client, None
        self._cancel_fault()
        if client is not None:
            client.shutdown_workload_monitoring()

    # ---------------------------------------------------------------- heartbeats and timeouts

    def _heartbeat(self) -> None:
        if self.fault_tol_client is None:
            return
        self.fault_tol_client.send_heartbeat()
        self.progress.on_heartbeat()

    def _maybe_load_timeouts(self, trainer: Any) -> None:
        """Adopt the timeouts an earlier job learned (only with calculate_timeouts, as in NVRx)."""
        if not self.calculate_timeouts:
            return
        state = load_json(self.timeouts_file_path)
        if state:
            self.fault_tol_client.load_state_dict(state)
            self._info(trainer, "loaded fault tolerance timeouts from %s: %s", self.timeouts_file_path,
                       self.fault_tol_client.hb_timeouts)

    def _maybe_update_timeouts(self, trainer: Any) -> None:
        if not (self.calculate_timeouts and self.progress.can_update_timeouts):
            return
        updated = self.fault_tol_client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        self.progress.timeouts_updated = True
        if not updated:
            self._info(trainer, "heartbeat timeouts not updated: the monitor has too few observations")
            return
        # the state is the same on every rank: one writer is enough
        if trainer.is_global_zero:
            save_json_atomic(self.timeouts_file_path, self.fault_tol_client.state_dict())
        self._info(trainer, "heartbeat timeouts updated to %s, saved in %s", self.fault_tol_client.hb_timeouts,
                   self.timeouts_file_path)

    def _info(self, trainer: Any, msg: str, *args: Any) -> None:
        if trainer.is_global_zero:
            self.logger.info("[FaultToleranceCallback@rank0] " + msg, *args)

    # ---------------------------------------------------------------- simulated faults

    def _setup_simulated_fault(self, trainer: Any) -> None:
        # every rank must pick the same victim: draw from rank 0's seed
        seed = trainer.strategy.broadcast(random.randrange(2**63), src=0)
        victim, fault_type, delay = choose_fault(self.simulated_fault_params, trainer.world_size,
                                                 random.Random(seed))
        self._info(trainer, "simulated fault %s on rank %d in %.2f s", fault_type, victim, delay)
        if trainer.global_rank == victim:
            self._fault = FaultInjector(fault_type, delay, self.logger).start()

    def _cancel_fault(self) -> None:
        if self._fault is not None:
            self._fault.cancel()
            self._fault = None
