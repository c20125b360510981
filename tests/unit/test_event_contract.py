"""The contract between event writers and `nvrx inspect`: every event is a record of nvrx.events.

* every ``.emit(`` call in our packages passes a record (checked on the source, by AST);
* every record has a reader in `nvrx inspect` (timeline dispatch) or is listed in its NOT_SHOWN set;
* the reader's field types are the records' annotations, and a wrongly typed field of any record is caught;
* every record, written with generated sample values through a real EventLog file and read by the real
  inspect backend (Timeline, run_report) and renderers (nvrx_cli: text, JSON, the terminal status line),
  comes out with its values where the reader shows them; a field that is not shown is listed in
  FIELDS_NOT_SHOWN with the reason. A field renamed on one side fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import itertools
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from nvrx import events
from nvrx.events import (
    EVENT_FIELDS, NESTED, RECORDS, AgentStart, EventLog, Event, FtConfig, FtConfigInfo, HangDetected, HangInfo,
    HeartbeatStats, JobEnd, JobFailure, MonitorConnect, MonitorDisconnect, MonitorSpawned, MonitorStart, RankStart, RdzvJoin, RdzvRound, RdzvStop, Record, ResumeEnd, ResumeLimits, ResumeStart, SectionClose, StopDetail,
    TimeoutsInfo, field_problem, read_events, spec_of,
)
from nvrx.inspection.run_report import build_report
from nvrx.inspection.timeline import AGENT_HANDLERS, MONITOR_HANDLERS, NOT_SHOWN, RERUN_LEVEL, RESUME_LEVEL
from nvrx.nvrx_cli.inspect_cmd import render_text
from nvrx.nvrx_cli.inspect_text import RERUN_TEXT, RESUME_TEXT, report_dict
from nvrx.nvrx_cli.status import StatusPrinter

REPO = Path(__file__).resolve().parents[2]
from tests.conftest import package_modules

# ================================================================ 1. writers emit records


def _record_names(tree: ast.Module) -> set[str]:
    """Names under which the module can call a record class: imported (maybe renamed) or via the module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "nvrx.events":
            names |= {a.asname or a.name for a in node.names if a.name in {c.__name__ for c in RECORDS.values()}}
    return names


def _makes_record(node: ast.expr, names: set[str], helpers: set[str], bound: dict[str, ast.expr]) -> bool:
    """NODE evaluates to a record: a record constructor, a helper annotated to return one, or a name bound to one."""
    if isinstance(node, ast.Name) and node.id in bound:
        return _makes_record(bound[node.id], names, helpers, {})
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in names or f.id in helpers
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "events":
        return f.attr in {c.__name__ for c in RECORDS.values()}
    return False


def emit_problems(source: str) -> list[int]:
    """Lines of SOURCE where `.emit` is used other than with exactly one event record (plus an optional t=)."""
    tree = ast.parse(source)
    names = _record_names(tree)
    helpers = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
               and isinstance(fn.returns, ast.Name) and fn.returns.id in names}
    # node -> its innermost enclosing function (a function node is its own scope), or the module: one pass
    scope: dict[int, ast.AST] = {id(tree): tree}
    todo: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while todo:
        node, fn = todo.pop()
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            scope[id(child)] = inner
            todo.append((child, inner))
    bindings: dict[int, dict[str, ast.AST]] = {}  # per scope: names assigned in it (nested functions included)
    problems, called = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit":
            called.add(id(node.func))
            where = scope[id(node)]
            if id(where) not in bindings:
                bindings[id(where)] = {t.id: n.value for n in ast.walk(where) if isinstance(n, ast.Assign)
                                       for t in n.targets if isinstance(t, ast.Name)}
            bound = bindings[id(where)]
            if not (len(node.args) == 1 and _makes_record(node.args[0], names, helpers, bound)
                    and all(k.arg == "t" for k in node.keywords)):
                problems.append(node.lineno)
    # `emit` taken without calling it (e.g. `log = events.emit`) would escape the check
    problems += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "emit"
                 and id(n) not in called]
    return sorted(problems)


def test_every_emit_in_our_packages_passes_a_record():
    files = [p for _, p in package_modules()] + sorted((REPO / "bench").glob("*.py"))
    assert len(files) > 50
    problems = [f"{p}:{line}" for p in files for line in emit_problems(p.read_text())]
    assert problems == []


def test_the_emit_check_catches_strings_dicts_and_unknown_calls():
    source = ("from nvrx.events import RdzvJoin as J\n"
              "def f(log, d):\n"
              "    log.emit(J(round=0, node_id='n'), t=1.0)\n"    # fine
              "    log.emit('rdzv_join', round=0)\n"             # a string name
              "    log.emit(**d)\n"                              # loose fields
              "    log.emit(dict(round=0))\n"                    # not a record
              "    x = d\n"
              "    log.emit(x)\n"                                # a name not bound to a record
              "    log.emit(J(round=0, node_id='n'), extra=1)\n" # a keyword besides t=
              "    g = log.emit\n"                               # the bound method escapes
              "    r = J(round=1, node_id='n')\n"
              "    log.emit(r)\n")                               # fine: bound to a record
    assert emit_problems(source) == [4, 5, 6, 8, 9, 10]


def test_event_log_refuses_anything_but_a_record(tmp_path):
    log = EventLog(tmp_path / "agent-x-1.jsonl", "agent")
    for bad in ("rdzv_join", {"ev": "rdzv_join"}, StopDetail(rank=1)):
        with pytest.raises(TypeError, match="takes an event record"):
            log.emit(bad)  # type: ignore[arg-type]
    log.close()
    assert (tmp_path / "agent-x-1.jsonl").read_text() == ""


# ================================================================ 2. every record has a reader


def test_every_record_has_a_reader_or_is_not_shown_on_purpose():
    by_source = {"agent": AGENT_HANDLERS, "monitor": MONITOR_HANDLERS, "resume": RESUME_LEVEL, "rerun": RERUN_LEVEL}
    missing = [cls.__name__ for cls in RECORDS.values() if cls not in by_source[cls.SOURCE] and cls not in NOT_SHOWN]
    assert missing == []
    assert set(RESUME_TEXT) == set(RESUME_LEVEL)  # the backend reads them, the renderer words them
    assert set(RERUN_TEXT) == set(RERUN_LEVEL)
    for source, table in by_source.items():  # a reader registered for another writer's file is never called
        assert [c.__name__ for c in table if c.SOURCE != source] == []
    assert not set(NOT_SHOWN) & {c for t in by_source.values() for c in t}  # shown or not: one of them


# ================================================================ 3. field types come from the records


def _shape(spec: Any) -> Any:
    """A spec with each field type by its name (types holding checks compare by identity)."""
    return {k: _shape(v) for k, v in spec.items()} if isinstance(spec, dict) else spec.name


def test_the_readers_field_types_are_derived_from_the_records():
    assert set(EVENT_FIELDS) == set(RECORDS)
    for name, cls in RECORDS.items():
        assert _shape(EVENT_FIELDS[name]) == _shape(spec_of(cls))
        free = {f.name for f in dataclasses.fields(cls) if f.type is Any}
        assert set(EVENT_FIELDS[name]) == {f.name for f in dataclasses.fields(cls)} - free
    assert _shape(EVENT_FIELDS["rdzv_round"]) == {
        "round": "an integer", "group_rank": "an integer", "nodes": "a list of strings", "world_size": "an integer",
        "restart_count": "an integer", "waited": "a finite number"}


def _wrong_value(kind: Any) -> Any:
    """A value of another JSON type than KIND accepts."""
    if isinstance(kind, dict):
        return 3
    return next(v for v in ("x", 5, True, [{"x": 1}], {"x": [1]}) if not kind.accepts(v))


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_a_wrongly_typed_field_of_any_record_is_caught(name):
    for field, kind in EVENT_FIELDS[name].items():
        value, where = _wrong_value(kind), field
        problem = field_problem({"ev": name, field: value})
        assert problem is not None and f"field {where!r}" in problem, (name, field, problem)
        if isinstance(kind, dict):  # and inside a nested object: each of its fields
            for inner, inner_kind in kind.items():
                problem = field_problem({"ev": name, field: {inner: _wrong_value(inner_kind)}})
                assert problem is not None and f"field '{field}.{inner}'" in problem, (name, field, inner, problem)


def test_nested_structures_match_what_the_writers_hand_over():
    from nvrx.launcher.resume.driver import Limits
    from nvrx.monitors.ft_config import FaultToleranceConfig
    from nvrx.monitors.timeouts import Timeouts

    names = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    assert names(FtConfigInfo) == set(FaultToleranceConfig().to_dict())
    assert names(TimeoutsInfo) == set(Timeouts().to_dict())
    assert names(ResumeLimits) == {f.name for f in dataclasses.fields(Limits)}
    assert names(HangDetected) | {"t", "stalled_first"} == names(HangInfo)  # the stop's copy of the monitor's event
    assert names(StopDetail) | {"kind"} == names(JobFailure)
    assert all(issubclass(c, Record) and not issubclass(c, Event) for c in NESTED)


def test_a_dict_key_a_record_lacks_is_reported_not_silently_lost(caplog):
    with caplog.at_level("WARNING", logger="nvrx.events"):
        d = StopDetail.of({"rank": 3, "tail": ["x"], "new_thing": 1})
    assert d.rank == 3 and d.tail == ["x"]
    assert "StopDetail has no field(s) new_thing" in caplog.text


# ================================================================ 4. round trip: writer -> file -> inspect

T = 1_700_000_000.0
HOST, NODE_ID, PIDS = "hostA-7", "hostA-7-abcdef", (70101, 70102)
TIMEOUTS = TimeoutsInfo(initial_heartbeat=600.0, heartbeat=300.0, sections={"step": 30.0})

# Fields that tie a sample to the scenario (the round, the rank and its process): set, not checked by value.
CONTEXT = {"round": 0, "rank": 1, "local_rank": 1, "global_rank": 1, "pid": PIDS[1], "generation": 1,
           "node_id": NODE_ID, "by_node": NODE_ID}

# Values a reader branches on, per record (dotted paths reach into nested records); several variants of
# one record are all written, each in its own run, and a field counts as shown if any variant shows it.
VARIANTS: dict[type[Event], list[dict[str, Any]]] = {
    RdzvStop: [{"kind": "failed", "give_up": False},                                 # a hang's cause
               {"kind": "failed", "detail.hang": None, "detail.monitor_failed": True},  # a monitor kept dying
               {"kind": "failed", "detail.hang": None, "detail.monitor_failed": None, "detail.abandoned": True},
               {"kind": "failed", "detail.hang": None, "detail.monitor_failed": None, "detail.abandoned": None,
                "detail.steer": 16},
               {"kind": "failed", "detail.hang": None, "detail.monitor_failed": None, "detail.abandoned": None,
                "detail.signal": None, "detail.steer": None},                     # the rank's recorded error
               {"kind": "failed", "detail.error": None},                         # no error file: output tail
               {"kind": "node_left"}, {"kind": "interrupted"}, {"kind": "scale_up"}],
    JobEnd: [{"status": "failed"}],
    RECORDS["agent_signal"]: [{"phase": "rendezvous"}],
    RECORDS["rank_exit"]: [{"exitcode": 1}],
    RECORDS["resume_submit"]: [{"status": "submitted"}, {"status": "failed"}],
    RECORDS["inprocess_rank_lost"]: [{}, {"signal": None}],
    HeartbeatStats: [{"count": 50}],
    RECORDS["node_health"]: [{"ok": True}, {"ok": False}],
    RECORDS["section_open"]: [{"section": "checkpointing"}],
    RECORDS["straggler"]: [{"state": "straggler"}, {"state": "recovered"}],
}

# Fields the reader does not show, and why. Every other field must come out of the round trip.
FIELDS_NOT_SHOWN: dict[str, str] = {
    "agent_start.pid": "the agent's pid: its file name has it",
    "ft_config.config.log_level": "the monitors' log level: not about the run",
    "fork_server_ready.*": "start-up detail: the fork server was ready (timing is in bench/)",
    "monitor_died.pid": "a dead monitor's pid: gone, the local rank says which",
    "monitor_gave_up.pid": "a dead monitor's pid: gone, the local rank says which",
    "monitor_stuck.pid": "shown, but it is the only field and a context value (the pid)",
    "rdzv_round.group_rank": "this agent's group rank: the nodes list has the order",
    "rdzv_stop.detail.round": "the stop's round is the event's",
    "rdzv_stop.detail.describe": "the agent's own sentence; inspect words the cause from the fields",
    "rdzv_stop.detail.signum": "the signal's number: its name is shown",
    "rdzv_stop.detail.error.file": "a path on the failed rank's node: the terminal's failure report shows it",
    "rdzv_stop.detail.error.exc_type": "the start of the error's message, which is shown",
    "rdzv_stop.detail.error.timestamp": "when the rank recorded its error: the fault's time is shown",
    "rdzv_stop.detail.error.error_code": "a @record parent's copy of its child's exit code: the exit code is shown",
    "rdzv_stop.detail.no_restart": "implied by steer / give_up, which are shown",
    "rdzv_stop.detail.nodes": "succeeded stops are not faults",
    "rdzv_stop.detail.hang.rank": "the monitor's local rank: the stop names the global rank",
    "rdzv_stop.detail.hang.generation": "the monitor's session counter",
    "node_health.checks.seconds": "per check timing: the pass's total is shown",
    "rank_timing.*": "input of straggler detection (the agents compare the ranks); straggler events are shown",
    "straggler.since": "shown as a time of day (ISO), not as the number",
    "rank_start.attempt": "the round's restart count is shown",
    "rank_start.how": "fork or spawn: start-up detail",
    "rank_start.seconds": "start-up detail",
    "rank_exit.*": "folded into the fault's time; the stop record names the exit",
    "rank_stuck.attempt": "the round is shown",
    "rank_stuck.status": "psutil's word for the state, which is shown",
    "agent_killed_rank.attempt": "the round is shown",
    "job_end.seconds": "the job's span is computed from its events",
    "job_end.failures": "the same faults as the rdzv_stop records, which inspect shows; the terminal's failure "
                        "report shows their round, node, describe and tail",
    "monitor_start.pid": "the monitor's pid: not about the rank",
    "monitor_start.socket": "the monitor's control socket: internal",
    "monitor_start.check_interval": "the configured interval is shown (ft_config)",
    "monitor_start.timeouts": "in force until a rank connects: the connect's timeouts are shown",
    "monitor_exit.*": "ends the monitor's rank session (its end reason is kept, not shown)",
    "monitor_attach.armed": "whether deadlines run yet: internal to the monitor",
    "monitor_attach.reattach": "a restarted monitor re-attached: monitor restarts are counted",
    "monitor_disconnect.reason": "ends the rank session",
    "heartbeat_stats.since_last": "used for the last progress (goodput), not shown as such",
    "heartbeat_stats.auto_since_last": "used for the last progress (goodput), not shown as such",
    "section_open.section": "an open section is shown (open_sections) only while the rank runs",
    "section_open.open_for": "an open section is shown (open_sections) only while the rank runs",
    "section_close.last_duration": "the batch's total and max are shown",
    "hang_detected.generation": "the monitor's session counter",
    "hang_detected.timeouts": "the timeouts in force are shown per rank",
    "rank_terminated.*": "the hang it follows names the signal; an error is kept with the hang",
    "rank_killed.rank": "the monitor's local rank: the entry names the global rank of the session",
    "timeouts_set.updated": "whether they changed: the values are shown",
    "timeouts_set.path": "the state file: internal",
    "timeouts_loaded.*": "the timeouts in force are shown per rank",
    "resume_start.pid": "the driver's pid",
    "resume_start.state_dir": "the state dir is what inspect reads",
    "resume_start.finished_flag": "a path: the decision says whether it was found",
    "resume_start.limits": "the decision says which limit stopped the run",
    "resume_start.submit": "resume_submit shows the method",
    "resume_start.command": "the launch command: long, and the same every attempt",
    "resume_attempt_start.command": "the launch command: long, and the same every attempt",
    "resume_attempt_end.job_id": "resume_attempt_start shows where",
    "resume_attempt_end.node": "resume_attempt_start shows where",
    "resume_attempt_end.start": "its own event is the start",
    "resume_decision.check": "--check decisions read like the others",
    "resume_decision.new_job": "the action says it",
    "resume_decision.no_progress": "a counter of the budget; the reason names it when it decides",
    "resume_decision.last_progress": "resume_attempt_end shows the progress",
    "resume_decision.last_cause": "resume_attempt_end shows the cause",
    "resume_decision.state": "the state snapshot: a recovery copy",
    "resume_submit.command": "the sbatch/scontrol command line",
    "resume_submit.ok": "the status says it",
    "resume_submit.state": "the state snapshot: a recovery copy",
    "resume_signal.sender_pid": "who sent the signal: a pid",
    "resume_end.reason": "the last resume_decision shows it",
    "resume_state_recovered.corrupt_copy": "the note names the copy",
}


class Samples:
    """Distinct, recognisable values per field type; Samples.found() tells whether one came out."""

    FLOATS = [1.373, 2.417, 3.593, 4.731, 5.879, 6.197, 7.433, 8.617, 9.173, 1.937, 2.879, 3.319, 4.673, 5.297]

    def __init__(self) -> None:
        self.n = itertools.count()

    def value(self, tp: Any, path: str) -> Any:
        members = [a for a in typing.get_args(tp) if a is not type(None)] if isinstance(tp, types.UnionType) else [tp]
        tp = str if len(members) > 1 else members[0]  # int | str: a string
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        n = next(self.n)
        if tp is bool:
            return True
        if tp is int:
            return 97301 + n
        if tp is float:
            return self.FLOATS[n % len(self.FLOATS)] + 10 * (n // len(self.FLOATS))
        if tp is str or tp is Any:
            return f"Mk{n}q"
        if isinstance(tp, type) and issubclass(tp, Record):
            return self.record(tp, path)
        if origin is list:
            return [self.value(args[0], path)]
        if origin is dict:
            return {f"Mk{n}k": self.value(args[1], path)}
        raise TypeError(f"no sample for {tp} at {path}")

    def record(self, cls: type[Record], path: str, overrides: dict[str, Any] | None = None) -> Record:
        overrides = overrides or {}
        kw = {}
        for f in dataclasses.fields(cls):
            sub = f"{path}.{f.name}"
            if f.name in overrides:
                kw[f.name] = overrides[f.name]
            elif f.name in CONTEXT and issubclass(cls, Event):
                kw[f.name] = CONTEXT[f.name]
            else:
                inner = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith(f.name + ".")}
                value = self.value(f.type, sub)
                if inner and isinstance(value, Record):
                    value = self.record(type(value), sub, inner)
                kw[f.name] = value
        return cls(**kw)


def leaves(rec: Record, path: str, fixed: set[str]) -> list[tuple[str, Any, bool]]:
    """(dotted field path, value, checked) of every field of REC and its nested records; context values,
    values FIXED by a variant, None and booleans are not checked (they are not recognisable)."""
    out = []
    for f in dataclasses.fields(rec):
        value, sub = getattr(rec, f.name), f"{path}.{f.name}"
        if isinstance(value, Record):
            out += leaves(value, sub, fixed)
        elif isinstance(value, list) and value and isinstance(value[0], Record):
            out += leaves(value[0], sub, fixed)
        elif isinstance(value, dict):
            out += [(sub, k, True) for k in value] + [(sub, v, True) for v in value.values()]
        elif isinstance(value, list):
            out += [(sub, v, True) for v in value]
        else:
            contextual = f.name in CONTEXT and isinstance(rec, Event)
            unchecked = contextual or sub in fixed or value is None or isinstance(value, bool)
            out.append((sub, value, not unchecked))
    return out


def _shown_in(value: Any, corpus: str) -> bool:
    if isinstance(value, float):  # as written, or as a person reads it
        return any(s in corpus for s in {repr(value), f"{value:.2f}", f"{value:g}"})
    return str(value) in corpus


def base_scenario(run: Path) -> list[tuple[str, Event, float]]:
    """One job of one node, two ranks, one round that succeeds: (file, record, time) in writing order."""
    ft = FtConfigInfo(workload_check_interval=5.0, rank_heartbeat_timeout=300.0, rank_termination_signal="SIGKILL")
    out: list[tuple[str, Event, float]] = [
        ("agent", AgentStart(pid=1, nproc=2, nnodes="1:1", max_restarts=3, run_id="rt"), T),
        ("agent", FtConfig(config=ft), T)]
    out += [("agent", MonitorSpawned(local_rank=lr, pid=600 + lr), T) for lr in (0, 1)]
    out += [("agent", RdzvJoin(round=0, node_id=NODE_ID), T + 1),
            ("agent", RdzvRound(round=0, group_rank=0, nodes=[NODE_ID], world_size=2, restart_count=0, waited=0.01),
             T + 1)]
    out += [("agent", RankStart(local_rank=lr, rank=lr, pid=PIDS[lr], attempt=0, how="fork", seconds=0.1), T + 2)
            for lr in (0, 1)]
    for lr in (0, 1):
        out += [(f"mon{lr}", MonitorStart(rank=lr, pid=600 + lr, socket="/s", timeouts=TIMEOUTS, check_interval=5.0),
                 T + 0.1),
                (f"mon{lr}", MonitorConnect(rank=lr, global_rank=lr, pid=PIDS[lr], generation=1, timeouts=TIMEOUTS),
                 T + 2.5),
                (f"mon{lr}", SectionClose(rank=lr, section="step", closes=10, last_duration=1.0, max_duration=1.0),
                 T + 20),
                (f"mon{lr}", MonitorDisconnect(rank=lr, pid=PIDS[lr], generation=1, reason="rank_exited"), T + 49)]
    out += [("agent", RdzvStop(round=0, kind="succeeded", by_node=NODE_ID, detail=StopDetail(nodes=1),
                               restart_count=0, give_up=False), T + 50),
            ("agent", JobEnd(status="succeeded", exit_code=0, seconds=50.0), T + 51),
            ("resume", ResumeStart(mode="loop", pid=5, state_dir="/s", finished_flag="/f", command=["nvrx"],
                                   limits=ResumeLimits(max_attempts=3)), T - 1),
            ("resume", ResumeEnd(action="finished", reason="done", exit_code=0), T + 52)]
    return out


def _file(root: Path, key: str) -> Path:
    return {"agent": root / "rt" / f"agent-{HOST}.jsonl", "resume": root / "state" / "resume.jsonl",
            "rerun": root / "rt" / f"rerun-{HOST}-0.jsonl"}.get(
        key, root / "rt" / f"monitor-{HOST}-{key[3:]}.jsonl")


def write_run(root: Path, sample: Event | None) -> None:
    """The base scenario with SAMPLE in it: replacing the base's record of its class for the same rank, else
    added 5 s into the round (a resume record: into the driver's file)."""
    entries = base_scenario(root)
    if sample is not None:
        key = {"agent": "agent", "resume": "resume", "monitor": "mon1", "rerun": "rerun"}[sample.SOURCE]
        same = [i for i, (k, rec, _) in enumerate(entries) if k == key and type(rec) is type(sample)
                and getattr(rec, "local_rank", 1) == 1]
        if same:
            entries[same[0]] = (key, sample, entries[same[0]][2])
            for i in reversed(same[1:]):
                del entries[i]
        else:
            entries.append((key, sample, T + 5))
    logs: dict[str, EventLog] = {}
    for key, rec, t in sorted(entries, key=lambda x: x[2]):  # each file in time order, as writers write
        if key not in logs:
            logs[key] = EventLog(_file(root, key), key if key in ("agent", "resume", "rerun")
                                 else f"monitor-{key[3:]}")
        logs[key].emit(rec, t=t)
    for log in logs.values():
        log.close()


def read_back(root: Path) -> tuple[str, Any]:
    """Everything a person or a script gets from the run: text report, JSON report, terminal status lines."""
    rep = build_report([root])
    buf = io.StringIO()
    printer = StatusPrinter(console=Console(file=buf, width=400, highlight=False, soft_wrap=True))
    for e in read_events(_file(root, "agent")):
        assert isinstance(e, dict)
        printer(e)
    corpus = "\n".join([render_text(rep, tail_lines=10), json.dumps(report_dict(rep), default=str), buf.getvalue()])
    return corpus, rep


def _samples(cls: type[Event]) -> list[tuple[Event, set[str]]]:
    """Sample records of CLS, one per variant, with the paths whose values the variant fixed."""
    samples = Samples()
    return [(samples.record(cls, cls.EV, variant), {f"{cls.EV}.{k}" for k in variant})  # type: ignore[misc]
            for variant in VARIANTS.get(cls, [{}])]


def _not_shown(path: str) -> bool:
    """PATH, a parent of it, or its whole event is in FIELDS_NOT_SHOWN."""
    parts = path.split(".")
    return f"{parts[0]}.*" in FIELDS_NOT_SHOWN or any(".".join(parts[:i]) in FIELDS_NOT_SHOWN
                                                      for i in range(2, len(parts) + 1))


@pytest.fixture(scope="module")
def base_corpus(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("base")
    write_run(root, None)
    return read_back(root)[0]


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_record_round_trips_to_where_the_reader_shows_it(name, tmp_path, base_corpus):
    cls = RECORDS[name]
    shown: dict[str, bool] = {}
    for i, (sample, fixed) in enumerate(_samples(cls)):
        root = tmp_path / f"v{i}"
        write_run(root, sample)
        corpus, rep = read_back(root)
        assert rep.corrupt["count"] == 0, rep.corrupt  # a reader tripping over a field is a corrupt line
        assert rep.unknown_events == {}
        for path in fixed:  # a value a variant fixes drives a branch of the reader: that variant covers it
            shown[path] = True
        for path, value, checked in leaves(sample, name, fixed):
            if not checked or _not_shown(path):
                continue
            assert not _shown_in(value, base_corpus), f"sample value {value!r} of {path} is in the base run"
            shown[path] = shown.get(path, False) or _shown_in(value, corpus)
    missing = sorted(p for p, ok in shown.items() if not ok)
    assert missing == [], f"fields of {name} not shown and not in FIELDS_NOT_SHOWN: {missing}"


def test_fields_not_shown_name_real_fields():
    """A stale entry (a field renamed or removed) must not linger and hide a new field of the same name."""
    def paths(cls: type[Record], prefix: str) -> set[str]:
        out = {prefix + ".*"}
        for f in dataclasses.fields(cls):
            sub = f"{prefix}.{f.name}"
            out.add(sub)
            inner = next((a for a in (f.type, *typing.get_args(f.type)) if isinstance(a, type) and issubclass(a, Record)),
                         None)
            if inner is not None:
                out |= paths(inner, sub)
        return out

    real = set().union(*(paths(cls, name) for name, cls in RECORDS.items()))
    assert sorted(set(FIELDS_NOT_SHOWN) - real) == []


def test_the_status_line_shows_the_rendezvous_time(tmp_path):
    """Regression: it read `seconds` from rdzv_round, which has `waited`, and always said 0.00 s."""
    buf = io.StringIO()
    log = EventLog(tmp_path / "agent-x-1.jsonl", "agent")
    log.subscribe(StatusPrinter(console=Console(file=buf, width=300, highlight=False)))
    log.emit(RdzvRound(round=2, group_rank=0, nodes=["a", "b"], world_size=4, restart_count=1, waited=3.25))
    log.close()
    assert "round 2: 2 node(s), world size 4" in buf.getvalue() and "rendezvous 3.25 s" in buf.getvalue()


def test_monitor_and_agent_kills_and_lost_ranks_are_shown_not_unknown(tmp_path):
    """Regression: rank_killed, monitor_gave_up and inprocess_rank_lost were counted as unknown events."""
    kinds = {}
    for name in ("rank_killed", "monitor_gave_up", "inprocess_rank_lost", "agent_killed_rank"):
        sample = _samples(RECORDS[name])[0][0]
        write_run(tmp_path / name, sample)
        rep = build_report([tmp_path / name])
        assert rep.unknown_events == {}
        (item,) = [it for it in rep.timeline if it["kind"] == name]
        kinds[name] = item
    assert kinds["rank_killed"]["rank"] == 1 and "its monitor sent" in kinds["rank_killed"]["text"]
    assert kinds["monitor_gave_up"]["rank"] == 1 and kinds["monitor_gave_up"]["level"] == "error"
    assert "the job fails" in kinds["monitor_gave_up"]["text"]
    assert kinds["inprocess_rank_lost"]["rank"] == 1 and "without it" in kinds["inprocess_rank_lost"]["text"]
    assert "the agent sent" in kinds["agent_killed_rank"]["text"]


def test_old_logs_without_records_still_read(tmp_path):
    """Schema version 1 as written before the records: nulls written out, a last_hang copy in the stop."""
    run = tmp_path / "old"
    run.mkdir()
    lines = [
        {"ev": "agent_start", "t": T, "pid": 1, "nproc": 1, "nnodes": "1:1", "max_restarts": 1, "run_id": "old"},
        {"ev": "rdzv_round", "t": T + 1, "round": 0, "group_rank": 0, "nodes": ["n"], "world_size": 1,
         "restart_count": 0, "waited": 0.5},
        {"ev": "rank_start", "t": T + 2, "local_rank": 0, "rank": 0, "pid": 9, "attempt": 0, "how": "fork",
         "seconds": 0.1},
        {"ev": "rdzv_stop", "t": T + 9, "round": 0, "kind": "failed", "by_node": "n", "restart_count": 1,
         "give_up": True, "detail": {"rank": 0, "pid": 9, "exitcode": None, "signal": "SIGKILL", "hang": {
             "rank": 0, "pid": 9, "reason": "heartbeat_timeout", "section": None, "elapsed": 3.0, "timeout": 3.0,
             "signal": "SIGKILL", "t": T + 8, "timeouts": {"heartbeat": 3.0, "out_of_section": None}}}},
        {"ev": "job_end", "t": T + 10, "status": "failed", "exit_code": 1, "seconds": 10.0, "failures": []},
    ]
    (run / "agent-n-1.jsonl").write_text("".join(json.dumps({"v": 1, "src": "agent", **e}) + "\n" for e in lines))
    rep = build_report([run])
    assert rep.corrupt["count"] == 0
    (f,) = rep.faults
    assert f["cause"].startswith("rank 0 hung: no heartbeat for 3.0 s") and f["t"] == T + 5


def test_events_package_stays_a_leaf_of_the_schema():
    """The events package imports nothing of ours but itself: every layer may use it."""
    files = sorted(Path(events.__file__).parent.glob("*.py"))
    assert len(files) == 4
    ours = [n.module for f in files for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "nvrx"
            and not n.module.startswith("nvrx.events")]
    assert ours == []
