"""nvrx.nvrx_cli.inspect_text: the sentences of structured timeline entries and the wording of durations.

Each resume record becomes its sentence; a missing (or null) field reads as '?'; a value of an unexpected type
never raises. Through the real backend too: the backend keeps data (form, fields, level), the renderers word it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from nvrx.events import (
    EventLog, ResumeAttemptEnd, ResumeAttemptStart, ResumeDecision, ResumeEnd, ResumeLimits, ResumeReset,
    ResumeSignal, ResumeStart, ResumeStateRecovered, ResumeSubmit,
)
from nvrx.inspection.run_report import build_report
from nvrx.inspection.timeline import RESUME_LEVEL, Entry
from nvrx.nvrx_cli.inspect_cmd import render_text
from nvrx.nvrx_cli.inspect_text import FORMS, RESUME_TEXT, duration, entry_dict, entry_text, report_dict, seconds

T = 1_700_000_000.0

# (record, its sentence, its level): every resume record, and the branches of their sentences
CASES = [
    (ResumeStart(mode="loop", pid=5, job_id="1001", node="gpu1", state_dir="/s", finished_flag="/f",
                 limits=ResumeLimits(max_attempts=3), command=["nvrx", "launch"]),
     "resume driver started (loop; job 1001, node gpu1)", "info"),
    (ResumeStart(mode="check", pid=5, state_dir="/s", finished_flag="/f", limits=ResumeLimits(), command=["x"]),
     "resume driver started (check)", "info"),
    (ResumeAttemptStart(attempt=2, job_id="1001", node="gpu1", command=["nvrx"], progress=40),
     "resume: attempt 2 starts (job 1001, node gpu1; progress 40)", "info"),
    (ResumeAttemptStart(attempt=1, command=["nvrx"]), "resume: attempt 1 starts", "info"),
    (ResumeAttemptEnd(attempt=2, exit_code=1, cause="crash", progress=50, finished=False, seconds=252.0),
     "resume: attempt 2 ended: exit code 1 (crash) after 4.2 min, progress 50", "warn"),
    (ResumeAttemptEnd(attempt=3, exit_code=143, cause="interrupted", finished=False, seconds=7.5),
     "resume: attempt 3 ended: exit code 143 (interrupted) after 7.50 s", "info"),
    (ResumeAttemptEnd(attempt=4, exit_code=0, cause="clean_exit", finished=True),
     "resume: attempt 4 ended: exit code 0 (clean_exit)", "ok"),
    (ResumeDecision(action="give_up", reason="too many failures", attempts=3, failures=3, excluded_nodes=["gpu2"]),
     "resume decision: give up: too many failures (attempts 3, failures 3); avoiding node(s) gpu2", "error"),
    (ResumeDecision(action="continue", reason="attempt budget left", attempts=1, failures=0),
     "resume decision: continue: attempt budget left", "info"),  # the reason names the attempts: no counts
    (ResumeDecision(action="finished", reason="finished flag found"),
     "resume decision: finished: finished flag found", "ok"),
    (ResumeSubmit(status="submitted", method="sbatch", from_job="1001", command=["sbatch"], exclude=["gpu2", "gpu3"],
                  job_id="1002"),
     "resume: continuation submitted job 1002 (sbatch from job 1001, excluding gpu2, gpu3)", "info"),
    (ResumeSubmit(status="submitting", method="requeue", from_job="1001", command=["scontrol"], exclude=[]),
     "resume: continuation submitting (requeue from job 1001)", "info"),
    (ResumeSubmit(status="failed", method="sbatch", command=["sbatch"], exclude=[], error="sbatch: error: no"),
     "resume: submitting the continuation failed: sbatch: error: no", "error"),
    (ResumeSignal(signal="SIGTERM", forwarded=True, sender_pid=9, attempt=2),
     "resume driver got SIGTERM during attempt 2 (passed to the launch)", "warn"),
    (ResumeSignal(signal="SIGINT", forwarded=False, attempt=1), "resume driver got SIGINT during attempt 1", "warn"),
    (ResumeEnd(action="give_up", reason="too many failures", exit_code=1),
     "resume driver ends: give up (exit code 1)", "info"),
    (ResumeStateRecovered(source="backup", note="the state file was corrupt", corrupt_copy="/s/x.corrupt"),
     "resume state recovered from backup: the state file was corrupt", "warn"),
    (ResumeReset(), "resume state reset (--reset)", "warn"),
]

# each resume form with no fields at all: every field it names reads '?'
MISSING = {
    "resume_start": "resume driver started (?)",
    "resume_attempt_start": "resume: attempt ? starts",
    "resume_attempt_end": "resume: attempt ? ended: exit code ? (?)",
    "resume_decision": "resume decision: ?: ?",
    "resume_submit": "resume: continuation ? (? from job ?)",
    "resume_signal": "resume driver got ? during attempt ?",
    "resume_end": "resume driver ends: ? (exit code ?)",
    "resume_state_recovered": "resume state recovered from ?: ?",
    "resume_reset": "resume state reset (--reset)",
}

BAD_VALUES = ["", "x", -1, 10**30, 1e308, -1e308, float("inf"), True, [], {}, [1, [2]], {"a": {"b": 1}}, ["a", 3]]


def _entry(form: str | None, fields: dict | None, kind: str = "resume:x") -> Entry:
    return Entry(("generic", "f", 1), T, kind, None, form=form, fields=fields)


def _fields(rec: object) -> dict:
    """A record's fields as the backend keeps them: as written (nulls left out)."""
    return {k: v for k, v in dataclasses.asdict(rec).items() if v is not None}  # type: ignore[call-overload]


@pytest.mark.parametrize("rec, text, level", CASES, ids=[f"{type(c[0]).__name__}-{i}" for i, c in enumerate(CASES)])
def test_each_resume_record_becomes_its_sentence(rec, text, level):
    assert entry_text(_entry(rec.EV, _fields(rec))) == text
    assert RESUME_LEVEL[type(rec)](_fields(rec)) == level  # the level is the backend's


def test_every_resume_record_has_a_sentence_and_a_case():
    assert set(RESUME_TEXT) == set(RESUME_LEVEL)
    assert {type(c[0]) for c in CASES} == set(RESUME_TEXT)
    assert set(MISSING) == {cls.EV for cls in RESUME_TEXT} and set(MISSING) <= set(FORMS)


@pytest.mark.parametrize("form", sorted(MISSING))
def test_missing_or_null_fields_read_as_a_question_mark(form):
    assert entry_text(_entry(form, {})) == MISSING[form]
    assert entry_text(_entry(form, None)) == MISSING[form]
    cls = next(c for c in RESUME_TEXT if c.EV == form)
    nulls = {f.name: None for f in dataclasses.fields(cls)}
    assert entry_text(_entry(form, nulls)) == MISSING[form]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_wrongly_typed_field_never_raises(form):
    cls = next((c for c in RESUME_TEXT if c.EV == form), None)
    names = [f.name for f in dataclasses.fields(cls)] if cls else ["run_id", "status", "exit_code", "exit_meaning",
                                                                   "seconds", "errors", "src", "ev", "x"]
    for name in names:
        for bad in BAD_VALUES:
            for base in ({}, _fields(CASES[0][0])):
                text = entry_text(_entry(form, {**base, name: bad}))
                assert isinstance(text, str) and text, (form, name, bad)
    assert isinstance(entry_text(_entry(form, {n: [] for n in names})), str)


def test_an_unknown_form_or_a_failing_one_lists_the_fields():
    assert entry_text(_entry("no_such_form", {"a": 1, "b": "x", "c": [1]}, kind="resume:resume_new")) == \
        "resume:resume new (a=1, b=x)"
    assert entry_text(_entry("event", {"src": "resume", "ev": "resume_something_new", "x": 1, "y": "z" * 100})) == \
        f"resume: resume something new (x=1, y={'z' * 77}...)"
    assert entry_text(_entry("event", {})) == "?: ?"
    assert entry_text(Entry(("k",), T, "round", "round 0: as the backend wrote it")) == \
        "round 0: as the backend wrote it"  # an entry with its own text is shown as it is


def test_a_job_end_is_worded_with_a_human_duration():
    fields = {"run_id": "1001", "status": "failed", "exit_code": 1, "exit_meaning": "failed", "seconds": 10332.0,
              "errors": [["n1", "store lost"], ["n2", "store lost"]]}
    assert entry_text(_entry("job_end", fields, kind="job_end")) == \
        "job 1001 failed (exit code 1: failed) after 2.87 h; node n1: store lost; node n2: store lost"
    assert entry_text(_entry("job_end", {"status": "succeeded", "seconds": 50.0, "errors": "junk"}, "job_end")) == \
        "job ? succeeded (exit code None) after 50.0 s"


def test_durations_for_a_person():
    assert [duration(x) for x in (0.25, 9.994, 12.5, 119.0, 252.0, 7199.0, 10332.0)] == \
        ["0.25 s", "9.99 s", "12.5 s", "119.0 s", "4.2 min", "120.0 min", "2.87 h"]
    assert seconds(30) == "30.0 s" and seconds("x") == "x s" and seconds(True) == "True s" and seconds(None) == "None s"


def test_the_backend_keeps_data_and_every_renderer_words_it(tmp_path):
    """Through the real writer and backend: structured entries, worded in the text and the JSON report alike."""
    log = EventLog(tmp_path / "state" / "resume.jsonl", "resume")
    for i, (rec, _, _) in enumerate(CASES):
        log.emit(rec, t=T + i)
    log.close()
    rep = build_report([tmp_path])
    assert rep.corrupt["count"] == 0 and rep.unknown_events == {}
    assert [(it.form, it.text, it.level) for it in rep.items] == [(type(rec).EV, None, level) for rec, _, level in CASES]
    assert all(d["text"] is None for d in rep.timeline)  # the backend's dicts: data only
    words = [text for _, text, _ in CASES]
    assert [d["text"] for d in report_dict(rep)["timeline"]] == words
    assert [entry_dict(it)["text"] for it in rep.items] == words  # a --follow --json line
    plain = render_text(rep)
    assert all(w in plain for w in words)
    shape = report_dict(rep)["timeline"][0]
    assert list(shape) == ["t", "time", "kind", "level", "text", "job", "round", "rank", "node"]  # before + node
    assert json.loads(json.dumps(report_dict(rep), default=str))["timeline"][0]["kind"] == "resume:resume_start"
