"""Ranks see only the user's world: a training directory holding modules named like nvrx's own packages
(`launcher.py`, `slurm.py`, `ckpt/`, `monitors/`, ...) runs under `nvrx launch` exactly as under torchrun.

Every launch mode is compared with torchrun on the same directory: the user's modules are the ones
imported, sys.path is torchrun's, and nothing of nvrx's sits under a top-level name other than `nvrx`.
A directory that holds its own `nvrx` module is refused with one line (exit 2): the ranks run with it
first on sys.path, so its code would get nvrx's package where torchrun gives it its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nvrx
from tests.conftest import one_line_error, write_script

# Names nvrx used (or uses) for its own modules, each made a user module here.
USER_MODULES = ("launcher", "slurm", "ckpt", "monitors", "nvrx_cli", "nvrx_common", "common", "events",
                "inspection", "bootstrap", "rank_monitor", "fork_server")
PACKAGE_DIRS = {"ckpt", "monitors", "nvrx_common"}

PROBE = r'''
import json, os, sys
import torch.distributed as dist
NAMES = %r
mods = {name: __import__(name) for name in NAMES}
pkg = os.path.dirname(os.path.abspath(sys.argv[0] if not __package__ else __file__))
nvrx_dir = %r
strays = sorted(name for name, m in list(sys.modules.items())
                if not name.startswith("nvrx") and (getattr(m, "__file__", None) or "").startswith(nvrx_dir + os.sep))
out = {
    "mine": {name: getattr(m, "MINE", None) for name, m in mods.items()},
    "sys_path": sys.path,
    "pythonpath": os.environ.get("PYTHONPATH"),
    "leaked_env": sorted(k for k in os.environ if k.startswith("NVRX_BOOTSTRAP")),
    "strays": strays,
    "main_name": __name__,
}
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    with open(os.environ["USER_WORLD_OUT"], "w") as fh:
        json.dump(out, fh)
dist.destroy_process_group()
'''


def _make_user_dir(root: Path) -> Path:
    work = root / "train"
    work.mkdir()
    for name in USER_MODULES:
        if name in PACKAGE_DIRS:
            (work / name).mkdir()
            (work / name / "__init__.py").write_text(f"MINE = {name!r}\n")
        else:
            (work / f"{name}.py").write_text(f"MINE = {name!r}\n")
    nvrx_dir = str(Path(nvrx.__file__).resolve().parent)
    write_script(work / "train.py", PROBE % (USER_MODULES, nvrx_dir))
    # the same probe as a module of a package, for -m
    (work / "userpkg").mkdir()
    (work / "userpkg" / "__init__.py").write_text("")
    write_script(work / "userpkg" / "probe.py", PROBE % (USER_MODULES, nvrx_dir))
    return work


def _run(cmd: list[str], work: Path, out: Path, env_extra: dict[str, str] | None = None, tries: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "NVRX_"))}
    env.update({"USER_WORLD_OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(work / "extra"),
                **(env_extra or {})})
    (work / "extra").mkdir(exist_ok=True)
    for attempt in range(tries + GLOO_MESH_TRIES - 1):
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=180)
        if done.returncode == 0 or (attempt + 1 >= tries and GLOO_MESH_RACE not in done.stderr):
            break
    if done.returncode != 0:  # pytest.fail: the whole output, not an assertion repr cut to one line
        pytest.fail(f"{cmd} exited {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())


# gloo's own connect race on a loaded machine: one rank's init_process_group fails in connectFullMesh with
# "Connection closed by peer". Reproduced on this probe at load ~12 under plain torchrun (2 launches in 24) as
# under `nvrx launch` (1 in 16): gloo's, not nvrx's, and not what these tests check.
# A launch that failed with exactly that gets one more try; any other failure fails at once.
GLOO_MESH_RACE = "Gloo connectFullMesh failed"
GLOO_MESH_TRIES = 2

# torchrun itself sometimes aborts on a loaded 2-core machine (SIGABRT in gloo teardown, seen in
# test_launch.py too); that is the peer's flakiness, not what these tests check: it gets three tries.
PEER_TRIES = 3


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    return _make_user_dir(tmp_path_factory.mktemp("userworld"))


@pytest.fixture(scope="module")
def reference(user_dir: Path) -> dict:
    """What torchrun gives the script."""
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"],
                user_dir, user_dir / "torchrun.json", env, tries=PEER_TRIES)


NVRX = [sys.executable, "-P", "-m", "nvrx", "launch", "--standalone", "--nproc-per-node", "2"]
MODES = {
    "fork": [],
    "spawn": ["--no-fork-server"],
    "inprocess": ["--inprocess"],
    "async_ckpt": ["--async-ckpt"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_users_modules_are_imported_as_under_torchrun(user_dir: Path, reference: dict, mode: str) -> None:
    assert reference["mine"] == {name: name for name in USER_MODULES}
    got = _run([*NVRX, *MODES[mode], "train.py"], user_dir, user_dir / f"{mode}.json")
    assert got["mine"] == reference["mine"]
    assert got["sys_path"] == reference["sys_path"]
    assert got["pythonpath"] == reference["pythonpath"]
    assert got["leaked_env"] == [] and got["strays"] == [] and got["main_name"] == "__main__"


def test_module_mode_matches_torchrun(user_dir: Path) -> None:
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    theirs = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                   "userpkg.probe"], user_dir, user_dir / "torchrun-m.json", env, tries=PEER_TRIES)
    ours = _run([*NVRX, "-m", "userpkg.probe"], user_dir, user_dir / "nvrx-m.json")
    assert theirs["mine"] == {name: name for name in USER_MODULES}
    assert ours["mine"] == theirs["mine"] and ours["sys_path"] == theirs["sys_path"]
    assert ours["strays"] == []


def test_no_python_mode_runs_the_program_as_given(user_dir: Path, reference: dict) -> None:
    got = _run([*NVRX, "--no-python", sys.executable, "-u", "train.py"], user_dir, user_dir / "nopython.json")
    assert got["mine"] == reference["mine"] and got["sys_path"] == reference["sys_path"]


@pytest.mark.parametrize("shadow", ["nvrx.py", "nvrx/__init__.py"])
def test_a_script_directory_with_its_own_nvrx_is_refused(tmp_path: Path, shadow: str) -> None:
    (tmp_path / shadow).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / shadow).write_text("MINE = True\n")
    write_script(tmp_path / "train.py", "print('ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    done = subprocess.run([*NVRX, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    one_line_error(done, "shadows the nvrx package", "rename it")
    assert "ran" not in done.stdout
