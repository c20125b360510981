"""Words for `nvrx inspect`: the sentences of structured timeline entries, and times for a person.

The backend (``nvrx.inspection``) produces data: most timeline entries come with their sentence, but
the resume driver's events, other writers' events and job ends are structured (``Entry.form`` +
``Entry.fields``); ``entry_text()`` words them here, for every renderer of ``nvrx.nvrx_cli.inspect_cmd``
(rich, plain text, JSON, ``--follow``). Wording never raises: a missing field reads as '?', and a value of
an unexpected type falls back to listing the fields as they are.
"""

from __future__ import annotations

from typing import Any, Callable

from nvrx.events import (
    Event, JobEnd, ResumeAttemptEnd, ResumeAttemptStart, ResumeDecision, ResumeEnd, ResumeReset, ResumeSignal,
    ResumeStart, ResumeStateRecovered, ResumeSubmit,
)
from nvrx.events import RerunAttempt, RerunStats, RerunSuspected, RerunSuspect, RerunVerdict
from nvrx.inspection.run_report import Report
from nvrx.inspection.timeline import Entry

_ENVELOPE = ("v", "t", "src", "ev")


# ------------------------------------------------------------------ times


def duration(x: float) -> str:
    """Seconds for a person: 0.25 s, 12.5 s, 4.2 min, 2.87 h."""
    if x >= 7200:
        return f"{x / 3600:.2f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def seconds(v: Any) -> str:
    """Seconds as written in a sentence (1.00 s, 2.5 min); a value that is not a number as it is."""
    return duration(float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{v} s"


# ------------------------------------------------------------------ structured entries


class _Fields(dict):
    """An entry's fields for a sentence: a missing (or null) one reads as '?'."""

    def __init__(self, fields: dict[str, Any] | None) -> None:
        super().__init__((k, v) for k, v in (fields or {}).items() if v is not None)

    def __missing__(self, key: str) -> str:
        return "?"


def _resume_decision(e: _Fields) -> str:
    f = ResumeDecision.F
    reason = str(e[f.reason])
    counts = (f" (attempts {e[f.attempts]}, failures {e[f.failures]})"
              if f.attempts in e and "attempt" not in reason else "")
    excluded = e.get(f.excluded_nodes)
    avoid = f"; avoiding node(s) {', '.join(map(str, excluded))}" if isinstance(excluded, list) and excluded else ""
    return f"resume decision: {str(e[f.action]).replace('_', ' ')}: {reason}{counts}{avoid}"


def _resume_submit(e: _Fields) -> str:
    f = ResumeSubmit.F
    status = e[f.status]
    if status == "failed":
        return f"resume: submitting the continuation failed: {e[f.error]}"
    job = f" job {e[f.job_id]}" if f.job_id in e else ""
    excluded = e.get(f.exclude)
    avoid = f", excluding {', '.join(map(str, excluded))}" if isinstance(excluded, list) and excluded else ""
    return f"resume: continuation {status}{job} ({e[f.method]} from job {e[f.from_job]}{avoid})"


def _resume_attempt_end(e: _Fields) -> str:
    f = ResumeAttemptEnd.F
    progress = f", progress {e[f.progress]}" if f.progress in e else ""
    secs = f" after {seconds(e[f.seconds])}" if isinstance(e.get(f.seconds), (int, float)) else ""
    return f"resume: attempt {e[f.attempt]} ended: exit code {e[f.exit_code]} ({e[f.cause]}){secs}{progress}"


def _where(e: _Fields, f: Any) -> str:
    parts = [f"job {e[f.job_id]}" if e.get(f.job_id) else "", f"node {e[f.node]}" if e.get(f.node) else ""]
    return ", ".join(p for p in parts if p)


def _resume_start(e: _Fields) -> str:
    f = ResumeStart.F
    return f"resume driver started ({'; '.join(x for x in (str(e[f.mode]), _where(e, f)) if x)})"


def _resume_attempt_start(e: _Fields) -> str:
    f = ResumeAttemptStart.F
    where = "; ".join(x for x in (_where(e, f), f"progress {e[f.progress]}" if f.progress in e else "") if x)
    return f"resume: attempt {e[f.attempt]} starts" + (f" ({where})" if where else "")


def _resume_signal(e: _Fields) -> str:
    f = ResumeSignal.F
    return (f"resume driver got {e[f.signal]} during attempt {e[f.attempt]}"
            f"{' (passed to the launch)' if e.get(f.forwarded) else ''}")


def _resume_end(e: _Fields) -> str:
    f = ResumeEnd.F
    return f"resume driver ends: {str(e[f.action]).replace('_', ' ')} (exit code {e[f.exit_code]})"


def _resume_recovered(e: _Fields) -> str:
    f = ResumeStateRecovered.F
    return f"resume state recovered from {e[f.source]}: {e[f.note]}"


def _resume_reset(e: _Fields) -> str:
    return "resume state reset (--reset)"


# The sentence of each resume driver record (the backend's reader, with each entry's level: RESUME_LEVEL).
RESUME_TEXT: dict[type[Event], Callable[[_Fields], str]] = {
    ResumeStart: _resume_start,
    ResumeAttemptStart: _resume_attempt_start,
    ResumeAttemptEnd: _resume_attempt_end,
    ResumeDecision: _resume_decision,
    ResumeSubmit: _resume_submit,
    ResumeSignal: _resume_signal,
    ResumeEnd: _resume_end,
    ResumeStateRecovered: _resume_recovered,
    ResumeReset: _resume_reset,
}


def _suspects(items: Any) -> str:
    """The suspect ranks of a re-run event: where each ran, what it checked, what it gave (and gives now)."""
    f, out = RerunSuspect.F, []
    for s in items if isinstance(items, list) else []:
        s = _Fields(s if isinstance(s, dict) else {})
        device = f", device {s[f.device]}" if f.device in s else ""
        call = f" (call {s[f.call]})" if f.call in s else ""
        rerun = f", re-run on {s[f.rerun_node]}: {s[f.rerun_result]}" if f.rerun_result in s else ""
        out.append(f"rank {s[f.rank]} on node {s[f.node]}{device}: {s[f.message]}{call} = {s[f.result]}{rerun}")
    return "; ".join(out) or "no rank named"


def _rerun_suspected(e: _Fields) -> str:
    f = RerunSuspected.F
    return f"re-run: step {e[f.step]}: unexpected result ({_suspects(e.get(f.suspects))}); re-running it in place"


_RERUN_WHERE = {"in_place": "in place", "from_checkpoint": "from the checkpoint"}
_RERUN_NEXT = {"verdict": "",
               "checkpoint_and_exit": ": saving a checkpoint and exiting 16 to re-run it on other hardware",
               "exit_again": ": no verdict possible, exiting 16 again"}


def _rerun_attempt(e: _Fields) -> str:
    f = RerunAttempt.F
    where = _RERUN_WHERE.get(e[f.where], e[f.where])
    how = "reproduced the result" if e.get(f.reproduced) else "did not reproduce the result"
    if e.get(f.same_hardware):
        how = "ran on the suspected hardware again"
    nxt = _RERUN_NEXT.get(e[f.next], f": next {e[f.next]}")
    return f"re-run: step {e[f.step]} re-run {where} {how} ({_suspects(e.get(f.suspects))}){nxt}"


_RERUN_DIAGNOSIS = {"transient_error": "transient error (not reproduced in place; training goes on)",
                    "persistent_error": "persistent error of the suspected node (not reproduced on other hardware)",
                    "correct_result": "correct result (reproduced on other hardware: the model or data, not the "
                                      "hardware)"}


def _rerun_verdict(e: _Fields) -> str:
    f = RerunVerdict.F
    diagnosis = _RERUN_DIAGNOSIS.get(e[f.diagnosis], e[f.diagnosis])
    action = str(e[f.action]) + (f" with code {e[f.exit_code]}" if f.exit_code in e else "")
    return f"re-run verdict for step {e[f.step]}: {diagnosis}; {action} ({_suspects(e.get(f.suspects))})"


def _rerun_stats(e: _Fields) -> str:
    f = RerunStats.F
    num = lambda v: f"{v:g}" if isinstance(v, (int, float)) else str(v)  # noqa: E731
    buckets = e.get(f.buckets)
    spread = (" (" + ", ".join(f"{k}: {v}" for k, v in buckets.items()) + ")") if isinstance(buckets, dict) else ""
    return (f"re-run determinism up to step {e[f.step]}: {e[f.message]!r}: {e[f.count]} comparisons, {e[f.nonzero]} "
            f"differed, max relative difference {num(e.get(f.max_diff))}, mean {num(e.get(f.mean_diff))}{spread}")


# The sentence of each re-run state machine record (the backend's levels: timeline.RERUN_LEVEL).
RERUN_TEXT: dict[type[Event], Callable[[_Fields], str]] = {
    RerunSuspected: _rerun_suspected,
    RerunAttempt: _rerun_attempt,
    RerunVerdict: _rerun_verdict,
    RerunStats: _rerun_stats,
}


def _job_end(e: _Fields) -> str:
    """A job's end (run_report): run_id, status, exit_code, exit_meaning, seconds, errors ([node, detail], ...)."""
    meaning = f": {e['exit_meaning']}" if "exit_meaning" in e else ""
    errors = e.get("errors") if isinstance(e.get("errors"), list) else []
    failed = "".join(f"; node {x[0]}: {x[1]}" for x in errors if isinstance(x, (list, tuple)) and len(x) == 2)
    return (f"job {e.get('run_id') or '?'} {e['status']} (exit code {e.get('exit_code')}{meaning}) after "
            f"{seconds(e['seconds'])}{failed}")


def _short(v: Any, limit: int = 80) -> str:
    s = str(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _listing(head: str, fields: dict[str, Any]) -> str:
    """HEAD, then the scalar fields as key=value (long values cut short)."""
    shown = ", ".join(f"{k}={_short(v)}" for k, v in fields.items() if k not in _ENVELOPE
                      and (v is None or isinstance(v, (str, int, float, bool))))
    return head + (f" ({shown})" if shown else "")


def _event(e: _Fields) -> str:
    """Any event (a newer writer's, or a record with wrongly typed fields): src, name and its fields as they are."""
    return _listing(f"{e['src']}: {str(e['ev']).replace('_', ' ')}", {k: v for k, v in e.items()})


# Entry.form -> its sentence.
FORMS: dict[str, Callable[[_Fields], str]] = {
    **{cls.EV: fmt for cls, fmt in RESUME_TEXT.items()},
    **{cls.EV: fmt for cls, fmt in RERUN_TEXT.items()},
    JobEnd.EV: _job_end,
    "event": _event,
}


def entry_text(it: Entry) -> str:
    """The sentence of a timeline entry: its own text, else its form worded from its fields."""
    if it.text is not None:
        return it.text
    fmt = FORMS.get(it.form or "")
    if fmt is not None:
        try:
            return fmt(_Fields(it.fields))
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError):
            pass
    return _listing(str(it.kind).replace("_", " "), it.fields or {})


def entry_dict(it: Entry) -> dict[str, Any]:
    """An entry as in the --json timeline (and one --follow --json line): with its text worded."""
    out = it.to_dict()
    out["text"] = entry_text(it)
    return out


def report_dict(report: Report) -> dict[str, Any]:
    """The --json report: the backend's data, every timeline entry with its text."""
    out = report.to_dict()
    out["timeline"] = [entry_dict(it) for it in report.items]
    return out
