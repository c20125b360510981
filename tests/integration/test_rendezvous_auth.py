"""Authenticated control records (issue 19): real `nvrx launch` agents on 127.0.0.1 with a job secret, and a
program without the secret writing straight into their rendezvous store with a plain torch TCPStore client.

What a forger can no longer do: stop the job, end it as failed or succeeded, spend the restart budget, keep a
node alive, or replay a record of an earlier round. What it gets: its records ignored, logged and shown by
`nvrx inspect`. Agents whose secrets differ stop at once with one line (exit 2) instead of hanging, and the store
host names them at once. (Replays from an earlier launch and forged counter bumps: tests/faults/test_store.py.)
"""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from tests.conftest import REPO, free_port, listening, one_line_error, wait_for
from tests.faults.conftest import FaultJob, one_line, secret_file, two_agents


@pytest.fixture
def job(tmp_path: Path):
    fj = FaultJob(tmp_path)
    yield fj
    fj.cleanup()


def forger(port: int) -> TCPStore:
    """A client of the agents' store that has no job secret: what any local user can open."""
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


# ---------------------------------------------------------------- real agents


def test_forged_and_replayed_records_are_ignored(job: FaultJob, tmp_path: Path) -> None:
    """Round 0 crashes (a real restart: the budget of 1 is spent); in round 1 a program without the secret writes
    a stop record, a give-up finished record, a replay of round 0's stop record, forged keepalives and bumps of
    every counter. The job must finish as if nothing happened: exit 0 on both agents, restart count 1 (a single
    forged fault would have given up: --max-restarts 1), every forged record logged and shown by inspect."""
    run = "forged"
    port, host, other = two_agents(job, run, secret_file(tmp_path / "secret"), 60, "crash", "--max-restarts", "1")
    job.wait_running(rank=0, attempt=1, timeout=180)  # generous: the machine may be heavily loaded
    store = forger(port)
    p = f"nvrx/{run}/"
    nodes = next(e["nodes"] for e in job.events(run) if e["ev"] == "rdzv_round" and e["round"] == 1)
    give_up = {"round": 1, "kind": "failed", "by_node": "intruder", "detail": {"describe": "forged"},
               "restart_count": 9, "give_up": True}
    store.set(p + "r1/stop", json.dumps(give_up))  # a forged stop: would end the job as failed
    store.set(p + "finished", json.dumps(give_up))  # a forged give-up record for late agents
    store.set(p + "r1/stop", store.get(p + "r0/stop"))  # a replay: round 0's real, signed stop record
    store.add(p + "restarts", 5)  # the restart counter before issue 19
    store.add(p + "r1/succeeded", 5)  # "every node succeeded"
    store.add(p + "r2/count", 3)  # join slots of the next round nobody fills
    for node in nodes:  # forged keepalives for both nodes
        store.set(p + f"r1/beat/{node}", "nvrx1:" + "0" * 64 + ':{"seq":1000000}')
    out_h, err_h = host.communicate(timeout=120)
    out_o, err_o = other.communicate(timeout=120)
    assert (host.returncode, other.returncode) == (0, 0), (err_h, err_o)
    one_line(err_h), one_line(err_o)  # no traceback of nvrx's own (round 0's rank errors are the script's)
    events = job.events(run)
    stops = [e for e in events if e["ev"] == "rdzv_stop"]
    assert {(e["round"], e["kind"], e["restart_count"]) for e in stops} == {(0, "failed", 1), (1, "succeeded", 1)}
    assert all(not e["give_up"] for e in stops)
    forged = {e["key"] for e in events if e["ev"] == "rdzv_forged_record"}
    assert p + "r1/stop" in forged, forged
    assert "unauthenticated record " + p + "r1/stop" in err_h + err_o
    ends = [e for e in events if e["ev"] == "job_end"]
    assert [e["status"] for e in ends] == ["succeeded", "succeeded"] and all(e["exit_code"] == 0 for e in ends)
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    report = job.run_inspect(run)
    assert "unauthenticated record " + p + "r1/stop" in report.stdout, report.stdout
    job.assert_clean()


def test_agents_with_different_secrets_fail_at_once(job: FaultJob, tmp_path: Path) -> None:
    """An agent whose secret differs from the store host's (or that has none) stops with one line, exit 2, before
    joining any round; the host's job is unaffected and ends cleanly when stopped."""
    port = free_port()
    job.ports.append(port)
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mismatch",
              "--nproc-per-node", "1", "--term-timeout", "2", *job.train(5)]
    host = job.start(*common, env={"NVRX_JOB_SECRET_FILE": str(secret_file(tmp_path / "a"))})
    assert wait_for(lambda: listening(port), 60)  # hosting the store, not only started
    wrong = secret_file(tmp_path / "b", b"another-secret-of-another-job-xyz")
    res = job.run(*common, env={"NVRX_JOB_SECRET_FILE": str(wrong)}, timeout=180)  # bounded; loaded machine
    one_line_error(res, "job secret", "differs", "127.0.0.1", "NVRX_JOB_SECRET_FILE")
    res = job.run(*common, timeout=180)
    # one warning line (no secret: records unauthenticated) is expected before the error line
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "protected by a job secret and this agent has none" in one_line(res.stderr)
    assert not [e for e in job.events("mismatch") if e["ev"] == "rdzv_join" and e.get("round") != 0]
    host.terminate()
    _, err = host.communicate(timeout=60)
    # the host said so at once (join_timeout is 600 s), naming where each came from
    where = f"an agent on host {socket.gethostname()} (pid "
    assert f"{where}" in err and "tried to join job mismatch with a different job secret (its secret: file " \
        f"{wrong})" in err, err
    assert "tried to join job mismatch with no job secret (its secret: none)" in err, err
    job.assert_clean()


def test_secret_file_readable_by_others_is_one_line(job: FaultJob, tmp_path: Path) -> None:
    shared = secret_file(tmp_path / "shared", mode=0o644)
    res = job.run("--standalone", "--job-secret-file", str(shared), *job.train(5), timeout=60)
    one_line_error(res, str(shared), "readable by others", "chmod 600")
    res = job.run("--standalone", *job.train(5), timeout=60, env={"NVRX_JOB_SECRET_FILE": str(tmp_path / "none")})
    one_line_error(res, "cannot open it", "head -c 32 /dev/urandom")
    assert job.ledger.entries() == []  # no rank ran
    job.assert_clean()


# ---------------------------------------------------------------- scale


@pytest.mark.alone  # a benchmark: 256 agents on 2 cores, keepalive timeouts of 1.5 s; another test beside it starves it
@pytest.mark.timeout(900)
def test_256_signed_agents_agree_on_the_rounds(tmp_path: Path, launcher) -> None:
    """256 simulated agents (bench/bench_rendezvous.py: the real Rendezvous, signing and checking every record)
    form round 0, restart into round 1 after a failure and notice a silent node, within a bound; every agent got
    the same members in both rounds and a distinct group rank that is its place among them."""
    out = tmp_path / "rdzv.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_rendezvous.py"), "--agents", "256", "--procs", "2",
           "--keepalive", "0.25,1.5", "--output", str(out)]
    res = subprocess.run(cmd, cwd=REPO, env=launcher.env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["agents"] == 256 and row["consistent"] is True, row
    assert row["dead_node_kinds"] == ["node_left"], row  # every agent saw the silent node's stop record
    assert launcher.leftovers() == []
