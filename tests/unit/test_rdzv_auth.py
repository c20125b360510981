"""The job secret and the signed control records (nvrx/launcher/agent/rdzv_auth.py): sign/verify, replay, the secret
file's checks, the proof that tells agents with different secrets apart, and the bounded reports of rejects."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from nvrx.launcher.agent.config import build_launch_config
from nvrx.launcher.agent.rdzv_auth import ForgedRecord, RecordAuth, RejectedRecords, load_secret
from nvrx.launcher.agent.rdzv_errors import RendezvousMismatch
from nvrx.launcher.agent.rdzv_records import BadRecord
from nvrx.launcher.agent.store import _verify_secret, record_auth
from nvrx.events import EventLog
from nvrx.common.errors import ConfigError


def secret_file(path: Path, content: bytes = b"s3cret-for-this-job-only-0123456789", mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path



def test_sign_verify_round_trip_and_replay() -> None:
    auth = RecordAuth("job", b"k" * 32, True, "test")
    key = "nvrx/job/r3/stop"
    sealed = auth.seal(key, 3, {"round": 3, "kind": "failed"})
    assert json.loads(auth.open(key, 3, sealed)) == {"round": 3, "kind": "failed"}
    with pytest.raises(ForgedRecord):  # the same bytes under the previous round's key: a replay
        auth.open("nvrx/job/r2/stop", 2, sealed)
    with pytest.raises(ForgedRecord):  # the right key, another round
        auth.open(key, 4, sealed)
    with pytest.raises(ForgedRecord):  # another run with the same secret
        RecordAuth("other", b"k" * 32, True, "test").open(key, 3, sealed)
    with pytest.raises(ForgedRecord):  # another secret
        RecordAuth("job", b"x" * 32, True, "test").open(key, 3, sealed)
    launch_a, launch_b = auth.for_launch("a" * 32), auth.for_launch("b" * 32)
    assert json.loads(launch_a.open(key, 3, launch_a.seal(key, 3, {"x": 1}))) == {"x": 1}
    with pytest.raises(ForgedRecord, match="launch"):  # the same run id and secret, an earlier launch (nvrx resume)
        launch_b.open(key, 3, launch_a.seal(key, 3, {"x": 1}))
    assert launch_a.proof() == launch_b.proof() == auth.proof()  # the secret's proof does not depend on the launch
    with pytest.raises(ForgedRecord):  # a body changed after signing
        auth.open(key, 3, sealed.replace("failed", "succeeded"))
    with pytest.raises(ForgedRecord, match="malformed signature"):
        auth.open(key, 3, "nvrx1:abc:{}")
    with pytest.raises(ForgedRecord):  # a record without a signature (the format before issue 19)
        auth.open(key, 3, json.dumps({"round": 3, "kind": "failed"}))
    with pytest.raises(BadRecord, match="not JSON"):
        auth.open(key, 3, b"\xff\x00")
    # the proof names the secret without revealing it, and differs between secrets and runs
    assert auth.proof() != RecordAuth("job", b"x" * 32, True, "t").proof() != RecordAuth.unauthenticated("job").proof()
    assert b"k" * 32 not in auth.proof().encode()


def test_secret_file_checks(tmp_path: Path) -> None:
    good = secret_file(tmp_path / "good")
    assert load_secret(good) == b"s3cret-for-this-job-only-0123456789"
    with pytest.raises(ConfigError, match=r"readable by others \(mode 0644\).*chmod 600"):
        load_secret(secret_file(tmp_path / "open", mode=0o644))
    with pytest.raises(ConfigError, match="is empty"):
        load_secret(secret_file(tmp_path / "empty", b"\n"))
    with pytest.raises(ConfigError, match="fewer than 16"):
        load_secret(secret_file(tmp_path / "short", b"abc"))
    with pytest.raises(ConfigError, match="cannot open it"):
        load_secret(tmp_path / "missing")



def test_secret_file_enters_through_the_config(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    raw = {"training_script": str(script), "nnodes": "2", "rdzv_endpoint": "127.0.0.1:29555", "rdzv_id": "j"}
    path = secret_file(tmp_path / "s")
    cfg = build_launch_config(raw, {"NVRX_JOB_SECRET_FILE": str(path)})
    assert cfg.rdzv.job_secret == load_secret(path) and cfg.rdzv.job_secret_file == str(path)
    assert "s3cret" not in repr(cfg.rdzv)  # never in a log line or traceback
    flag = build_launch_config({**raw, "job_secret_file": str(path)}, {})
    assert flag.rdzv.job_secret == cfg.rdzv.job_secret
    with pytest.raises(ConfigError, match="readable by others"):
        build_launch_config(raw, {"NVRX_JOB_SECRET_FILE": str(secret_file(tmp_path / "o", mode=0o640))})
    assert build_launch_config(raw, {}).rdzv.job_secret is None


def test_auth_source_per_setup(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    one = build_launch_config({"training_script": str(script)}, {}).rdzv  # one node: --standalone
    a, b = record_auth(one), record_auth(one)
    assert a.authenticated and a.source == "generated" and a.key != b.key  # fresh per agent, never shared
    many = build_launch_config({"training_script": str(script), "nnodes": "2", "rdzv_endpoint": "h:1"}, {}).rdzv
    with caplog.at_level(logging.WARNING):
        auth = record_auth(many)
    assert not auth.authenticated
    assert [r.getMessage() for r in caplog.records if "not authenticated" in r.getMessage()], caplog.text


def test_secret_mismatch_messages() -> None:
    mine = RecordAuth("job", b"a" * 32, True, "file /p/a")
    _verify_secret(mine.proof(), mine, "h", 1)  # the same secret: no error
    with pytest.raises(RendezvousMismatch, match=r"job secret \(file /p/a\) differs .* at h:1; give every agent"):
        _verify_secret(RecordAuth("job", b"b" * 32, True, "x").proof(), mine, "h", 1)
    with pytest.raises(RendezvousMismatch, match="has a job secret .* the agent hosting the rendezvous at h:1 has none"):
        _verify_secret(RecordAuth.unauthenticated("job").proof(), mine, "h", 1)
    with pytest.raises(RendezvousMismatch, match="protected by a job secret and this agent has none"):
        _verify_secret(mine.proof(), RecordAuth.unauthenticated("job"), "h", 1)


def test_rejected_records_are_reported_once_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[dict] = []
    events = EventLog(None, "agent")
    events.subscribe(seen.append)
    rejected = RejectedRecords(events, logging.getLogger("test.rejected"))
    forged = ForgedRecord("signature does not match")
    raw = b"nvrx1:" + b"0" * 64 + b':{"by_node":"intruder"}'
    rejected.report("nvrx/j/r0/stop", raw, forged, "ignored")
    rejected.report("nvrx/j/r0/stop", raw, forged, "ignored")  # the same value again: not reported twice
    assert [(e["ev"], e["key"], e["claims"]) for e in seen] == [("rdzv_forged_record", "nvrx/j/r0/stop", "intruder")]
    for i in range(1000):  # a flood of distinct forged values: 19 more fit in the first window, 981 do not
        rejected.report(f"nvrx/j/r0/beat/{i}", raw, forged, "ignored")
    assert len(seen) == RejectedRecords.BURST
    rejected._window_start -= RejectedRecords.WINDOW + 1  # the next window
    rejected.report("nvrx/j/r1/stop", b"\xff", BadRecord("not JSON"), "ignored")
    assert seen[-1]["ev"] == "rdzv_bad_record"
    assert "(981 more ignored records not logged)" in caplog.text
