"""nvrx as users install it: one import namespace, a regular (non-editable) install that runs a job from any
directory, and one clear line when the Python it runs in cannot work (no torch, a shadowed dependency).

Under scripts/test.sh (CI) the suite itself runs against the built wheel in a fresh venv; these tests also
build and install a wheel themselves when run against an editable checkout, so a developer sees the same.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import nvrx
from tests.conftest import REPO, one_line_error, write_script

OLD_TOP_LEVEL = ("launcher", "monitors", "ckpt", "slurm", "nvrx_cli", "nvrx_common", "events", "inspection", "common")
DEPS = ("click", "pyyaml", "psutil", "rich")

JOB = r'''
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {int(t.item())}", flush=True)
dist.destroy_process_group()
'''


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "NVRX_", "PYTHONPATH"))}
    env.update(extra)
    return env


def _installed_regularly() -> bool:
    """nvrx imported from an install's site-packages, not from a source tree."""
    return "site-packages" in Path(nvrx.__file__).resolve().parts and not (Path(nvrx.__file__).parents[1] / "tests").is_dir()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel under test: the one CI installed (NVRX_TEST_WHEEL), else one built from this checkout."""
    given = os.environ.get("NVRX_TEST_WHEEL")
    if given:
        return Path(given)
    if not (REPO / "nvrx" / "__init__.py").is_file():
        pytest.skip("no checkout to build a wheel from and NVRX_TEST_WHEEL is not set (scripts/test.sh sets it)")
    out = tmp_path_factory.mktemp("wheel")
    # Built from a private copy: setuptools builds in the source tree's build/, which two xdist workers building
    # at once shared (one removed it under the other: a wheel without its console script, seen in a flake hunt).
    src = out / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".venv*"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=300, cwd=out)
    (found,) = out.glob("nvrx-*.whl")
    return found


def _venv(path: Path, *packages: str, no_deps: bool = False) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    python = path / "bin" / "python"
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *(["--no-deps"] if no_deps else []),
           *packages]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return python


@pytest.fixture(scope="module")
def installed_python(wheel: Path, tmp_path_factory) -> Path:
    """A Python where nvrx is a regular install: this one under CI, else a fresh venv with the wheel + torch."""
    if _installed_regularly():
        return Path(sys.executable)
    return _venv(tmp_path_factory.mktemp("venv") / "v", "torch==2.13.0", str(wheel), "torch==2.13.0")


def test_the_distribution_installs_one_top_level_package() -> None:
    top = importlib.metadata.distribution("nvrx").read_text("top_level.txt")
    assert top is not None and top.split() == ["nvrx"]


def test_no_other_top_level_name_is_importable(installed_python: Path, tmp_path: Path) -> None:
    probe = ("import importlib.util, json, sys; "
             f"print(json.dumps([n for n in {OLD_TOP_LEVEL!r} if importlib.util.find_spec(n) is not None]))")
    done = subprocess.run([str(installed_python), "-c", probe], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_a_regular_install_runs_a_job_from_any_directory(installed_python: Path, tmp_path: Path) -> None:
    """The rank bootstrap once took site-packages off sys.path (ModuleNotFoundError: torch in every rank), and a
    `launcher.py` beside the script stopped every rank ("'launcher' is not a package")."""
    write_script(tmp_path / "t.py", JOB)
    (tmp_path / "launcher.py").write_text("raise SystemExit('the user launcher.py was imported by nvrx')\n")
    (tmp_path / "slurm.py").write_text("raise SystemExit('the user slurm.py was imported by nvrx')\n")
    nvrx_bin = installed_python.parent / "nvrx"
    done = subprocess.run([str(nvrx_bin), "launch", "--standalone", "--nproc-per-node", "2", "t.py"], cwd=tmp_path,
                          env=_clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank ")) == ["rank 0 sum 3",
                                                                                           "rank 1 sum 3"]


def test_the_sbatch_templates_are_installed() -> None:
    from nvrx.slurm import TEMPLATES_DIR

    assert sorted(p.name for p in TEMPLATES_DIR.glob("*.sbatch")) == ["auto_resume.sbatch", "multi_node.sbatch",
                                                                     "single_node.sbatch"]


def test_a_python_without_torch_gets_one_line(wheel: Path, tmp_path: Path) -> None:
    python = _venv(tmp_path / "v", str(wheel), *DEPS, no_deps=True)
    write_script(tmp_path / "t.py", JOB)
    done = subprocess.run([str(python.parent / "nvrx"), "launch", "--standalone", "--nproc-per-node", "1", "t.py"],
                          cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120)
    one_line_error(done, "'torch' is not installed", "pip install torch")


@pytest.mark.parametrize("shadow", ["click.py", "yaml.py", "psutil/__init__.py"])
def test_a_pythonpath_that_shadows_a_dependency_gets_one_line(tmp_path: Path, shadow: str) -> None:
    stray = tmp_path / "stray" / shadow
    stray.parent.mkdir(parents=True)
    stray.write_text("")
    write_script(tmp_path / "t.py", JOB)
    done = subprocess.run([sys.executable, "-m", "nvrx", "launch", "--standalone", "--nproc-per-node", "1", "t.py"],
                          cwd=tmp_path, env=_clean_env(PYTHONPATH=str(tmp_path / "stray")), capture_output=True,
                          text=True, timeout=120)
    one_line_error(done, str(stray), "shadows the Python package")


def test_a_file_named_like_a_dependency_in_the_working_directory_changes_nothing(tmp_path: Path) -> None:
    """The CLI and every process it starts run with -P: the directory nvrx was started from is not on sys.path."""
    (tmp_path / "yaml.py").write_text("raise SystemExit('the working directory yaml.py was imported')\n")
    (tmp_path / "torch.py").write_text("raise SystemExit('the working directory torch.py was imported')\n")
    (tmp_path / "work").mkdir()
    write_script(tmp_path / "work" / "t.py", JOB)
    done = subprocess.run([sys.executable, "-P", "-m", "nvrx", "launch", "--standalone", "--nproc-per-node", "2",
                           "work/t.py"], cwd=tmp_path, env=_clean_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(" sum 3") == 2


def test_the_public_surface_imports_on_first_use(tmp_path: Path) -> None:
    """`import nvrx` is cheap (no torch); each public name is the module that implements it."""
    probe = (
        "import sys, json\n"
        "import nvrx\n"
        "cheap = 'torch' not in sys.modules\n"
        "from nvrx import inprocess, ckpt, fault_tolerance, straggler, rerun, job_control\n"
        "import nvrx.launcher.rank.inprocess as full\n"
        "print(json.dumps([cheap, inprocess is full, hasattr(inprocess, 'Wrapper'), hasattr(ckpt, 'PeriodicCheckpointer'),\n"
        "                  hasattr(fault_tolerance, 'RankMonitorClient'), hasattr(straggler, 'Detector'),\n"
        "                  hasattr(rerun, 'RerunStateMachine'), hasattr(job_control, 'mark_finished')]))\n"
    )
    done = subprocess.run([sys.executable, "-P", "-c", probe], cwd=tmp_path, env=_clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [True] * 8
