"""Fault matrix: the rendezvous store and the job's ports (endpoint, --master-port, forged records)."""

from __future__ import annotations

import datetime
import json
import re
import socket
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import TCPStore

from nvrx.launcher.agent.rdzv_auth import RecordAuth, load_secret
from nvrx.launcher.agent.rdzv_records import BadRecord, parse_closed, parse_join, parse_pg
from nvrx.launcher.agent.rendezvous import parse_stop
from nvrx.launcher.agent.store import learn_launch
from nvrx.events import StopDetail

from tests.conftest import free_port, listening, one_line_error, wait_for
from tests.faults.conftest import one_line, secret_file, two_agents



def _client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def _endpoint_args(job, run_id: str, *extra: str) -> list[str]:
    port = free_port()
    job.ports.append(port)
    return ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, *extra]


def test_garbage_stop_record_is_ignored(job):
    """Fault: a malformed record in the store: non-JSON bytes as the running round's stop record.
    Outcome: ignored (event rdzv_bad_record, one warning line); the job goes on and finishes, exit 0.
    """
    args = _endpoint_args(job, "garbage")
    proc = job.start(*args, "--nproc-per-node", "2", *job.train(30), env={"FAULT_STEP_TIME": "0.1"})
    job.wait_running()
    _client(job.ports[0]).set("nvrx/garbage/r0/stop", b"\xff\x00 not json")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "malformed record nvrx/garbage/r0/stop in the rendezvous store (not JSON); ignored" in err
    bad = [e for e in job.events("garbage") if e["ev"] == "rdzv_bad_record"]
    assert [(e["key"], e["problem"], e["action"]) for e in bad] == [("nvrx/garbage/r0/stop", "not JSON", "ignored")]
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_forged_round_record_is_ignored(job):
    """Fault: a forged record in the store: the next round's membership written by another program (no job secret).
    Outcome: its signature does not check: ignored (event rdzv_forged_record, one warning line); the agent closes
    round 1 itself (its record replaces exactly the forged bytes) and the job finishes after the crash, exit 0.
    """
    args = _endpoint_args(job, "forged")
    proc = job.start(*args, "--nproc-per-node", "2", "--max-restarts", "2", *job.train(30, "crash"),
                     env={"FAULT_STEP_TIME": "0.1"})
    job.wait_running()
    forged = b'{"round": 1, "restart_count": 0, "nodes": [{"node_id": "evil", "addr": "10.0.0.1", "nproc": 8}]}'
    _client(job.ports[0]).set("nvrx/forged/r1/closed", forged)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    one_line(err)  # no traceback of nvrx's own (the ranks' tracebacks after the crash are the script's)
    assert "unauthenticated record nvrx/forged/r1/closed in the rendezvous store (no signature" in err
    events = job.events("forged")
    bad = [e for e in events if e["ev"] == "rdzv_forged_record"]
    assert [(e["key"], e["action"], e.get("claims")) for e in bad] == [("nvrx/forged/r1/closed", "ignored", None)]
    rounds = [e for e in events if e["ev"] == "rdzv_round"]
    assert [(e["round"], e["restart_count"], e["world_size"]) for e in rounds] == [(0, 0, 2), (1, 1, 2)]
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_stop_record_naming_no_rank_says_who_wrote_it(job):
    """Fault: a stop record that names no rank (kind failed, empty detail), written into the store by a holder of the job secret.
    Outcome: the job ends as the record says (give_up: exit 1); the terminal and `nvrx inspect` name the node
    that wrote it, never "rank None".
    """
    args = _endpoint_args(job, "norank")
    secret = job.tmp_path / "secret"
    secret.write_bytes(b"the-job-secret-0123456789")
    secret.chmod(0o600)
    proc = job.start(*args, "--nproc-per-node", "1", "--max-restarts", "0", "--term-timeout", "2", *job.train(300),
                     env={"FAULT_STEP_TIME": "0.1", "NVRX_JOB_SECRET_FILE": str(secret)})
    job.wait_running()
    store = _client(job.ports[0])
    # written with the job's secret for this launch, as an agent of the job would (learnt from the store host like
    # any joining agent; one without the secret is ignored: test_rendezvous_auth), naming the round's one node
    auth = learn_launch(store, RecordAuth("norank", load_secret(secret), True, "test"), "127.0.0.1", job.ports[0], 60)
    (node,) = next(e["nodes"] for e in job.events("norank") if e["ev"] == "rdzv_round")
    record = {"round": 0, "kind": "failed", "by_node": node, "detail": {}, "restart_count": 1, "give_up": True}
    assert store.compare_set("nvrx/norank/r0/stop", "", auth.seal("nvrx/norank/r0/stop", 0, record))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "None" not in err, err
    assert f"node {node} reported a failure naming no rank" in err
    res = job.run_inspect("norank")
    # inspect names the node as its event files do (its node name, else the id the record gives)
    names = (node, socket.gethostname())
    assert "None" not in res.stdout and any(f"reported by node {n} that names no rank" in res.stdout for n in names)
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def _capture(port: int, keys: list[str], into: dict[str, bytes]) -> threading.Thread:
    """A thread that copies KEYS from the store at PORT as soon as each is written (what a spy of launch A keeps)."""
    def run() -> None:
        spy = _client(port)
        for key in keys:
            spy.wait([key], datetime.timedelta(seconds=300))
            into[key] = spy.get(key)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_replay_from_an_earlier_launch_ends_nothing(job, tmp_path):
    """Fault: signed records of an earlier launch of the same run id and job secret (as `nvrx resume` relaunches in
    one allocation), copied into the next launch's store: the finished record before its second agent joins,
    launch A's "succeeded" stop record while its ranks run.
    Outcome: every record is bound to its launch (a nonce the store host draws): the copies do not check and are
    ignored (event rdzv_forged_record); the new launch trains to its last step and both agents exit 0.
    """
    run, secret, p = "relaunch", secret_file(tmp_path / "secret"), "nvrx/relaunch/"
    port = free_port()
    job.ports.append(port)

    def launch(steps: int) -> list[str]:
        return ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run, "--nproc-per-node", "1",
                "--term-timeout", "5", *job.train(steps)]

    env = {"FAULT_STEP_TIME": "0.1", "NVRX_JOB_SECRET_FILE": str(secret)}
    saved: dict[str, bytes] = {}
    host = job.start(*launch(3), env=env)
    assert wait_for(lambda: listening(port), 60)
    spy = _capture(port, [p + "r0/closed", p + "r0/stop", p + "finished"], saved)
    other = job.start(*launch(3), env=env)
    assert (host.wait(timeout=180), other.wait(timeout=180)) == (0, 0)
    spy.join(10)
    assert len(saved) == 3 and b'"kind":"succeeded"' in saved[p + "r0/stop"], saved
    for f in job.out.glob("running.*"):
        f.unlink()  # launch B's ranks announce themselves afresh

    host = job.start(*launch(40), env=env)  # launch B: 37 more steps, about 4 s
    assert wait_for(lambda: listening(port), 60)
    evil = _client(port)
    evil.set(p + "finished", saved[p + "finished"])  # launch A's "the job succeeded", for the joining agent
    evil.set(p + "r0/closed", saved[p + "r0/closed"])
    other = job.start(*launch(40), env=env)
    job.wait_running(rank=0, attempt=0, timeout=180)
    evil.set(p + "r0/stop", saved[p + "r0/stop"])  # launch A's "succeeded", while launch B's ranks run
    out_h, err_h = host.communicate(timeout=180)
    out_o, err_o = other.communicate(timeout=180)
    assert (host.returncode, other.returncode) == (0, 0), (err_h, err_o)
    one_line(err_h), one_line(err_o)
    finished = [e["step"] for e in job.ledger.entries() if e["ev"] == "finished"]
    assert finished == [3, 40], job.ledger.entries()  # launch B ran to its end
    job.ledger.assert_no_saved_work_lost()
    events = job.events(run)
    forged = {e["key"] for e in events if e["ev"] == "rdzv_forged_record"}
    assert {p + "finished", p + "r0/closed", p + "r0/stop"} <= forged, forged
    assert "copied from another key, round, run or launch" in err_h + err_o
    assert "already" not in err_h + err_o  # no agent took launch A's end for this launch's
    job.assert_clean()


def test_a_forged_join_counter_bump_decides_nothing(job, tmp_path):
    """Fault: a program without the job secret adds 1000 to the next round's join counter while two agents train.
    Outcome: counters only wake agents up: after round 0's crash the agents claim free join slots and restart at
    once (not after join_timeout); the job finishes, exit 0, and no message repeats the forged number.
    """
    run = "bumped"
    port, host, other = two_agents(job, run, secret_file(tmp_path / "secret"), 40, "crash", "--max-restarts", "1",
                                    "--rdzv-conf", "join_timeout=30")
    job.wait_running(rank=0, attempt=0, timeout=180)
    store = _client(port)
    store.add(f"nvrx/{run}/r1/count", 1000)
    out_h, err_h = host.communicate(timeout=180)
    out_o, err_o = other.communicate(timeout=180)
    assert (host.returncode, other.returncode) == (0, 0), (err_h, err_o)
    one_line(err_h), one_line(err_o)
    assert not re.search(r"\b100[0-2]\b", err_h + err_o), err_h + err_o
    rounds = [e for e in job.events(run) if e["ev"] == "rdzv_round" and e["round"] == 1]
    assert len(rounds) == 2 and all(e["waited"] < 20 for e in rounds), rounds
    assert job.ledger.finished()
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


def test_rendezvous_port_in_use(job):
    """Fault: the rendezvous endpoint's port is held by another program.
    Outcome: one line naming the port, exit 2, before any rank starts.
    """
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = job.run("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "busy",
                      "--rdzv-conf", "join_timeout=2", *job.train(5), timeout=60)
    one_line_error(res, str(port), "in use")
    assert job.ledger.entries() == []
    job.assert_clean()


def test_master_port_in_use(job):
    """Fault: --master-port is held by another program.
    Outcome: checked before any rank starts: one line naming the port, exit 2 (no EADDRINUSE traceback in ranks).
    """
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = job.run("--standalone", "--master-port", str(port), *job.train(5), timeout=60)
    one_line_error(res, f"--master-port {port} is already in use")
    assert job.ledger.entries() == []  # no rank ran
    job.assert_clean()


def test_unreachable_endpoint(job):
    """Fault: the rendezvous endpoint cannot be reached (nobody answers at a non-local address).
    Outcome: one line after the join timeout, exit 2.
    """
    t0 = time.monotonic()
    res = job.run("--nnodes", "2", "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-id", "far",
                  "--rdzv-conf", "join_timeout=2", *job.train(5), timeout=60)
    one_line_error(res, "192.0.2.1:29400", "after")
    assert time.monotonic() - t0 < 30
    job.assert_clean()


def test_store_host_lost(job):
    """Fault: the agent hosting the rendezvous store is SIGKILLed (two agents, the other a client).
    Outcome: the other agent ends with one line "lost the rendezvous store", exit 1; its ranks are stopped.
    """
    port = free_port()
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hostlost",
              "--nproc-per-node", "1", "--term-timeout", "2"]
    host = job.start(*common, *job.train(1000), env={"FAULT_STEP_TIME": "0.1"})
    assert wait_for(lambda: listening(port), 60)  # HOST hosts the store, not OTHER
    other = job.start(*common, *job.train(1000), env={"FAULT_STEP_TIME": "0.1"})
    job.wait_running(rank=1)
    host.kill()
    host.communicate()
    _, err = other.communicate(timeout=120)
    assert other.returncode == 1, err
    assert "lost the rendezvous store" in one_line(err)
    job.ledger.assert_no_saved_work_lost()
    job.assert_clean()


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)
_KEYS = ["round", "restart_count", "nodes", "node_id", "addr", "nproc", "node_rank", "kind", "by_node", "detail",
         "give_up", "port", "error", "signum"]
_RECORDS = st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=8)


@settings(max_examples=200, deadline=None)
@given(raw=st.one_of(st.binary(max_size=64), _JSON.map(lambda v: json.dumps(v).encode()),
                     _RECORDS.map(lambda v: json.dumps(v).encode())))
def test_any_store_value_is_a_record_or_a_bad_record(raw):
    """Fault: arbitrary bytes or JSON (fuzzed) in place of any record the agents read from the store.
    Outcome: each parser returns a well-typed record or raises BadRecord (logged and ignored, or one line); never
    another exception, so never a traceback.
    """
    for parse in (parse_stop, parse_closed, parse_join, parse_pg):
        try:
            rec = parse(raw)
        except BadRecord:
            continue
        if parse is parse_stop:
            assert isinstance(rec.detail, StopDetail) and isinstance(rec.give_up, bool) and rec.round >= 0
        elif parse is parse_closed:
            assert all(isinstance(n["nproc"], int) and n["nproc"] >= 1 for n in rec["nodes"])
        elif parse is parse_pg and "error" not in rec:
            assert isinstance(rec["port"], int) and 0 < rec["port"] < 65536
