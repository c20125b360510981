"""Checkpoints reported complete, exact goodput, and the `nvrx inspect --html` report rendered in a real browser.

Real `nvrx launch` runs (real ranks, rank monitors, gloo, nvrx's checkpointers), read with the real CLI; the
HTML report is loaded by headless Chromium (scripts/install_chromium.sh): no script errors, the faults, their
causes and the goodput figure in the rendered DOM, a screenshot kept as a test artifact.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_events, write_script
from tests.integration import browser


ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
ARTIFACTS = Path(os.environ.get("NVRX_TEST_ARTIFACTS") or REPO / "test-artifacts")
DEMO = REPO / "scripts" / "demo_train.py"


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvrx", "inspect", *args], capture_output=True, text=True, env=ENV,
                          timeout=120)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """The demo's faulty run (scripts/demo.sh, shorter): rank 1 crashes in attempt 0, rank 0 hangs in attempt 1;
    PeriodicCheckpointer every 5 steps; the job resumes each time and finishes."""
    from tests.conftest import Launcher

    tmp = tmp_path_factory.mktemp("demo")
    lau = Launcher(tmp)
    try:
        res = lau.run("--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-id", "demo", "--async-ckpt",
                      "--ft-param-auto-heartbeat", "true", "--ft-param-rank-heartbeat-timeout", "3",
                      str(DEMO), "--steps", "40", "--crash-at", "17", "--hang-at", "32", timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        assert lau.leftovers() == []
    finally:
        lau.cleanup()
    return tmp / "nvrx_logs" / "demo"


def test_nvrx_checkpointers_report_each_complete_checkpoint_and_goodput_counts_redone_work(demo_run):
    done = [e for e in run_events(demo_run, "monitor-") if e["ev"] == "checkpoint_complete"]
    assert done, "PeriodicCheckpointer reported no complete checkpoint"
    assert {e["tier"] for e in done} == {"global"} and {e["global_rank"] for e in done} == {0, 1}
    for e in done:  # each names the checkpoint it completed, and its state is older than the report
        assert Path(e["path"]).name == f"step_{e['step']:09d}" and e["taken"] <= e["t"]
    assert max(e["step"] for e in done) == 40  # the final save (close) is reported too
    rep = json.loads(inspect("--json", str(demo_run)).stdout)
    acct = rep["time_accounting"]
    assert acct["checkpoints"] == "reported" and "reported complete" in acct["recompute"]
    assert acct["recomputed_s"] > 0 and acct["kept_s"] + acct["recomputed_s"] == pytest.approx(acct["progress_s"],
                                                                                              abs=0.002)
    # what is redone in the crashed round: its progress after the last checkpoint complete before the crash
    steps = {(c["round"], c["step"]) for c in rep["checkpoints"]}
    assert {r for r, _ in steps} == {0, 1, 2} and all(c["ranks"] == 2 for c in rep["checkpoints"])
    text = inspect(str(demo_run)).stdout
    assert "progress redone after restarts" in text and "recompute unknown" not in text
    assert re.search(r"checkpoints complete: \d+ global \(steps 5-40\)", text), text


def test_the_html_report_of_a_real_faulty_run_renders_in_chromium(demo_run, tmp_path):
    if browser.chromium() is None:
        pytest.skip("no chromium: run scripts/install_chromium.sh (as root) to install Debian's chromium")
    page = tmp_path / "report.html"
    res = inspect("--html", str(page), str(demo_run))
    assert res.returncode == 0, res.stderr
    rep = json.loads(inspect("--json", str(demo_run)).stdout)
    data = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", data), "the report must not fetch anything"
    shown = browser.render(page)
    assert shown.script_errors == [], shown.console
    assert re.search(r'data-ready="\d+"', shown.dom), "the page's script did not run to its end"
    assert '<div id="rank-lanes" class="scroll"><svg' in shown.dom  # the script drew a node's rank lanes
    for f in rep["faults"]:
        assert html_text(f["cause"]) in shown.dom
    assert "rank 1: simulated crash at step 17" in shown.dom  # the crashed rank's own output, quoted
    assert f"{rep['goodput'] * 100:.1f} %" in shown.dom     # the terminal's goodput figure
    assert "progress redone" in shown.dom and 'class="ckpt"' in shown.dom
    png = browser.screenshot(page, ARTIFACTS / "inspect_html_demo.png")
    assert png.stat().st_size > 10_000
    print(f"screenshot: {png}")


def html_text(s: str) -> str:
    import html

    return html.escape(s, quote=True)


REPORTS = r'''
import os, sys, time
import torch, torch.distributed as dist
from nvrx import ckpt
from nvrx.ckpt.local.ckpt_managers.local_manager import LocalCheckpointManager
dist.init_process_group("gloo")
state = {"w": torch.arange(8.0) + dist.get_rank()}
local = LocalCheckpointManager(sys.argv[1], session_id="s")
local.save(state, 3)                          # synchronous local save
local.save(state, 4, is_async=True)           # asynchronous: complete when finalized everywhere
local.wait()
ckpt.async_save(state, os.path.join(sys.argv[2], "iter_000000007"))   # global (DCP), step from the name
ckpt.wait()
ckpt.async_save(state, os.path.join(sys.argv[2], "final"), step=9)    # global, step given
ckpt.finalize_before_exit()
local.close()
dist.destroy_process_group()
'''


def test_local_and_global_saves_are_reported_once_complete_on_every_rank(launcher, tmp_path):
    script = write_script(tmp_path / "saves.py", REPORTS)
    res = launcher.run("--nproc-per-node", "2", "--rdzv-id", "ck", "--async-ckpt", str(script),
                       str(tmp_path / "local"), str(tmp_path / "global"), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "nvrx_logs" / "ck"
    got = sorted((e["global_rank"], e["tier"], e["step"]) for e in run_events(run, "monitor-")
                 if e["ev"] == "checkpoint_complete")
    assert got == sorted((r, tier, step) for r in (0, 1) for tier, step in
                         (("local", 3), ("local", 4), ("global", 7), ("global", 9)))
    rep = json.loads(inspect("--json", str(run)).stdout)
    assert [(c["tier"], c["step"], c["ranks"]) for c in rep["checkpoints"]] == \
        [("local", 3, 2), ("local", 4, 2), ("global", 7, 2), ("global", 9, 2)]
    assert launcher.leftovers() == []


def test_a_report_without_a_monitor_or_with_a_failing_sink_never_raises():
    from nvrx.common import checkpoint_report as cr

    old = cr.set_sink(None)
    try:
        assert cr.report_checkpoint(5, "global") is False

        def broken(report):
            raise OSError("monitor gone")

        cr.set_sink(broken)
        assert cr.report_checkpoint(5, "global", taken=1.0) is False
        seen = []
        cr.set_sink(lambda r: seen.append(r) or True)
        assert cr.report_checkpoint("6", "jit", taken=2, path=Path("/x")) is True
        assert (seen[0].step, seen[0].tier, seen[0].taken, seen[0].path) == (6, "jit", 2.0, "/x")
    finally:
        cr.set_sink(old)
