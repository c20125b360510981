"""job_control.install(): a stop signal that arrives before the first should_stop() is reported by it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RANK = r'''
import os, signal
from nvrx.launcher.rank import job_control
job_control.install()                      # at start-up, before any training step
os.kill(os.getpid(), signal.SIGUSR1)       # e.g. Slurm's time-limit warning during setup
print("alive", job_control.stop_signal().name, flush=True)
print([job_control.should_stop(s) for s in range(4)], flush=True)
'''


def test_a_signal_before_the_first_should_stop_is_reported():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), NVRX_GRACEFUL_SIGNALS="SIGTERM,SIGUSR1")
    res = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["alive SIGUSR1", "[False, False, True, True]"]  # stops at step 0 + 2
