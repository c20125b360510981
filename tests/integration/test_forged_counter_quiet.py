"""A non-integer value written over a rendezvous counter: the agents repair it and go on (docs/faults.md), and the
store's host says so in one line of its own, without torch's C++ stack traces on its stderr (issue 27)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from torch.distributed import TCPStore

from tests.conftest import free_port, listening, run_events, wait_for, write_script

WAITS_FOR_GO = """
import os, sys, time
from pathlib import Path
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    Path("started").touch()
    while not Path("go").exists():
        time.sleep(0.05)
    sys.exit(1)  # the job restarts: the agent joins round 1 through the forged counter
"""


def test_overwritten_counter_is_repaired_quietly(launcher, tmp_path: Path) -> None:
    port = free_port()
    script = write_script(tmp_path / "wait_go.py", WAITS_FOR_GO)
    proc = launcher.start("--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "quiet",
                          "--max-restarts", "1", str(script))
    assert wait_for(lambda: listening(port) and (tmp_path / "started").exists(), 120)
    forger = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    forger.set("nvrx/quiet/r1/count", "not a number")  # the join counter the agent adds to for the next round
    (tmp_path / "go").touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "frame #" not in err and "c10d" not in err and "Traceback" not in err, err
    forged = [e for e in run_events(tmp_path / "nvrx_logs" / "quiet", "agent-") if e["ev"] == "rdzv_forged_record"]
    assert [e["key"] for e in forged] == ["nvrx/quiet/r1/count"], json.dumps(forged)
    assert launcher.leftovers() == []
