"""Bad input files through the real CLI: configs, job secrets, progress files and inspected event files that are
fifos, devices, symlink loops or far too large. Each ends in one line (exit 2) within a bound, never a hang or a
traceback, and nothing is left running."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import Launcher, one_line_error, write_script


class Inspect(Launcher):
    subcommand = "inspect"


class Resume(Launcher):
    subcommand = "resume"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    return write_script(tmp_path / "ok.py", "print('hello')\n")


def fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)
    return path


# ---------------------------------------------------------------- --ft-cfg-path


def test_ft_config_that_is_dev_zero(launcher, script):
    """/dev/zero was read without end (an unbounded read, never finishing)."""
    res = launcher.run("--ft-cfg-path", "/dev/zero", "--standalone", str(script), timeout=60)
    one_line_error(res, "/dev/zero", "character device", "not a regular file")
    assert launcher.leftovers(wait=0.5) == []


def test_ft_config_that_is_a_fifo(launcher, script, tmp_path):
    """A fifo blocked the launch in open() until some writer appeared: silent forever."""
    res = launcher.run("--ft-cfg-path", str(fifo(tmp_path / "ft.yaml")), "--standalone", str(script), timeout=60)
    one_line_error(res, "ft.yaml", "fifo", "not a regular file")
    assert launcher.leftovers(wait=0.5) == []


def test_ft_config_of_50_mb_is_refused_before_parsing(launcher, script, tmp_path):
    """A 50 MB YAML took over a minute to parse; it is refused by its size at once."""
    cfg = tmp_path / "big.yaml"
    with open(cfg, "w") as fh:
        fh.write("fault_tolerance:\n  rank_heartbeat_timeout: 5\nother:\n")
        line = "  - padding padding padding padding padding padding padding padding padding\n"
        fh.write(line * (50 * 1024 * 1024 // len(line)))
    t0 = time.monotonic()
    res = launcher.run("--ft-cfg-path", str(cfg), "--standalone", str(script), timeout=60)
    one_line_error(res, "big.yaml", "larger than 512 KiB")
    assert time.monotonic() - t0 < 30  # the refusal reads nothing; the bound is the interpreter's start-up


def test_ft_config_nested_too_deeply(launcher, script, tmp_path):
    """Deep nesting was a RecursionError traceback from the YAML parser."""
    cfg = tmp_path / "deep.yaml"
    cfg.write_text("fault_tolerance: " + "[" * 5000 + "\n")
    res = launcher.run("--ft-cfg-path", str(cfg), "--standalone", str(script), timeout=60)
    one_line_error(res, "deep.yaml", "nested too deeply")


def test_nvrx_yaml_with_aliases_is_searched_once_per_node(tmp_path):
    """FaultToleranceConfig.from_yaml_file searches the document for its section: aliases make 9**8 paths
    through a 200-byte file, which the search walked one by one (hours)."""
    from nvrx.monitors.ft_config import FaultToleranceConfig

    names = "abcdefghi"
    text = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip(names, names[1:]))
    path = tmp_path / "bomb.yaml"
    path.write_text(text + "deep: {fault_tolerance: {rank_heartbeat_timeout: 7}}\n")
    done: list[FaultToleranceConfig] = []
    worker = threading.Thread(target=lambda: done.append(FaultToleranceConfig.from_yaml_file(str(path))),
                              daemon=True)
    worker.start()
    worker.join(30)
    assert done and done[0].rank_heartbeat_timeout == 7.0


# ---------------------------------------------------------------- the job secret


def test_job_secret_file_that_is_a_fifo(launcher, script, tmp_path):
    """NVRX_JOB_SECRET_FILE naming a fifo blocked in open(): the launch hung with no output."""
    secret = fifo(tmp_path / "secret")
    res = launcher.run("--standalone", str(script), env={"NVRX_JOB_SECRET_FILE": str(secret)}, timeout=60)
    one_line_error(res, "job secret file", "fifo", "not a regular file")
    assert launcher.leftovers(wait=0.5) == []


# ---------------------------------------------------------------- nvrx resume --progress-file


def test_resume_progress_file_that_is_a_fifo(tmp_path):
    resume = Resume(tmp_path)
    try:
        (tmp_path / "state").mkdir()
        progress = fifo(tmp_path / "progress")
        res = resume.run("--state-dir", str(tmp_path / "state"), "--progress-file", str(progress), "--check",
                         timeout=60)
        one_line_error(res, "--progress-file", "fifo", "not a regular file")
    finally:
        resume.cleanup()


def test_progress_reader_does_not_block_on_a_fifo(tmp_path):
    """The driver reads the progress file after every launch; a fifo put there meanwhile must not block it."""
    from nvrx.launcher.resume.progress import ProgressSource, read_progress

    source = ProgressSource(progress_file=fifo(tmp_path / "progress"))
    got: list[int | None] = []
    worker = threading.Thread(target=lambda: got.append(read_progress(source)), daemon=True)
    worker.start()
    worker.join(10)
    assert got == [None]


# ---------------------------------------------------------------- nvrx inspect


def test_inspect_symlink_loop_named_like_an_event_file(tmp_path):
    """A symlink loop named agent-*.jsonl was a RuntimeError traceback (ELOOP)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "agent-x.jsonl").symlink_to("agent-x.jsonl")
    inspect = Inspect(tmp_path)
    try:
        one_line_error(inspect.run(str(run), timeout=60), "agent-x.jsonl", "Too many levels of symbolic links")
        one_line_error(inspect.run(str(run / "agent-x.jsonl"), timeout=60), "Too many levels of symbolic links")
    finally:
        inspect.cleanup()


def test_inspect_fifo_named_like_an_event_file(tmp_path):
    """An agent-*.jsonl that is a fifo blocked `nvrx inspect` forever in open()."""
    run = tmp_path / "run"
    run.mkdir()
    fifo(run / "agent-y.jsonl")
    inspect = Inspect(tmp_path)
    try:
        one_line_error(inspect.run(str(run), timeout=60), "agent-y.jsonl", "fifo")
        one_line_error(inspect.run(str(run / "agent-y.jsonl"), timeout=60), "fifo", "not an event file")
    finally:
        inspect.cleanup()
