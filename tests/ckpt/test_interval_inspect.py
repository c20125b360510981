"""`nvrx inspect` shows the interval ``every_steps="auto"`` chose and why, from a real `nvrx launch` run's events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

HERE = Path(__file__).resolve().parent


def test_inspect_shows_the_auto_interval_and_why(launcher, tmp_path):
    root, logs = tmp_path / "ckpts", tmp_path / "logs"
    res = launcher.run("--standalone", "--nproc-per-node", "2", "--async-ckpt", "--log-dir", str(logs),
                       str(HERE / "auto_interval_train.py"), str(root), "120", "30", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    chosen = json.loads((root / "nvrx_interval.json").read_text())
    every = chosen["every_steps"]
    assert every != 50  # (the first save's interval, before anything was measured)
    events = [json.loads(line) for f in logs.rglob("monitor-*.jsonl") for line in f.read_text().splitlines()]
    reported = [e for e in events if e.get("ev") == "checkpoint_interval"]
    # rank 0's, once per change (the first choice knows no drain time yet: the next save's may raise it)
    assert reported and reported[-1]["every_steps"] == every, reported
    assert all(a["every_steps"] != b["every_steps"] for a, b in zip(reported, reported[1:])), reported
    assert {e["global_rank"] for e in reported} == {0}
    assert reported[-1]["mtbf_s"] == 30.0 and reported[-1]["save_cost_s"] > 0 and reported[-1]["step_s"] > 0
    out = subprocess.run([sys.executable, "-m", "nvrx", "inspect", str(logs)], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("checkpoint interval (auto):")]
    assert f"every {every} steps" in line and "Daly optimum" in line and "MTBF from configured mtbf_s" in line, line
    report = json.loads(subprocess.run([sys.executable, "-m", "nvrx", "inspect", "--json", str(logs)],
                                       capture_output=True, text=True, cwd=REPO, timeout=60).stdout)
    assert report["checkpoint_interval"]["every_steps"] == every
