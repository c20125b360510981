"""A Lightning DDP fit (CPU, 2 ranks) with StragglerDetectionCallback, run under `nvrx launch`.

Rank 1's training_step is twice as slow; the callback must find it and stop the fit on both ranks long
before max_steps. Argument: the output directory; each rank writes <out>/rank<N>.json.
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from nvrx.launcher.rank.ptl_resiliency import StragglerDetectionCallback

rank = int(os.environ["RANK"])
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _idx):
        time.sleep(0.02 * (2 if rank == 1 else 1))
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


x = torch.randn(4096, 4)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
cb = StragglerDetectionCallback(report_time_interval=1.0, calc_relative_gpu_perf=True, calc_individual_gpu_perf=True,
                                num_gpu_perf_scores_to_print=2, gpu_relative_perf_threshold=0.7,
                                gpu_individual_perf_threshold=0.7, stop_if_detected=True,
                                logger_name="test.straggler")
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2000, callbacks=[cb], logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
trainer.fit(Tiny(), data)
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({
    "step": trainer.global_step, "reports": len(cb.reports),
    "relative": [r.section_relative_perf_scores.get("training_step", {}) for r in cb.reports]}))
