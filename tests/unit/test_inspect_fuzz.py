"""`nvrx inspect` on event files whose records have wrongly typed or absurd field values.

A valid log dir (written by the real EventLog, as in test_timeline) is copied with fields of random
records replaced by values of other types; inspect must exit 0 (report, with the bad records counted as
corrupt lines) or 2 (nothing readable), one clear line on error, never a traceback. The seed is fixed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from nvrx.inspection.event_files import NotARun
from nvrx.events import (AgentSignal, EventLog, ResumeAttemptEnd, ResumeDecision, ResumeSubmit, StopDetail,
                             TimeoutsSet, field_problem)
from nvrx.inspection.run_report import build_report
from nvrx.inspection.timeline import Filters
from nvrx.nvrx_cli.inspect_cmd import render_text
from nvrx.nvrx_cli.main import cli
from tests.unit.test_timeline import TIMEOUTS, T, Node, _crash_run, _hang_run

REPO = Path(__file__).resolve().parents[2]
BAD_VALUES = ["x", "", None, [], {}, [1, 2], {"a": 1}, -1, 10**30, 1e308, -1e308, True, 0, "SIGSEGV", "nan"]
BAD_TIMES = [T - 1e6, T + 1e9, -5.0, 0.0, 1e15, 1e300]
TRIALS = 60
SINCE = datetime.fromtimestamp(T + 30).isoformat()


def _valid_logs(root: Path) -> dict[Path, list[str]]:
    """A crash, a hang with step sections and a resume driver's file: every event kind inspect reads."""
    _crash_run(root / "crash")
    _hang_run(root / "hang", hang_in_detail=True)
    n = Node(root / "steps", "hostB", 9)
    n.start(T, "steps")
    pids = n.round(T + 1, 0, [n.node_id], 0, run_at=T + 2)
    n.steps(0, pids[0], T + 2, T + 60, 0.5)
    n.mons[0].emit(TimeoutsSet(rank=0, updated=True, timeouts=TIMEOUTS, path="/s"), t=T + 61)
    n.agent.emit(AgentSignal(signal="SIGTERM", phase="running", round=0), t=T + 62)
    n.stop(T + 62, 0, "interrupted", StopDetail(signal="SIGTERM", signum=15), 0)
    n.end(T + 63, "interrupted", 143)
    n.close()
    resume = EventLog(root / "state" / "resume.jsonl", "resume")
    resume.emit(ResumeAttemptEnd(attempt=1, exit_code=143, cause="interrupted", finished=False, seconds=60.0), t=T + 64)
    resume.emit(ResumeDecision(action="continue", reason="interrupted", attempts=1, failures=0), t=T + 65)
    resume.emit(ResumeSubmit(status="submitted", job_id="2", method="sbatch", from_job="1", command=["sbatch"],
                             exclude=[]), t=T + 66)
    resume.close()
    return {p: p.read_text().splitlines() for p in sorted(root.rglob("*.jsonl"))}


def _mutate(e: dict, rng: random.Random) -> None:
    key = rng.choice([k for k in e if k != "ev"])
    if key == "t":
        e[key] = rng.choice(BAD_TIMES)
    elif isinstance(e[key], dict) and e[key] and rng.random() < 0.6:
        inner = rng.choice(list(e[key]))
        e[key][inner] = rng.choice(BAD_VALUES)
    else:
        e[key] = rng.choice(BAD_VALUES)


def _write_mutated(src: dict[Path, list[str]], base: Path, dst: Path, rng: random.Random, rate: float) -> None:
    for path, lines in src.items():
        out = []
        for line in lines:
            e = json.loads(line)
            if rng.random() < rate:
                _mutate(e, rng)
            out.append(json.dumps(e))
        target = dst / path.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(out) + "\n")


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, dict[Path, list[str]]]:
    root = tmp_path_factory.mktemp("valid")
    return root, _valid_logs(root)


def test_the_valid_logs_have_no_corrupt_line(valid):
    root, _ = valid
    rep = build_report([root])
    assert rep.corrupt["count"] == 0, rep.corrupt
    assert len(rep.jobs) == 3 and rep.faults


def test_mutated_field_types_never_raise(valid, tmp_path):
    root, src = valid
    rng = random.Random(20240501)
    runner = CliRunner()
    corrupt_seen = 0
    for trial in range(TRIALS):
        d = tmp_path / f"t{trial}"
        _write_mutated(src, root, d, rng, rate=0.3 if trial % 2 else 0.8)
        for args in ([], ["--json"], ["--rank", "1"], ["--since", SINCE], ["--tail", "0"]):
            res = runner.invoke(cli, ["inspect", *args, str(d)])
            where = f"trial {trial} {args}: {res.output[-400:]}"
            assert res.exit_code in (0, 2), where
            assert res.exception is None or isinstance(res.exception, SystemExit), (where, res.exc_info)
            assert "Traceback" not in res.output, where
        try:
            rep = build_report([d], Filters(rank=1))
        except NotARun:
            continue
        render_text(rep)
        json.dumps(rep.to_dict(), default=str)
        corrupt_seen += rep.corrupt["count"]
    assert corrupt_seen > 0  # the mutations were noticed and reported, not silently folded


@pytest.mark.integration  # starts a process / opens a socket
def test_the_real_entry_point_exits_cleanly_on_mutated_logs(valid, tmp_path):
    root, src = valid
    rng = random.Random(7)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for trial in range(3):
        d = tmp_path / f"t{trial}"
        _write_mutated(src, root, d, rng, rate=0.5)
        res = subprocess.run([sys.executable, "-m", "nvrx", "inspect", str(d)], capture_output=True,
                             text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert "Traceback" not in res.stderr + res.stdout and "Corrupt lines" in res.stdout


# ---------------------------------------------------------------- the audit's reproducers


def _one_event_run(tmp_path: Path, **changes: object) -> Path:
    """The crash run with one field of one event replaced: CHANGES maps 'ev.field' (or 'ev.a.b') to a value."""
    run = tmp_path / "run"
    _crash_run(run)
    for path in run.glob("*.jsonl"):
        lines = []
        for line in path.read_text().splitlines():
            e = json.loads(line)
            for where, value in changes.items():
                ev, *keys = where.split(".")
                if e["ev"] == ev:
                    target = e
                    for k in keys[:-1]:
                        target = target[k]
                    target[keys[-1]] = value
            lines.append(json.dumps(e))
        path.write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize("change, reason", [
    ({"agent_start.t": 1e15}, "event time 't' out of range"),
    ({"monitor_start.timeouts": "nan"}, "field 'timeouts' should be an object"),
    ({"monitor_start.timeouts.sections": 3}, "field 'timeouts.sections' should be an object of numbers"),
    ({"rdzv_join.node_id": ["a", "b"]}, "field 'node_id' should be a string"),
    ({"rdzv_stop.detail.tail": 5}, "field 'detail.tail' should be a list of strings"),
    ({"ft_config.config": {"rank_section_timeouts": [1]}}, "field 'config.rank_section_timeouts'"),
], ids=["t-1e15", "timeouts-nan", "sections-int", "node-id-list", "tail-int", "ft-config-sections"])
def test_wrongly_typed_record_is_a_corrupt_line(tmp_path, change, reason):
    rep = build_report([_one_event_run(tmp_path, **change)])
    assert rep.corrupt["count"] >= 1 and any(reason in x for x in rep.corrupt["first"]), rep.corrupt
    text = render_text(rep)
    assert "Corrupt lines" in text and reason in text


def test_field_problem_names_the_nested_field():
    assert field_problem({"ev": "rdzv_stop", "detail": {"hang": {"elapsed": "x"}}}) == \
        "field 'detail.hang.elapsed' should be a finite number, not \"x\""
    assert field_problem({"ev": "rank_start", "rank": True}) == "field 'rank' should be an integer, not true"
    assert field_problem({"ev": "rank_start", "rank": None, "pid": 3}) is None  # absent or null is fine
    assert field_problem({"ev": "not_known", "x": [1]}) is None


def test_a_dir_with_only_garbage_is_nothing_readable(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "agent-hostA-1.jsonl").write_bytes(b"garbage\n\0\0\0\n{\"ev\": 1}\n")
    with pytest.raises(NotARun, match="nothing readable: 1 event file"):
        build_report([run])
    res = CliRunner().invoke(cli, ["inspect", str(run)])
    assert res.exit_code == 2 and "nothing readable" in res.output and "Traceback" not in res.output
