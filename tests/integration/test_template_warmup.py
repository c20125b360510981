"""The fork server's template pays first-use costs once (an optimizer's torch._dynamo import, DCP, DDP) so a
restarted rank does not, and a rank forked from the warm template observes what a fresh `python` would:
a torch RNG freshly seeded from the OS (its own seed per rank, nothing drawn from it), torch's thread settings,
CUDA not initialised; and the template had no other thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_script

# Attempt 0 waits (bounded) until the template says it is warm, then fails so that attempt 1 is forked from it.
PROBE = r'''
import json, os, sys, time
out = sys.argv[1].replace("{RANK}", os.environ.get("RANK", ""))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "1"))
parent = os.getppid()

def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""

if attempt == 0:
    deadline = time.monotonic() + 60
    while comm(parent) != "nvrx-tmpl-warm":
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.02)
    sys.exit(1)
preloaded = "torch._dynamo" in sys.modules
ckpt_listed = "nvrx.ckpt.periodic" in sys.modules
import torch
info = {
    "preloaded_dynamo": preloaded,
    "ckpt_listed": ckpt_listed,
    "template_comm": comm(parent),
    "template_threads": len(os.listdir(f"/proc/{parent}/task")),
    "initial_seed": torch.initial_seed(),
    "untouched": torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(torch.initial_seed()).get_state()),
    "num_threads": torch.get_num_threads(),
    "interop_threads": torch.get_num_interop_threads(),
    "cuda_initialized": torch.cuda.is_initialized(),
}
with open(out, "w") as fh:
    json.dump(info, fh)
'''

ENV = {"OMP_NUM_THREADS": "1"}  # the same for the launched rank and the plain interpreter


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> tuple[list[dict], dict]:
    """What the two ranks forked from the warm template see, and what `python probe.py` sees."""
    from tests.conftest import Launcher

    tmp = tmp_path_factory.mktemp("warmup")
    script = write_script(tmp / "probe.py", PROBE)
    launcher = Launcher(tmp)
    try:
        done = launcher.run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(script),
                            str(tmp / "forked-{RANK}.json"), env=ENV)
        assert done.returncode == 0, done.stderr[-3000:]
        assert launcher.leftovers() == []
    finally:
        launcher.cleanup()
    plain = subprocess.run([sys.executable, str(script), str(tmp / "plain.json")], env={**os.environ, **ENV},
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    forked = [json.loads((tmp / f"forked-{rank}.json").read_text()) for rank in (0, 1)]
    return forked, json.loads((tmp / "plain.json").read_text())


def test_the_restarted_ranks_come_from_a_warm_template(observed) -> None:
    forked, _ = observed
    for rank in forked:
        assert rank["template_comm"] == "nvrx-tmpl-warm"
        assert rank["preloaded_dynamo"]  # building the first optimizer costs the rank nothing


def test_ckpt_is_imported_once_in_the_template_and_kept(observed) -> None:
    """nvrx's modules all live under `nvrx.`, a name no user module can take: the template's import is kept
    listed, so the rank's `from nvrx import ckpt` costs nothing, and a plain interpreter has none of it."""
    forked, plain = observed
    for rank in forked:
        assert rank["ckpt_listed"]
    assert not plain["ckpt_listed"]


def test_the_template_has_no_thread_but_its_main_one(observed) -> None:
    forked, _ = observed
    assert [rank["template_threads"] for rank in forked] == [1, 1]


def test_the_torch_rng_is_seeded_per_rank_and_untouched(observed) -> None:
    forked, plain = observed
    assert plain["untouched"]  # what a fresh interpreter looks like
    assert [rank["untouched"] for rank in forked] == [True, True]  # the warm-up drew no random number
    assert forked[0]["initial_seed"] != forked[1]["initial_seed"]  # not one seed inherited by every rank


def test_torch_thread_settings_are_a_fresh_interpreters(observed) -> None:
    forked, plain = observed
    for rank in forked:
        assert (rank["num_threads"], rank["interop_threads"]) == (plain["num_threads"], plain["interop_threads"])


def test_cuda_is_not_initialised(observed) -> None:
    forked, plain = observed
    assert [rank["cuda_initialized"] for rank in forked] == [False, False]
    assert plain["cuda_initialized"] is False


def test_a_forked_rank_imports_the_users_own_launcher_and_monitors_packages(tmp_path: Path, launcher) -> None:
    """Our packages are unlisted in a forked rank (by the names the template noted before forking, plus any listed
    later), so the user's packages of the same names are the ones imported."""
    for name in ("launcher", "monitors", "slurm"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("MINE = True\n")
    script = write_script(tmp_path / "uses_own.py", '''
import json, os, sys
import launcher, monitors, slurm
with open(sys.argv[1].replace("{RANK}", os.environ["RANK"]), "w") as fh:
    json.dump([getattr(m, "MINE", False) for m in (launcher, monitors, slurm)], fh)
''')
    done = launcher.run("--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script),
                        str(tmp_path / "own-{RANK}.json"), env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads((tmp_path / f"own-{rank}.json").read_text()) for rank in (0, 1)] == [[True] * 3] * 2
    events = [json.loads(line) for f in (tmp_path / "logs").rglob("agent-*.jsonl") for line in f.read_text().splitlines()]
    assert [e["how"] for e in events if e.get("ev") == "rank_start"] == ["fork", "fork"]
