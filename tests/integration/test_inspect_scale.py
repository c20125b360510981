"""`nvrx inspect` on a 1,024-node, 10-round run: the default view fits about a screen, and says the faults, their
causes, the time lost, each fault's just-in-time checkpoint (one line, not one per node) and the goodput; --verbose
and --node show what it folds; --node's goodput says whose it is.

The log set is the benchmark's (bench/bench_inspect.py --scale, written with the real writer and the records the
agents and monitors emit: every agent logs every round's 1,024-node list, so ~300 MB), with shorter rounds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.bench_inspect import generate
from tests.conftest import REPO


ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
SCREEN = 60  # lines: "about one screen" (issue 31)


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvrx", "inspect", *args], capture_output=True, text=True, env=ENV,
                          timeout=600, check=False)


@pytest.fixture(scope="module")
def big_run(tmp_path_factory) -> Iterator[Path]:
    """The log set, removed after the module: ~300 MB is too much to leave to pytest's keep-the-last-3 rule."""
    root = tmp_path_factory.mktemp("scale")
    generate(root, round_s=(60.0, 90.0))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def full(big_run) -> dict:
    """The --json report: every entry, nothing folded."""
    res = inspect("--json", str(big_run))
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_the_default_view_of_1024_nodes_and_10_rounds_fits_a_screen(big_run, full):
    (job,) = full["jobs"]
    assert len(job["nodes"]) == 1024 and len(job["rounds"]) == 10 and len(full["ranks"]) == 2048
    hangs = [it for it in full["timeline"] if it["kind"] == "hang_detected"]
    killed = [it for it in full["timeline"] if it["kind"] == "agent_killed_rank"]
    assert len(hangs) > 100 and len(killed) > 50  # per-rank lines by the hundred: what the view must fold
    res = inspect(str(big_run))
    assert res.returncode == 0, res.stderr[-2000:]
    text = res.stdout
    assert len(text.splitlines()) <= SCREEN, text
    assert f"goodput {full['goodput'] * 100:.1f} % (from 'step' sections)" in text
    lost = sum(f["lost_s"] for f in full["faults"])
    assert f"time lost to {len(full['faults'])} stop(s)" in text and full["faults"]
    stops = [ln for ln in text.splitlines() if " stopped: " in ln]
    assert len(stops) == len(full["faults"])
    for f, line in zip(full["faults"], stops):  # each fault: its cause and the time it cost, on its line
        assert f["cause"] in line and re.search(r"; [\d.]+ (s|min) lost", line), line
    assert lost > 0
    # --jit-ckpt: every agent logs its ranks' answers per fault (one save, the other nodes' skips): one line per fault
    jit = [ln for ln in text.splitlines() if "just-in-time checkpoint" in ln]
    faults = [f for f in full["faults"] if f["kind"] in ("failed", "node_left")]
    assert len(jit) == len(faults) and all(" stopped: " in ln and "; just-in-time checkpoint of step " in ln
                                          and " saved in 0.21 s by rank " in ln and "; resumed from it" in ln
                                          for ln in jit), jit
    for f in faults:
        j = f["jit_checkpoint"]
        assert j["outcome"] == "saved" and len(j["nodes"]) == 1 and j["resume_step"] == j["step"], j
        assert j["nodes_skipped"] == len(job["nodes"]) - 1 - (f["kind"] == "node_left")
    assert len([ln for ln in text.splitlines() if "health checks" in ln]) == 1  # round 0's; the others are alike
    assert "1024 nodes passed their health checks" in text
    hung = [ln for ln in text.splitlines() if "; monitor sent SIGKILL" in ln]  # hangs that stopped no round
    assert 1 <= len(hung) < 5 and all("more like it: rank(s) " in ln for ln in hung)
    assert "--verbose, --rank N or --node NAME shows every entry" in text
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_verbose_and_node_show_what_the_default_view_folds(big_run, full):
    hangs = [it for it in full["timeline"] if it["kind"] == "hang_detected"]
    last = hangs[-1]  # folded into the first of its round's group by default
    default = inspect(str(big_run)).stdout
    assert last["text"] not in default
    one = inspect("--node", last["node"], str(big_run))
    assert one.returncode == 0 and last["text"] in one.stdout
    verbose = inspect("--verbose", str(big_run))
    assert verbose.returncode == 0
    assert sum(1 for ln in verbose.stdout.splitlines() if "; monitor sent SIGKILL" in ln) == len(hangs)
    assert "\nFaults and stops\n" in verbose.stdout and "\nFaults and stops\n" not in default
    assert len(verbose.stdout.splitlines()) > len(hangs)


def test_goodput_under_node_is_that_nodes_and_says_the_whole_jobs(big_run, full):
    node = next(f["node"] for f in full["faults"] if f.get("node"))
    res = inspect("--json", "--node", node, str(big_run))
    rep = json.loads(res.stdout)
    assert rep["goodput_scope"] == f"node {node}"
    assert rep["time_accounting"]["job_goodput"] == full["goodput"]
    assert rep["time_accounting"]["job_stops"] == len(full["faults"])
    text = inspect("--node", node, str(big_run)).stdout
    assert f"goodput {rep['goodput'] * 100:.1f} % (node {node}'s ranks, from 'step' sections)" in text
    assert f"the whole job: {full['goodput'] * 100:.1f} %" in text
    assert "uptime" in text and "(job-wide)" in text
