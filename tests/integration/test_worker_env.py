"""torchrun's worker contract under `nvrx launch`: the rank environment key by key, and the error file.

The environment test runs the same script under the real torchrun (``python -m torch.distributed.run``)
and under ``nvrx launch`` with the same parent environment; every rank dumps ``os.environ`` to a file.
Every key torchrun adds to its workers must be there under nvrx with the same value, except the
differences listed (and explained) in nvrx.launcher.agent.rank_env.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx.launcher.agent import rank_env
from tests.conftest import free_port, write_script

DUMP_SCRIPT = '''
import json, os, sys
error_dir = os.path.dirname(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
with open(os.path.join(sys.argv[1], "env%s.json" % os.environ["RANK"]), "w") as fh:
    json.dump({"env": dict(os.environ), "error_dir_writable": os.access(error_dir, os.W_OK)}, fh)
'''

# The contract lives in nvrx.launcher.agent.rank_env (also rendered as docs/reference/rank-environment.md):
# the keys torchrun 2.13 gives each worker (the test also checks these are exactly what torchrun added, so a new
# torch variable shows up), the differences on purpose and why, and the keys nvrx adds.
TORCHRUN_KEYS = set(rank_env.TORCHRUN_KEYS)
INTENDED_DIFFERENCES = dict(rank_env.INTENDED_DIFFERENCES)
STANDALONE_DIFFERENCES = dict(rank_env.STANDALONE_DIFFERENCES)
DEFAULT_SIGNALS_DIFFERENCE = dict(rank_env.DEFAULT_SIGNALS_DIFFERENCE)
# NVRX_TEST_TOKEN: the test harness's marker on every process it starts (tests/conftest.py)
NVRX_KEYS = set(rank_env.NVRX_KEYS) | {"NVRX_TEST_TOKEN"}

SIGNALS = "SIGTERM,SIGINT,SIGUSR1"


def _base_env(launcher) -> dict[str, str]:
    """One parent environment for both launchers, without the variables either of them sets."""
    env = launcher.env()
    for key in TORCHRUN_KEYS | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHELASTIC_ENABLE_FILE_TIMER",
                                "TORCHELASTIC_TIMER_FILE", "CUDA_VISIBLE_DEVICES"}:
        env.pop(key, None)
    return env


def _run_torchrun(args: list[str], script: Path, out: Path, env: dict[str, str], cwd: Path) -> None:
    # torchrun itself sometimes aborts (SIGABRT in gloo teardown) on a loaded 2-core machine; this script
    # has no process group, but the peer still gets up to three tries: its flakiness is not under test.
    for _ in range(3):
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args, "--nproc-per-node", "2",
                              str(script), str(out)], check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        if res.returncode == 0:
            return
    raise AssertionError(f"torchrun failed ({res.returncode}):\n{res.stderr}")


def _envs(out: Path) -> list[dict[str, str]]:
    dumps = [json.loads((out / f"env{r}.json").read_text()) for r in range(2)]
    assert all(d["error_dir_writable"] for d in dumps), "the rank cannot write its TORCHELASTIC_ERROR_FILE"
    return [d["env"] for d in dumps]


@pytest.mark.parametrize("mode", ["standalone", "rdzv_id", "virtual_local_rank"])
def test_rank_environment_matches_torchrun_key_by_key(launcher, tmp_path, mode):
    script = write_script(tmp_path / "dump_env.py", DUMP_SCRIPT)
    theirs_dir, ours_dir = tmp_path / "torchrun", tmp_path / "nvrx"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    env = _base_env(launcher)
    keys = TORCHRUN_KEYS
    if mode in ("standalone", "virtual_local_rank"):
        t_args = n_args = ["--standalone"] + (["--virtual-local-rank"] if mode == "virtual_local_rank" else [])
        expected_diff = {**INTENDED_DIFFERENCES, **STANDALONE_DIFFERENCES, **DEFAULT_SIGNALS_DIFFERENCE}
        if mode == "virtual_local_rank":  # LOCAL_RANK=0 everywhere, and each rank's one GPU
            keys = TORCHRUN_KEYS | {"CUDA_VISIBLE_DEVICES"}
    else:  # a named job on an endpoint, and the same --signals-to-handle for both
        common = ["--nnodes", "1", "--rdzv-id", "envjob", "--signals-to-handle", SIGNALS]
        t_args = [*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}"]
        n_args = [*common, "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        expected_diff = dict(INTENDED_DIFFERENCES)
    _run_torchrun(t_args, script, theirs_dir, env, tmp_path)
    res = launcher.run(*n_args, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script),
                       str(ours_dir), env=env)
    assert res.returncode == 0, res.stderr

    for rank, (theirs, ours) in enumerate(zip(_envs(theirs_dir), _envs(ours_dir))):
        added_by_torchrun = {k for k in theirs if env.get(k) != theirs[k]}
        assert added_by_torchrun == keys, "torchrun's worker contract changed: update TORCHRUN_KEYS"
        for key in sorted(keys):
            assert key in ours, f"rank {rank}: {key} missing under nvrx"
            if key in expected_diff:
                assert ours[key] and theirs[key], (rank, key)
            else:
                assert ours[key] == theirs[key], (rank, key, theirs[key], ours[key])
        added_by_nvrx = {k for k in ours if env.get(k) != ours[k]} - keys
        assert added_by_nvrx <= NVRX_KEYS, added_by_nvrx
        # the error file paths differ, but are shaped alike (and _envs checked the rank could write there)
        for path in (theirs["TORCHELASTIC_ERROR_FILE"], ours["TORCHELASTIC_ERROR_FILE"]):
            assert Path(path).parts[-3:] == ("attempt_0", str(rank), "error.json")
    if mode == "rdzv_id":
        assert ours["TORCHELASTIC_RUN_ID"] == "envjob" and ours["TORCHELASTIC_SIGNALS_TO_HANDLE"] == SIGNALS
    if mode == "virtual_local_rank":
        assert (ours["LOCAL_RANK"], ours["CUDA_VISIBLE_DEVICES"]) == ("0", "1")  # the last rank compared: rank 1


RECORD_SCRIPT = '''
import os
from torch.distributed.elastic.multiprocessing.errors import record

def load_batch(n):
    raise ValueError(f"batch {n} is corrupt on rank {os.environ['RANK']}")

@record
def main():
    if os.environ["RANK"] == "1":
        load_batch(7)

main()
'''


def _job_end(log_dir: Path) -> dict:
    (events,) = log_dir.glob("*/agent-*.jsonl")
    return next(e for e in map(json.loads, events.read_text().splitlines()) if e["ev"] == "job_end")


def test_recorded_exception_is_in_the_failure_report(launcher, tmp_path):
    script = write_script(tmp_path / "fail.py", RECORD_SCRIPT)
    log_dir = tmp_path / "logs"
    res = launcher.run("--nproc-per-node", "2", "--log-dir", str(log_dir), str(script))
    assert res.returncode == 1, res.stderr
    report = res.stderr[res.stderr.index("job failed"):]
    # torchrun's ChildFailedError fields, root cause first: rank, exit code, error file, traceback
    order = ["rank      : 1 (local_rank: 1)", "exitcode  : 1 (pid: ", "error_file: ", "traceback :",
             "in load_batch", "ValueError: batch 7 is corrupt on rank 1"]
    at = 0
    for needle in order:  # each after the one before
        at = report.find(needle, at)
        assert at >= 0, (needle, report)
    (fail,) = _job_end(log_dir)["failures"]
    assert fail["error"]["exc_type"] == "ValueError"
    assert fail["error"]["message"] == "ValueError: batch 7 is corrupt on rank 1"
    assert "load_batch(7)" in fail["error"]["traceback"]
    assert fail["describe"].endswith("exited with code 1: ValueError: batch 7 is corrupt on rank 1")
    path = Path(fail["error"]["file"])
    assert path.is_file() and path.parts[-3:] == ("attempt_0", "1", "error.json")
    assert stat.S_IMODE(path.parents[2].stat().st_mode) == 0o700  # errors-<node>-<pid>: private to the user


GARBAGE_SCRIPT = '''
import os, sys
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
    fh.write("{not json" if os.environ["RANK"] == "1" else "")
sys.exit(3 if os.environ["RANK"] == "1" else 0)
'''


def test_garbage_error_file_is_ignored_with_one_line(launcher, tmp_path):
    script = write_script(tmp_path / "garbage.py", GARBAGE_SCRIPT)
    log_dir = tmp_path / "logs"
    res = launcher.run("--nproc-per-node", "2", "--log-dir", str(log_dir), str(script))
    assert res.returncode == 1, res.stderr
    about_file = [ln for ln in res.stderr.splitlines() if "error file" in ln]
    assert len(about_file) == 1 and "not JSON" in about_file[0], res.stderr
    assert "Traceback" not in res.stderr
    (fail,) = _job_end(log_dir)["failures"]
    assert fail["exitcode"] == 3 and "error" not in fail
    assert "rank 1 (local 1) exited with code 3" in res.stderr[res.stderr.index("job failed"):]


def test_rank_error_file_is_fresh_per_attempt(launcher, tmp_path):
    """A restart gives the rank attempt_1's path; attempt_0's file stays for the post-mortem."""
    body = RECORD_SCRIPT.replace('if os.environ["RANK"] == "1":',
                                 'if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":')
    script = write_script(tmp_path / "once.py", body + '\nprint("PATH", os.environ["TORCHELASTIC_RESTART_COUNT"], '
                                                       'os.environ["RANK"], os.environ["TORCHELASTIC_ERROR_FILE"])\n')
    log_dir = tmp_path / "logs"
    res = launcher.run("--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(log_dir), str(script))
    assert res.returncode == 0, res.stderr
    printed = [ln.split(" ", 3)[1:] for ln in res.stdout.splitlines() if ln.startswith("PATH ")]
    assert {(a, r) for a, r, _ in printed} >= {("1", "0"), ("1", "1")}, res.stdout
    for attempt, rank, path in printed:
        assert Path(path).parts[-3:] == (f"attempt_{attempt}", rank, "error.json")
    (kept,) = log_dir.glob("*/errors-*/attempt_0/1/error.json")
    assert "batch 7 is corrupt" in json.loads(kept.read_text())["message"]["message"]
    assert not os.path.exists(kept.parents[2] / "attempt_1" / "1" / "error.json")
