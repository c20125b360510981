"""FaultToleranceCallback with a real Lightning Trainer (CPU, DDP, 2 ranks) under `nvrx launch`.

The slow tests run tests/compat/lightning_train.py as real jobs: a rank crash restarted in place ends with
the weights of a fault-free run; a chain of jobs sharing exp_dir learns heartbeat timeouts in the job
that first loads and saves a checkpoint, and the next job starts with them; the finished flag appears
only after the last step. The fast tests cover the argument checks, the fault injector (real processes
stopped / killed) and the rules that decide "training complete" and "may learn timeouts".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# lightning is in the test extras (scripts/setup.sh installs it): a missing one fails here, not skips
from nvrx.launcher.rank.ptl_resiliency import FaultToleranceCallback, SimulatedFaultParams
from nvrx.launcher.rank.ptl_resiliency.fault_tolerance_callback import TrainingProgress
from nvrx.launcher.rank.ptl_resiliency.simulated_fault import choose_fault, parse_simulated_fault_params
from nvrx.common.errors import ConfigError
from tests.conftest import REPO, Launcher, run_events, wait_for

TRAIN = Path(__file__).with_name("lightning_train.py")
MAX_STEPS = 12  # 3 epochs of 4 steps; checkpoints every 4 steps


# ---------------------------------------------------------------- helpers for the slow tests


def _launch(lau: Launcher, work: Path, tag: str, *flags: str, flag_file: Path | None = None, **cfg) \
        -> subprocess.CompletedProcess:
    """One `nvrx launch` of lightning_train.py (2 ranks); CFG goes to the script as JSON."""
    work.mkdir(exist_ok=True)
    cfg = {"work": str(work), "tag": tag, "max_steps": MAX_STEPS, **cfg}
    cfg.setdefault("ft", {"autoresume": False, "calculate_timeouts": False, "exp_dir": str(work)})
    env = {"FAULT_TOL_FINISHED_FLAG_FILE": str(flag_file)} if flag_file else {}
    res = lau.run("--nproc-per-node", "2", "--rdzv-id", tag, *flags, str(TRAIN), json.dumps(cfg),
                  env=env, timeout=150)
    return res


def _records(work: Path, tag: str) -> dict[tuple[int, int], dict]:
    """(attempt, rank) -> the record the rank wrote at the end of its fit."""
    out = {}
    for path in (work / "records").glob(f"{tag}.*.json"):
        rec = json.loads(path.read_text())
        out[rec["attempt"], rec["rank"]] = rec
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final weights of a fault-free run of the whole training in one job."""
    tmp = tmp_path_factory.mktemp("reference")
    lau = Launcher(tmp)
    try:
        res = _launch(lau, tmp / "work", "reference")
        assert res.returncode == 0, res.stderr[-3000:]
        recs = _records(tmp / "work", "reference")
        # nvrx launch gives the torchrun environment: Lightning picks TorchElasticEnvironment by itself
        assert {r["cluster_env"] for r in recs.values()} == {"TorchElasticEnvironment"}, recs
        assert {r["final_step"] for r in recs.values()} == {MAX_STEPS}
        return _weights(tmp / "work" / "final_reference.pt")
    finally:
        lau.cleanup()


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_crashed_rank_restarts_in_place_and_ends_with_the_fault_free_weights(launcher, tmp_path, reference):
    work, flag = tmp_path / "work", tmp_path / "finished.flag"
    ft = {"autoresume": True, "calculate_timeouts": False, "exp_dir": str(work)}
    # rank 1 exits abruptly after step 6 of the first attempt; the last checkpoint is from step 4
    res = _launch(launcher, work, "crash", "--max-restarts", "1", flag_file=flag, crash_at=6, ft=ft)
    assert res.returncode == 0, res.stderr[-3000:]
    exits = [e for e in run_events(tmp_path / "nvrx_logs" / "crash", "agent-") if e["ev"] == "rank_exit"]
    assert {(e["attempt"], e["rank"], e.get("exitcode")) for e in exits if e["attempt"] == 0} >= {(0, 1, 1)}
    recs = _records(work, "crash")
    assert set(recs) == {(1, 0), (1, 1)}  # the first attempt never finished its fit
    for rec in recs.values():
        assert rec["start_step"] == 4, rec  # resumed from the user's ModelCheckpoint
        assert rec["flag_at_start"] is False, rec  # the crashed attempt did not mark the run finished
        assert rec["final_step"] == MAX_STEPS
    assert flag.exists()
    assert _same_weights(_weights(work / "final_crash.pt"), reference)
    assert launcher.leftovers() == []


@pytest.mark.slow
def test_job_chain_keeps_learned_timeouts_and_flags_only_the_last_job(launcher, tmp_path, reference):
    work, exp_dir, flag = tmp_path / "work", tmp_path / "exp", tmp_path / "finished.flag"
    exp_dir.mkdir()
    state_file = exp_dir / FaultToleranceCallback.TIMEOUTS_FILENAME
    ft = {"autoresume": True, "calculate_timeouts": True, "exp_dir": str(exp_dir)}
    # every job has its own run id, hence its own monitor state dir: only exp_dir links the jobs.
    # A large safety factor keeps the learned (enforced) timeouts clear of a busy machine's stalls.
    flags = ("--ft-param-safety-factor", "50")

    # job 1 starts from scratch; a simulated fault kills a random rank, the launch restarts it in place
    fault = {"fault_type": "rank_killed", "base_delay": 0.0}
    job1 = _launch(launcher, work, "job1", *flags, "--max-restarts", "1", flag_file=flag, stop_at=4,
                   fault=fault, ft=ft)
    assert job1.returncode == 0, job1.stderr[-3000:]
    first = [e for e in run_events(tmp_path / "nvrx_logs" / "job1", "agent-")
             if e["ev"] == "rank_exit" and e["attempt"] == 0]
    assert "SIGKILL" in {e.get("signal") for e in first}, first
    assert {r["final_step"] for r in _records(work, "job1").values()} == {4}
    assert not flag.exists()  # stopped early: training is not complete
    assert not state_file.exists()  # no checkpoint was loaded: too early to learn timeouts

    # job 2 loads the step-4 checkpoint and saves more: it learns the timeouts and keeps them in exp_dir
    job2 = _launch(launcher, work, "job2", *flags, flag_file=flag, stop_at=8, ft=ft)
    assert job2.returncode == 0, job2.stderr[-3000:]
    recs2 = _records(work, "job2")
    assert {r["start_step"] for r in recs2.values()} == {4}
    learned = recs2[0, 0]["timeouts_at_end"]
    assert learned["were_calculated"] is True and learned != recs2[0, 0]["timeouts_at_start"], recs2
    assert learned["subsequent"] < 2700.0  # the configured default was replaced
    assert state_file.exists()
    assert not flag.exists()

    # job 3 starts with job 2's timeouts and finishes the training
    job3 = _launch(launcher, work, "job3", *flags, flag_file=flag, ft=ft)
    assert job3.returncode == 0, job3.stderr[-3000:]
    recs3 = _records(work, "job3")
    for rec in recs3.values():
        assert rec["timeouts_at_start"] == learned, rec
        assert rec["flag_at_start"] is False
        assert rec["final_step"] == MAX_STEPS
    assert flag.exists()
    assert _same_weights(_weights(work / "final_job3.pt"), reference)
    assert launcher.leftovers() == []


# ---------------------------------------------------------------- arguments and rules (fast)


def test_import_without_lightning_names_the_extra_to_install():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("lightning", "pytorch_lightning"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Block())
        try:
            from nvrx import launcher
            import nvrx.launcher.rank.ptl_resiliency
        except ImportError as exc:
            print("IMPORT_ERROR", exc)
        """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("IMPORT_ERROR"), res.stdout
    assert "pip install 'nvrx[lightning]'" in lines[0]


def test_simulated_fault_params_accept_nvrx_forms_and_refuse_bad_ones():
    params = SimulatedFaultParams("rank_hung", 1.5, rand_delay=0.5, rank_to_fail=1)
    assert parse_simulated_fault_params(params) is params
    assert parse_simulated_fault_params(None) is None
    assert parse_simulated_fault_params({"fault_type": "random", "base_delay": 2}) == \
        SimulatedFaultParams("random", 2, 0.0, None)
    bad = [{"fault_type": "rank_exploded", "base_delay": 1}, {"fault_type": "rank_killed", "base_delay": -1},
           {"fault_type": "rank_killed"}, {"fault_type": "rank_killed", "base_delay": 1, "delay": 3},
           {"fault_type": "rank_killed", "base_delay": 1, "rank_to_fail": -2}, "rank_killed"]
    for value in bad:
        with pytest.raises(ValueError):  # ConfigError is a ValueError, as NVRx raises
            parse_simulated_fault_params(value)


def test_every_rank_picks_the_same_victim_from_a_shared_seed():
    import random

    params = SimulatedFaultParams("random", 1.0, rand_delay=2.0)
    picks = {choose_fault(params, 8, random.Random(1234)) for _ in range(4)}  # 4 "ranks", same seed
    assert len(picks) == 1
    victim, fault_type, delay = picks.pop()
    assert 0 <= victim < 8 and fault_type in ("rank_killed", "rank_hung") and 1.0 <= delay < 3.0
    with pytest.raises(ConfigError, match="only 2 rank"):
        choose_fault(SimulatedFaultParams("rank_killed", 0, rank_to_fail=5), 2, random.Random(0))


INJECT = """
import importlib.util, logging, sys, threading
# the module itself, without its package (which imports Lightning: seconds per child on a busy machine)
spec = importlib.util.spec_from_file_location(  # the installed file, without importing Lightning
    "simulated_fault", importlib.util.find_spec("nvrx").submodule_search_locations[0]
    + "/launcher/rank/ptl_resiliency/simulated_fault.py")
module = importlib.util.module_from_spec(spec)
sys.modules["simulated_fault"] = module  # dataclasses look their module up there
spec.loader.exec_module(module)
fault = module.FaultInjector(sys.argv[1], float(sys.argv[2]), logging.getLogger("t")).start()
if sys.argv[3] == "cancel":
    fault.cancel()
    fault._thread.join()
    print("NOT_INJECTED", flush=True)
else:
    threading.Event().wait()
"""


def _inject(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", INJECT, *args], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def test_fault_injector_kills_or_stops_its_own_process_and_can_be_cancelled():
    import psutil

    killed, hung = _inject("rank_killed", "0", "wait"), _inject("rank_hung", "0", "wait")
    cancelled = _inject("rank_killed", "3600", "cancel")
    try:
        assert killed.wait(timeout=60) == -signal.SIGKILL
        assert wait_for(lambda: psutil.Process(hung.pid).status() == psutil.STATUS_STOPPED, timeout=60)
        out, _ = cancelled.communicate(timeout=60)
        assert cancelled.returncode == 0 and "NOT_INJECTED" in out
    finally:
        for proc in (killed, hung, cancelled):
            proc.kill()
            proc.wait()


def test_callback_arguments_are_checked_up_front(monkeypatch):
    with pytest.raises(ConfigError, match="autoresume"):
        FaultToleranceCallback(autoresume="yes", calculate_timeouts=False)
    with pytest.raises(ValueError, match="fault_type"):
        FaultToleranceCallback(False, False, simulated_fault_params={"fault_type": "x", "base_delay": 0})
    monkeypatch.delenv("FAULT_TOL_FINISHED_FLAG_FILE", raising=False)
    cb = FaultToleranceCallback(autoresume=True, calculate_timeouts=True)
    with pytest.raises(RuntimeError, match="FAULT_TOL_FINISHED_FLAG_FILE"):
        cb.setup(None, None, "fit")
    cb.setup(None, None, "validate")  # only fit is monitored
    assert not cb.is_initialized


def test_fit_outside_nvrx_launch_says_how_to_start(tmp_path, monkeypatch):
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    for name in [k for k in os.environ if k.startswith("NVRX_MONITOR_")]:
        monkeypatch.delenv(name)
    model = BoringModel()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[FaultToleranceCallback(autoresume=False, calculate_timeouts=True)])
    with pytest.raises(RuntimeError, match="nvrx launch"):
        trainer.fit(model)
    assert (tmp_path / FaultToleranceCallback.FT_DIR_NAME).is_dir()  # default: trainer.log_dir/ft_state


def _trainer(global_step: int, max_steps: int = 10, current_epoch: int = 0, max_epochs: int | None = None):
    return SimpleNamespace(global_step=global_step, max_steps=max_steps, current_epoch=current_epoch,
                           max_epochs=max_epochs)


def test_training_is_complete_only_at_the_trainers_limit_or_with_nothing_left_to_do():
    run = TrainingProgress()
    run.train_iters, run.ended = 5, True
    assert not run.is_training_completed(_trainer(global_step=5))
    assert run.is_training_completed(_trainer(global_step=10))
    assert run.is_training_completed(_trainer(global_step=5, max_steps=-1, current_epoch=3, max_epochs=3))
    resumed_at_end = TrainingProgress()
    resumed_at_end.ended = True
    assert resumed_at_end.is_training_completed(_trainer(global_step=0, max_steps=-1))
    resumed_at_end.on_exception(RuntimeError("boom"))
    assert not resumed_at_end.is_training_completed(_trainer(global_step=0, max_steps=-1))


def test_timeouts_are_learned_once_after_a_checkpoint_load_and_save():
    run = TrainingProgress()
    run.train_iters, run.loaded_checkpoint = 3, True
    run.on_heartbeat()
    run.on_save()
    assert not run.can_update_timeouts  # the interval after the save is not observed yet
    run.on_heartbeat()
    assert run.can_update_timeouts
    stopped = TrainingProgress()
    stopped.__dict__.update(run.__dict__)
    stopped.on_exception(SystemExit(0))  # a clean stop still learns
    assert stopped.can_update_timeouts
    run.on_exception(KeyError("x"))
    assert not run.can_update_timeouts
    stopped.timeouts_updated = True
    assert not stopped.can_update_timeouts
