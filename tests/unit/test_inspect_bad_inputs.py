"""`nvrx inspect` (terminal, JSON, --html) on bad input: one clear line or a report that says what it skipped.

Event files are written with the real writer (EventLog) and then damaged the ways issue 31 lists: lines cut off
mid-write (agent and monitor files), events of a newer and of an older nvrx (another schema version; records without
the fields added since; event names no longer known), two runs interleaved in one dir (two run ids, or one reused),
50 MB of one repeated event, and --html targets that cannot be written (no such dir, a dir, a fifo, a file as the
dir, a name too long, a read-only dir, the disk full). Never a traceback; the HTML of damaged input renders without
script errors in Chromium (when installed).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx.events import (AgentStart, EventLog, JobEnd, MonitorConnect, MonitorDied, MonitorDisconnect, RankStart,
                         RdzvJoin, RdzvRound, RdzvStop, SectionClose, StopDetail, TimeoutsInfo)
from tests.conftest import REPO
from tests.integration import browser

ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
T = 1_700_000_000.0


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvrx", "inspect", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


def write_run(run: Path, run_id: str, host: str, pid: int, t0: float, crash: bool = False) -> None:
    """One node, one rank, one round (crashing rank 0 with CRASH), written with the real writer."""
    node_id = f"{host}-{pid}-abcdef"
    agent = EventLog(run / f"agent-{host}-{pid}.jsonl", "agent")
    mon = EventLog(run / f"monitor-{host}-{pid}-0.jsonl", "monitor-0")
    agent.emit(AgentStart(pid=pid, nproc=1, nnodes="1:1", max_restarts=1, run_id=run_id), t=t0)
    agent.emit(RdzvJoin(round=0, node_id=node_id), t=t0 + 1)
    agent.emit(RdzvRound(round=0, group_rank=0, nodes=[node_id], world_size=1, restart_count=0, waited=0.1), t=t0 + 1)
    agent.emit(RankStart(local_rank=0, rank=0, pid=pid + 1, attempt=0, how="fork", seconds=0.01), t=t0 + 2)
    mon.emit(MonitorConnect(rank=0, global_rank=0, pid=pid + 1, generation=1, timeouts=TimeoutsInfo()), t=t0 + 2.5)
    mon.emit(SectionClose(rank=0, section="step", closes=10, last_duration=1.0, max_duration=1.0), t=t0 + 12)
    mon.emit(MonitorDisconnect(rank=0, pid=pid + 1, generation=1, reason="rank_exited"), t=t0 + 20)
    kind = "failed" if crash else "succeeded"
    detail = StopDetail(rank=0, local_rank=0, group_rank=0, pid=pid + 1, exitcode=3, tail=["boom"]) if crash \
        else StopDetail(nodes=1)
    agent.emit(RdzvStop(round=0, kind=kind, by_node=node_id, detail=detail, restart_count=int(crash), give_up=crash),
               t=t0 + 20)
    agent.emit(JobEnd(status="failed" if crash else "succeeded", exit_code=1 if crash else 0, seconds=21.0),
               t=t0 + 21)
    agent.close()
    mon.close()


def no_traceback(res: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-2000:]


def html_renders(run: Path, tmp_path: Path, *needles: str) -> str:
    """--html of RUN: written, self-contained, and (when Chromium is here) rendered without script errors."""
    page = tmp_path / f"{run.name}.html"
    res = inspect("--html", str(page), str(run))
    assert res.returncode == 0, res.stderr
    no_traceback(res)
    text = page.read_text()
    for needle in needles:
        assert needle in text
    if browser.chromium() is not None:
        shown = browser.render(page)
        assert shown.script_errors == [], shown.console
        assert 'data-ready="' in shown.dom
    return text


def test_truncated_lines_are_skipped_and_said(tmp_path):
    run = tmp_path / "cut"
    write_run(run, "cut", "h1", 100, T, crash=True)
    agent = run / "agent-h1-100.jsonl"
    data = agent.read_bytes().split(b"\n")
    data[2] = data[2][:30]  # a line cut off mid-write in the middle
    agent.write_bytes(b"\n".join(data) + b'{"v":1,"t":1700000030.0,"src":"agent","ev":"rdzv_st')  # and a torn last one
    monitor = run / "monitor-h1-100-0.jsonl"
    data = monitor.read_bytes().split(b"\n")
    data[1] = data[1][:50]  # a monitor line cut off too (monitor files are read lazily: still counted)
    monitor.write_bytes(b"\n".join(data))
    res = inspect(str(run))
    assert res.returncode == 0
    no_traceback(res)
    assert "Corrupt lines: 3 skipped" in res.stdout and "truncated line (cut off mid-write)" in res.stdout
    assert "monitor-h1-100-0.jsonl:2: truncated line" in res.stdout
    html_renders(run, tmp_path, "Skipped 3 line(s) that are not valid events")


def test_events_of_another_schema_version_are_counted_not_misread(tmp_path):
    run = tmp_path / "newer"
    write_run(run, "newer", "h1", 100, T)
    with open(run / "monitor-h1-100-0.jsonl", "a") as fh:
        for i in range(3):  # a newer nvrx's events, whose fields may mean something else
            fh.write(json.dumps({"v": 2, "t": T + 30 + i, "src": "monitor-0", "ev": "section_close", "rank": 0,
                                 "section": "step", "closes": "many"}) + "\n")
    res = inspect(str(run))
    assert res.returncode == 0, res.stderr
    no_traceback(res)
    assert "Events of another nvrx skipped: 3 of version 2" in res.stdout
    rep = json.loads(inspect("--json", str(run)).stdout)
    assert rep["corrupt"]["other_versions"] == {"2": 3} and rep["corrupt"]["count"] == 0
    html_renders(run, tmp_path, "Skipped 3 event(s) of schema version 2")
    # nothing but another version: one line saying so, exit 2
    only = tmp_path / "only"
    only.mkdir()
    (only / "agent-h1-1.jsonl").write_text(json.dumps({"v": 2, "t": T, "src": "agent", "ev": "agent_start"}) + "\n")
    res = inspect(str(only))
    assert res.returncode == 2 and "written by another nvrx: 1 of version 2" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    no_traceback(res)


def test_an_older_nvrx_s_events_are_read_for_what_they_have(tmp_path):
    """An older nvrx: events of schema version 0 (skipped, counted), version-1 records without the fields added
    since (read as unknown), an event name this nvrx no longer has (counted), and no checkpoint reports."""
    run = tmp_path / "older"
    old = [{"v": 0, "t": T, "src": "agent", "ev": "agent_start", "nproc": 1},
           {"v": 1, "t": T, "src": "agent", "ev": "agent_start", "pid": 100, "nproc": 1, "run_id": "older"},
           {"v": 1, "t": T + 1, "src": "agent", "ev": "rdzv_round", "round": 0, "nodes": ["h1-100-abcdef"]},
           {"v": 1, "t": T + 2, "src": "agent", "ev": "rank_start", "local_rank": 0, "rank": 0, "pid": 101},
           {"v": 1, "t": T + 3, "src": "agent", "ev": "rdzv_keepalive", "round": 0},
           {"v": 0, "t": T + 4, "src": "agent", "ev": "rdzv_stop", "round": 0, "kind": "failed"},
           {"v": 1, "t": T + 20, "src": "agent", "ev": "rdzv_stop", "round": 0, "kind": "failed",
            "detail": {"rank": 0, "exitcode": 3}},
           {"v": 1, "t": T + 21, "src": "agent", "ev": "job_end", "status": "failed", "exit_code": 1}]
    run.mkdir()
    (run / "agent-h1-100.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old))
    res = inspect(str(run))
    assert res.returncode == 0, res.stderr
    no_traceback(res)
    assert "round 0 stopped: rank 0 exited with code 3" in res.stdout
    assert "Events of another nvrx skipped: 2 of version 0" in res.stdout
    assert "Unknown events: 1 counted" in res.stdout and "agent/rdzv_keepalive: 1" in res.stdout
    rep = json.loads(inspect("--json", str(run)).stdout)
    assert rep["jobs"][0]["status"] == "failed" and rep["goodput"] is None and rep["checkpoints"] == []
    html_renders(run, tmp_path, "Skipped 2 event(s) of schema version 0", "rdzv_keepalive")


def test_two_launches_with_one_run_id_interleaved_in_one_dir_are_said(tmp_path):
    """A reused --rdzv-id: two launches write the same run dir at the same time, each with its own round 0."""
    run = tmp_path / "reused"
    write_run(run, "reused", "h1", 100, T, crash=True)
    write_run(run, "reused", "h2", 200, T + 0.5)
    res = inspect(str(run))
    assert res.returncode == 0, res.stderr
    no_traceback(res)
    assert "was logged with two different node lists" in res.stdout and "give each run its own --log-dir" in res.stdout
    html_renders(run, tmp_path, "two different node lists")


def test_two_runs_interleaved_in_one_dir_stay_two_jobs(tmp_path):
    run = tmp_path / "mixed"
    write_run(run, "first", "h1", 100, T, crash=True)
    write_run(run, "second", "h2", 200, T + 5)  # overlapping in time, another run id
    rep = json.loads(inspect("--json", str(run)).stdout)
    assert [(j["run_id"], j["status"]) for j in rep["jobs"]] == [("first", "failed"), ("second", "succeeded")]
    assert [j["nodes"] for j in rep["jobs"]] == [["h1"], ["h2"]]  # one name per node: its host
    assert all(it["job"] is not None for it in rep["timeline"])
    html_renders(run, tmp_path, "first", "second")


def test_fifty_megabytes_of_one_repeated_event_fold_into_one_entry(tmp_path):
    run = tmp_path / "flood"
    write_run(run, "flood", "h1", 100, T)
    line = EventLog(None, "agent").emit(MonitorDied(local_rank=0, pid=77, returncode=-9), t=T + 10)
    raw = (json.dumps(line, separators=(",", ":")) + "\n").encode()
    copies = (50 << 20) // len(raw) + 1
    with open(run / "agent-h1-100.jsonl", "ab") as fh:
        fh.write(raw * copies)
    res = inspect(str(run))
    assert res.returncode == 0, res.stderr[-2000:]
    no_traceback(res)
    died = [ln for ln in res.stdout.splitlines() if "the monitor of local rank 0" in ln]
    assert len(died) == 1 and f"(and {copies - 1} more times, the same)" in died[0]
    assert len(res.stdout.splitlines()) < 80
    text = html_renders(run, tmp_path)
    assert len(text) < 5_000_000


def test_an_html_target_that_cannot_be_written_is_one_line(tmp_path):
    run = tmp_path / "ok"
    write_run(run, "ok", "h1", 100, T)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    fifo = tmp_path / "pipe.html"
    os.mkfifo(fifo)
    (tmp_path / "afile").write_text("x")
    cases = [tmp_path / "no" / "such" / "r.html", tmp_path, fifo, tmp_path / "afile" / "r.html",
             tmp_path / ("r" * 300 + ".html"), locked / "r.html"]
    if os.geteuid() == 0:  # root writes anywhere: a read-only dir says nothing there
        cases.pop()
    for target in cases:
        res = inspect("--html", str(target), str(run))
        assert res.returncode == 2, (target, res.stdout, res.stderr)
        no_traceback(res)
        (line,) = [x for x in res.stderr.strip().splitlines() if "--html" in x]
        assert str(target) in line and res.stdout == ""
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # never replaced by the report
    assert not list(tmp_path.rglob("*.html*")) or list(tmp_path.rglob("*.html*")) == [fifo]


def test_a_write_that_fails_is_one_line_and_leaves_no_half_file(tmp_path, monkeypatch):
    """The disk fills up (or the dir goes away) while the report is written: one line, exit 1, no temp file."""
    import click

    from nvrx.inspection.run_report import build_report
    from nvrx.nvrx_cli import inspect_cmd

    run = tmp_path / "ok"
    write_run(run, "ok", "h1", 100, T)
    report = build_report([run])

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(inspect_cmd.os, "replace", full)
    target = tmp_path / "r.html"
    with pytest.raises(click.ClickException) as err:
        inspect_cmd._write_html(report, target)
    assert err.value.format_message() == f"--html {target}: cannot write it: No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]
