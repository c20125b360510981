"""An in-process restart runs the user's script again in the same interpreter: sys.path must look as it did the
first time (torchrun's restart is a fresh process), not gain the script's directory once per iteration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys
from nvrx.launcher.rank import bootstrap
before = list(sys.path)
seen = []
for _ in range(3):                      # the first run and two in-process restarts
    bootstrap._set_main_path(sys.argv[1])
    seen.append(list(sys.path))
print(json.dumps({"before": before, "seen": seen, "safe_path": sys.flags.safe_path}))
"""


def _probe(tmp_path: Path, *flags: str) -> dict:
    out = subprocess.run([sys.executable, *flags, "-c", PROBE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=True, cwd=tmp_path)
    return json.loads(out.stdout)


def test_a_rerun_replaces_the_scripts_directory_instead_of_stacking_it(tmp_path: Path) -> None:
    got = _probe(tmp_path, "-P")  # how nvrx starts its ranks
    assert got["safe_path"]
    assert got["seen"] == [[str(tmp_path), *got["before"]]] * 3


def test_without_safe_path_the_first_entry_is_replaced_each_time(tmp_path: Path) -> None:
    got = _probe(tmp_path)  # `python -c` put '' first: replaced, as `python SCRIPT` would have set it
    assert not got["safe_path"] and got["before"][0] == ""
    assert got["seen"] == [[str(tmp_path), *got["before"][1:]]] * 3
