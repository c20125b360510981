"""A tiny Lightning DDP training run (CPU, 2 ranks) used by tests/compat/test_lightning.py under `nvrx launch`.

Argument: a JSON object:
  work        directory for checkpoints (work/ckpt), records (work/records) and final weights
  tag         name of this job in the record files
  max_steps   the trainer's step limit
  stop_at     optional: stop this job early at this step (as a time limit or preemption would)
  crash_at    optional: rank 1 exits abruptly after this step, in the first attempt only
  fault       optional: SimulatedFaultParams fields, used in the first attempt only
  ft          FaultToleranceCallback keyword arguments (autoresume, calculate_timeouts, exp_dir)

Each rank writes work/records/<tag>.<attempt>.<rank>.json: what it saw at the start (the cluster
environment Lightning chose, the finished flag, the checkpoint it resumed from, the heartbeat timeouts in
force) and at the end (final step, the timeouts after the job). Rank 0 saves the final weights.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from nvrx.launcher.rank.ptl_resiliency import FaultToleranceCallback

cfg = json.loads(sys.argv[1])
work = Path(cfg["work"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
STEPS_PER_EPOCH = 4  # 32 samples, 2 ranks x batch 4


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(n: int) -> torch.utils.data.DataLoader:
    """The same batches every epoch. Lightning's own sampler reshuffles per epoch, and after a resume at
    an epoch's end it seeds the next epoch's order differently from an uninterrupted run (Lightning
    2.6), which would make "same weights as a fault-free run" depend on where the job was cut."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    dataset = torch.utils.data.TensorDataset(x, y)
    world = int(os.environ["WORLD_SIZE"])
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)


class Script(pl.Callback):
    """The test's eyes inside the run, plus the job's own stop and crash points."""

    def __init__(self, ft: FaultToleranceCallback) -> None:
        self.ft = ft
        self.client = None
        self.record = {"attempt": attempt, "rank": rank, "pid": os.getpid()}

    def on_train_start(self, trainer, pl_module):
        self.client = self.ft.fault_tol_client
        flag = os.environ.get("FAULT_TOL_FINISHED_FLAG_FILE")
        self.record.update(
            cluster_env=type(trainer.strategy.cluster_environment).__name__,
            flag_at_start=bool(flag) and Path(flag).exists(),
            start_step=trainer.global_step,
            timeouts_at_start=dataclasses.asdict(self.client.hb_timeouts),
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        # (step, epoch, batch index, first input value): which data each step trained on
        self.record.setdefault("batches", []).append([step, trainer.current_epoch, batch_idx, float(batch[0][0, 0])])
        if cfg.get("crash_at") == step and rank == 1 and attempt == 0:
            os._exit(1)
        if cfg.get("stop_at") == step:
            trainer.should_stop = True


def main() -> None:
    pl.seed_everything(0, verbose=False)
    fault = cfg.get("fault") if attempt == 0 else None
    ft = FaultToleranceCallback(simulated_fault_params=fault, **cfg["ft"])
    script = Script(ft)
    # one checkpoint per epoch, saved at the epoch's end: Lightning 2.6 repeats an epoch when a run that
    # resumed from a checkpoint taken at an epoch's last batch is itself resumed
    ckpt = ModelCheckpoint(dirpath=work / "ckpt", every_n_epochs=1, save_on_train_epoch_end=True,
                           save_top_k=-1, save_last=True, filename="{step}")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=cfg["max_steps"],
                         callbacks=[ft, script, ckpt], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
                         default_root_dir=work, use_distributed_sampler=False)
    last = work / "ckpt" / "last.ckpt"
    model = Tiny()
    trainer.fit(model, data(32), data(8), ckpt_path=str(last) if last.exists() else None)
    script.record.update(final_step=trainer.global_step, timeouts_at_end=dataclasses.asdict(script.client.hb_timeouts))
    records = work / "records"
    records.mkdir(exist_ok=True)
    (records / f"{cfg['tag']}.{attempt}.{rank}.json").write_text(json.dumps(script.record))
    if trainer.is_global_zero:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, work / f"final_{cfg['tag']}.pt")


if __name__ == "__main__":
    main()
