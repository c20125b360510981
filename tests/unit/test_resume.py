"""`nvrx resume` logic: the decision table, the state file (atomic, backed up, never loses counts),
progress detection, and the pure parts of submitting a continuation."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from nvrx.common import exit_codes
from nvrx.launcher.resume.progress import ProgressSource, newest_checkpoint_iteration, read_progress
from nvrx.slurm.nodes import SlurmFacts, find_bad_node
from nvrx.launcher.resume.driver import (CONTINUE, FINISHED, GIVE_UP, Decision, Limits, Outcome, classify, decide,
                             precheck, settle_lost_attempt, signal_reached_child)
from nvrx.launcher.resume.state import BACKUP_FILE, STATE_FILE, ResumeError, ResumeState, StateStore
from nvrx.slurm.submit import (SubmitError, command_of_job, parse_sbatch_job_id, sbatch_command, submit_env)
from nvrx.events import EventLog, JobEnd, RdzvJoin, RdzvRound, RdzvStop, StopDetail
from nvrx.nvrx_cli.resume_cmd import _log_dir_of

LIM = Limits(max_attempts=5, max_failures=2, max_no_progress=2)


def run(state: ResumeState, code: int, finished: bool = False, limits: Limits = LIM, **kw):
    return decide(state, Outcome(exit_code=code, finished=finished, **kw), limits)


# ---------------------------------------------------------------- decision table

@pytest.mark.parametrize("code,cause,failure,new_job", [
    (0, "clean_exit", 0, False),
    (1, "failed", 1, False),
    (137, "failed", 1, False),  # SIGKILL (OOM killer, kill -9) is not a graceful stop
    (139, "failed", 1, False),  # SIGSEGV
    (143, "interrupted", 0, True),  # SIGTERM: preemption / time limit
    (138, "interrupted", 0, True),  # SIGUSR1
    (140, "interrupted", 0, True),  # SIGUSR2
    (130, "interrupted", 0, True),  # SIGINT
    (16, "resume_elsewhere", 1, True),
])
def test_continue_rows(code, cause, failure, new_job):
    state, d = run(ResumeState(), code, exclude="node7")
    assert d.action == CONTINUE and d.exit_code == exit_codes.RESUME_CONTINUE == 3
    assert d.new_job is new_job
    assert (state.attempts, state.failures, state.last_cause, state.last_exit_code) == (1, failure, cause, code)
    assert state.history[-1]["cause"] == cause and state.history[-1]["attempt"] == 1
    assert state.excluded_nodes == (("node7",) if code == 16 else ())


@pytest.mark.parametrize("code", [0, 1, 17, 93, 143])
def test_finished_flag_wins_over_any_exit_code(code):
    state, d = run(ResumeState(attempts=4, failures=1), code, finished=True)
    assert d.action == FINISHED and d.exit_code == exit_codes.RESUME_FINISHED == 0
    assert state.finished and state.attempts == 5


def test_launch_usage_error_gives_up_without_sticking():
    state, d = run(ResumeState(), 2)
    assert d.action == GIVE_UP and "usage error" in d.reason
    assert state.failures == 1 and state.stopped is None
    assert precheck(state, finished=False, limits=LIM, tracked=False) is None


@pytest.mark.parametrize("code,needle", [(17, "validation"), (93, "not to be requeued")])
def test_stop_codes_give_up_and_stay_stopped(code, needle):
    state, d = run(ResumeState(), code)
    assert d.action == GIVE_UP and d.exit_code == exit_codes.RESUME_GIVE_UP == 4
    assert needle in d.reason and state.stopped
    again = precheck(state, finished=False, limits=Limits(0, 0, 0), tracked=False)
    assert again is not None and again.action == GIVE_UP and "--reset" in again.reason
    state, after = run(state, 143, limits=Limits(0, 0, 0))  # a later attempt does not revive the run
    assert after.action == GIVE_UP and "--reset" in after.reason


def test_max_failures_gives_up_and_interruptions_do_not_count():
    state = ResumeState()
    state, d = run(state, 143)
    state, d = run(state, 143)
    assert d.action == CONTINUE and state.failures == 0
    state, d = run(state, 1)
    assert d.action == CONTINUE and state.failures == 1
    state, d = run(state, 1)
    assert d.action == GIVE_UP and "--max-failures 2" in d.reason and state.failures == 2


def test_max_attempts_gives_up():
    state = ResumeState()
    for _ in range(4):
        state, d = run(state, 0)
        assert d.action == CONTINUE
    state, d = run(state, 0)
    assert d.action == GIVE_UP and "--max-attempts 5" in d.reason and state.attempts == 5


def test_zero_means_no_limit():
    state = ResumeState(attempts=1000, failures=1000, no_progress=1000)
    state, d = run(state, 1, limits=Limits(0, 0, 0), tracked=True, progress=None)
    assert d.action == CONTINUE


def test_no_progress_gives_up_and_progress_resets_the_count():
    state = ResumeState()
    state, d = run(state, 1, tracked=True, progress=100, progress_before=100, limits=Limits(0, 0, 2))
    assert state.no_progress == 1 and d.action == CONTINUE  # baseline from before the first attempt
    state, d = run(state, 1, tracked=True, progress=150, limits=Limits(0, 0, 2))
    assert state.no_progress == 0 and state.last_progress == 150
    state, d = run(state, 1, tracked=True, progress=150, limits=Limits(0, 0, 2))
    assert state.no_progress == 1 and d.action == CONTINUE
    state, d = run(state, 143, tracked=True, progress=None, limits=Limits(0, 0, 2))
    assert d.action == GIVE_UP and "stuck at 150" in d.reason and "--max-no-progress 2" in d.reason


def test_progress_not_tracked_never_gives_up_for_progress():
    state = ResumeState()
    for _ in range(5):
        state, d = run(state, 1, limits=Limits(0, 0, 1))
    assert d.action == CONTINUE and state.no_progress == 0


def test_precheck():
    assert precheck(ResumeState(), finished=False, limits=LIM, tracked=False) is None
    assert precheck(ResumeState(), finished=True, limits=LIM, tracked=False).action == FINISHED
    d = precheck(ResumeState(attempts=5), finished=False, limits=LIM, tracked=False)
    assert d.action == GIVE_UP and "--max-attempts" in d.reason
    d = precheck(ResumeState(failures=2), finished=False, limits=LIM, tracked=False)
    assert d.action == GIVE_UP and "--max-failures" in d.reason
    assert precheck(ResumeState(no_progress=9), finished=False, limits=LIM, tracked=False) is None
    assert precheck(ResumeState(no_progress=2), finished=False, limits=LIM, tracked=True).action == GIVE_UP


def test_lost_attempt_counts_as_attempt_not_failure():
    state = settle_lost_attempt(ResumeState(attempts=2, failures=1, running={"attempt": 3, "job_id": "7"}))
    assert (state.attempts, state.failures, state.last_cause, state.running) == (3, 1, "lost", None)
    assert state.history[-1]["job_id"] == "7"
    assert settle_lost_attempt(state) is state


def test_classify_matches_exit_code_table():
    assert classify(exit_codes.interrupted(15)) == "interrupted"
    assert classify(exit_codes.DO_NOT_REQUEUE) == "do_not_requeue"
    assert classify(exit_codes.VALIDATION_FAILED) == "validation_failed"
    assert classify(exit_codes.RESUME_ELSEWHERE) == "resume_elsewhere"
    assert classify(255) == "failed"
    assert Decision(GIVE_UP, "x").exit_code == 4


def test_exclude_target():
    one = SlurmFacts(job_id="1", node_name="n3", nodelist="n3", num_nodes=1)
    many = SlurmFacts(job_id="1", node_name="n1", nodelist="n[1-4]", num_nodes=4)
    assert one.exclude_target("node") == "n3"
    assert many.exclude_target("node") is None  # the batch host is not necessarily the bad node
    assert many.exclude_target("node", bad_node="n3") == "n3"
    assert many.exclude_target("job", bad_node="n3") == "n[1-4]"
    assert many.exclude_target("job") == "n[1-4]"
    assert SlurmFacts().exclude_target("node") is None
    assert SlurmFacts(job_id="5", restart_count=2).run_key == "5+requeue2"


def write_agent_logs(run_dir: Path, bad: str, t: float = 1000.0, nodes: tuple[str, ...] = ("n1", "n2")) -> None:
    """Agent logs of a launch on NODES in which a rank on node BAD exited 16 (as nvrx.launcher.agent.agent writes them)."""
    ids = {n: f"samehost-{100 + i}-abc{i}" for i, n in enumerate(nodes)}
    for i, node in enumerate(nodes):
        ev = EventLog(run_dir / f"agent-{node}-{100 + i}.jsonl", "agent")
        ev.emit(RdzvJoin(round=0, node_id=ids[node]), t=t)
        ev.emit(RdzvRound(round=0, group_rank=i, nodes=list(ids.values()), world_size=2, restart_count=0, waited=0.0),
                t=t)
        ev.emit(RdzvStop(round=0, kind="failed", by_node=ids[bad], restart_count=1, give_up=True,
                         detail=StopDetail(rank=nodes.index(bad), group_rank=nodes.index(bad), exitcode=16, steer=16,
                                           no_restart=True)), t=t + 5)
        ev.emit(JobEnd(status="steered", exit_code=16), t=t + 6)
        ev.close()


def test_find_bad_node_names_the_node_whose_rank_exited_16(tmp_path):
    write_agent_logs(tmp_path / "logs" / "55", bad="n2")
    assert find_bad_node(tmp_path / "logs", "55") == "n2"
    assert find_bad_node(tmp_path / "logs", None) == "n2"  # every run dir is searched
    assert find_bad_node(tmp_path / "logs", "55", since=1010.0) is None  # before this attempt
    write_agent_logs(tmp_path / "logs" / "55", bad="n1", t=2000.0, nodes=("n1", "n3"))  # a later launch
    assert find_bad_node(tmp_path / "logs", "55") == "n1"
    assert find_bad_node(tmp_path / "missing", "55") is None
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "agent-n9-1.jsonl").write_bytes(b"\0garbage\n{\"ev\": \"rdzv_stop\"}\n")
    assert find_bad_node(tmp_path / "junk", None) is None


def test_log_dir_of_the_launch_command():
    assert _log_dir_of(("srun", "-N2", "nvrx", "launch", "--log-dir", "L", "train.py")) == Path("L")
    assert _log_dir_of(("py", "-m", "nvrx", "launch", "--log-dir=L2", "t.py")) == Path("L2")
    assert _log_dir_of(("nvrx", "launch", "t.py", "--log-dir", "mine")) is None  # the script's own flag
    assert _log_dir_of(()) is None


def test_signal_reached_child():
    assert signal_reached_child("slurmstepd", "bash")  # the step daemon signalled every process
    assert not signal_reached_child("slurmstepd", "slurmstepd")  # --signal=B:... to `exec nvrx resume`
    assert not signal_reached_child("bash", "bash")  # kill from a shell
    assert not signal_reached_child(None, "bash")  # terminal


# ---------------------------------------------------------------- state file

def test_save_load_roundtrip_private_and_atomic(tmp_path):
    store = StateStore(tmp_path)
    store.open()
    try:
        state = store.save(ResumeState(attempts=3, failures=1, jobs=("11",), excluded_nodes=("n2",)))
        assert state.seq == 1
        state = store.save(replace(state, attempts=4))
        assert state.seq == 2
        for name in (STATE_FILE, BACKUP_FILE, "lock"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
        loaded = store.load()
        assert loaded.note is None and loaded.state == state
    finally:
        store.close()


def _corrupt(path: Path) -> bytes:
    data = b'{"attempts": 4, "fail'
    path.write_bytes(data)
    return data


def test_corrupt_state_recovered_from_backup_and_kept(tmp_path):
    store = StateStore(tmp_path)
    store.save(ResumeState(attempts=4, failures=2, no_progress=1))
    bad = _corrupt(tmp_path / STATE_FILE)
    loaded = store.load()
    assert (loaded.state.attempts, loaded.state.failures, loaded.state.no_progress) == (4, 2, 1)
    assert loaded.corrupt_copy is not None and loaded.corrupt_copy.read_bytes() == bad
    assert loaded.corrupt_copy.name.startswith("state.json.corrupt-")
    assert "corrupt" in loaded.note and "attempts 4, failures 2" in loaded.note and "\n" not in loaded.note
    store.save(loaded.state)
    assert json.loads((tmp_path / STATE_FILE).read_text())["attempts"] == 4


def test_both_copies_corrupt_recovered_from_event_snapshot(tmp_path):
    store = StateStore(tmp_path)
    state = store.save(ResumeState(attempts=6, failures=1))
    snapshots = [ResumeState(attempts=2).counts() | {"seq": 0}, state.counts(), {"junk": True}]
    _corrupt(tmp_path / STATE_FILE)
    (tmp_path / BACKUP_FILE).write_text("[]")
    loaded = store.load(lambda: snapshots)
    assert loaded.state.attempts == 6 and loaded.source == "resume.jsonl"


def test_unrecoverable_state_is_an_error_and_loses_nothing(tmp_path):
    store = StateStore(tmp_path)
    bad = _corrupt(tmp_path / STATE_FILE)
    for _ in range(2):  # the same error every time: the corrupt file is never replaced by zero counts
        with pytest.raises(ResumeError, match="corrupt.*--reset"):
            store.load()
        assert (tmp_path / STATE_FILE).read_bytes() == bad
    assert len(list(tmp_path.glob("state.json.corrupt-*"))) == 1


@pytest.mark.parametrize("raw,needle", [
    ({"version": 1, "attempts": -1}, "attempts"),
    ({"version": 1, "failures": "3"}, "failures"),
    ({"version": 2}, "version"),
    ({"version": 1, "history": {}}, "history"),
    ([1, 2], "object"),
])
def test_state_validation(raw, needle):
    with pytest.raises(ValueError, match=needle):
        ResumeState.from_dict(raw)


@pytest.mark.parametrize("field_value,needle", [
    ({"submitted": ["x"]}, "submitted holds \"x\", not an object"),
    ({"excluded_nodes": [5]}, "excluded_nodes holds 5, not a string"),
    ({"jobs": [None]}, "jobs holds null, not a string"),
    ({"history": [3]}, "history holds 3, not an object"),
    ({"running": {"attempt": "x"}}, "running.attempt is \"x\", not an integer"),
    ({"running": []}, "running is \\[\\], not an object"),
    ({"last_exit_code": "143"}, "last_exit_code is \"143\", not an integer"),
    ({"last_progress": True}, "last_progress is true, not an integer"),
    ({"finished": "no"}, "finished is \"no\", not true or false"),
    ({"stopped": 17}, "stopped is 17, not a string"),
    ({"seq": True}, "seq is true, not a count"),
])
def test_state_items_are_type_checked(field_value, needle):
    with pytest.raises(ValueError, match=needle):
        ResumeState.from_dict({"version": 1, "attempts": 1, **field_value})


def test_semantically_corrupt_state_is_recovered_from_the_backup_and_kept(tmp_path):
    store = StateStore(tmp_path)
    store.save(ResumeState(attempts=3, failures=1, excluded_nodes=("n2",)))
    bad = json.dumps({"version": 1, "seq": 9, "attempts": 1, "submitted": ["x"]}).encode()
    (tmp_path / STATE_FILE).write_bytes(bad)
    loaded = store.load()
    assert (loaded.state.attempts, loaded.state.failures, loaded.state.excluded_nodes) == (3, 1, ("n2",))
    assert loaded.corrupt_copy is not None and loaded.corrupt_copy.read_bytes() == bad
    assert "submitted holds" in loaded.note


def test_semantically_corrupt_state_without_backup_is_an_error_and_kept(tmp_path):
    bad = json.dumps({"version": 1, "seq": 3, "attempts": 1, "running": {"attempt": "x"}}).encode()
    (tmp_path / STATE_FILE).write_bytes(bad)
    snapshots = [{"version": 1, "seq": 4, "attempts": 2, "excluded_nodes": [5]}]  # also corrupt: not used
    with pytest.raises(ResumeError, match=r"state.json is corrupt \(running.attempt is \"x\", not an integer\)"):
        StateStore(tmp_path).load(lambda: snapshots)
    assert (tmp_path / STATE_FILE).read_bytes() == bad


def test_newer_backup_wins(tmp_path):
    store = StateStore(tmp_path)
    store.save(ResumeState(attempts=1))
    older = (tmp_path / STATE_FILE).read_bytes()
    store.save(ResumeState(attempts=2, seq=1))
    (tmp_path / STATE_FILE).write_bytes(older)  # e.g. restored from an old copy
    assert store.load().state.attempts == 2


def test_state_dir_checks(tmp_path):
    with pytest.raises(ResumeError, match="does not exist.*mkdir -p"):
        StateStore(tmp_path / "nope").open()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ResumeError, match="not a directory"):
        StateStore(tmp_path / "file").open()
    first = StateStore(tmp_path)
    first.open()
    try:
        with pytest.raises(ResumeError, match=f"pid {os.getpid()}"):
            StateStore(tmp_path).open()
    finally:
        first.close()
    second = StateStore(tmp_path)
    second.open()  # the lock is free again
    second.close()


# ---------------------------------------------------------------- progress

def test_progress_file(tmp_path):
    f = tmp_path / "progress"
    src = ProgressSource(progress_file=f)
    assert src.tracked and read_progress(src) is None
    f.write_text("1234\n")
    assert read_progress(src) == 1234
    f.write_text("step twelve")
    assert read_progress(src) is None
    assert not ProgressSource().tracked


@pytest.mark.parametrize("names,expected", [
    (["iter_0000100", "iter_0000250", "iter_0000020"], 250),
    (["step-5", "step_70", "step9"], 70),
    (["global_step40", "global_step400"], 400),
    (["checkpoint-500", "checkpoint-1500"], 1500),
    (["epoch=1-step=300.ckpt", "epoch=0-step=150.ckpt"], 300),
    (["model.pt", "iter_abc", "steps.txt", "notes"], None),
    ([], None),
])
def test_checkpoint_dir_scan(tmp_path, names, expected):
    for name in names:
        (tmp_path / name).mkdir()
    assert newest_checkpoint_iteration(tmp_path) == expected


def test_checkpoint_tracker_file_wins(tmp_path):
    (tmp_path / "iter_0000900").mkdir()  # half-written, not yet recorded by the tracker
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("800\n")
    assert newest_checkpoint_iteration(tmp_path) == 800
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "latest").write_text("global_step77")
    assert newest_checkpoint_iteration(ds) == 77
    assert newest_checkpoint_iteration(tmp_path / "missing") is None


def test_progress_takes_the_newest_source(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "iter_0000010").mkdir()
    (tmp_path / "p").write_text("12")
    assert read_progress(ProgressSource(tmp_path / "p", tmp_path / "ckpt")) == 12


# ---------------------------------------------------------------- submitting (pure parts)

def test_sbatch_command():
    cmd = sbatch_command("/usr/bin/sbatch", "42", Path("/job.sh"), ["n1", "n[3-4]"], ["--time=1:00:00"])
    assert cmd == ["/usr/bin/sbatch", "--parsable", "--dependency=afterany:42", "--exclude=n1,n[3-4]",
                   "--time=1:00:00", "/job.sh"]
    assert "--exclude" not in " ".join(sbatch_command("sbatch", "42", Path("/j"), []))


def test_parse_sbatch_job_id():
    assert parse_sbatch_job_id("123\n") == "123"
    assert parse_sbatch_job_id("124;cluster\n") == "124"
    with pytest.raises(SubmitError, match="no job id"):
        parse_sbatch_job_id("sbatch: error: Batch job submission failed")


def test_command_of_job():
    show = "JobId=7 JobName=x\n   Command=/home/u/run.sh\n   WorkDir=/home/u\n"
    assert command_of_job(show) == "/home/u/run.sh"
    assert command_of_job("JobId=7\n   Command=(null)\n") is None
    assert command_of_job("") is None


def test_submit_env_drops_job_values_keeps_conf():
    env = submit_env({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_CONF": "/etc/slurm.conf",
                      "SBATCH_ACCOUNT": "a", "PATH": "/bin"})
    assert env == {"SLURM_CONF": "/etc/slurm.conf", "SBATCH_ACCOUNT": "a", "PATH": "/bin"}
